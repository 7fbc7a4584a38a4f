from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_decode_launch.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_dtype = resolve('dtype')
    l_0_rope_dim = resolve('rope_dim')
    l_0_mask = resolve('mask')
    l_0_sinks = resolve('sinks')
    l_0_softcap = resolve('softcap')
    l_0_alibi = resolve('alibi')
    l_0_head_dim = resolve('head_dim')
    l_0_max_query_tokens = resolve('max_query_tokens')
    l_0_kv_layout = resolve('kv_layout')
    l_0_page_size = resolve('page_size')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_call_plans = resolve('call_plans')
    l_0_common = l_0_checks = l_0_step = l_0_config = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_common = context.vars['common'] = environment.get_template('_common.py.jinja', '_decode_launch.py.jinja').make_module(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'config': l_0_config, 'step': l_0_step})
    context.exported_vars.discard('common')
    l_0_checks = context.vars['checks'] = environment.get_template('_checks.py.jinja', '_decode_launch.py.jinja').make_module(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'config': l_0_config, 'step': l_0_step})
    context.exported_vars.discard('checks')
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', '_decode_launch.py.jinja').make_module(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'config': l_0_config, 'step': l_0_step})
    context.exported_vars.discard('step')
    yield '_SM_COUNTS = {}\n_SPLITS = {}  # (programs, key blocks, block_n, sm_count, requested) -> _num_splits(...)\n\n\ndef _sm_count(device):\n    """The device\'s SM count, read once per device (a property query: no sync, so a decode\n    launch can be captured in a CUDA graph); the interpreter assumes INTERPRETER_SM_COUNT."""\n    if device.type != "cuda":\n        return INTERPRETER_SM_COUNT\n    index = torch.cuda.current_device() if device.index is None else device.index\n    if index not in _SM_COUNTS:\n        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count\n    return _SM_COUNTS[index]\n\n\ndef _splits_for(programs, span, block_n, sm_count, requested):\n    """_num_splits(...), remembered under the span\'s key blocks (all the rule reads of it): a\n    decode loop asks the same question at every step, and a growing cache at every step of a\n    block."""\n    key = (programs, -(-span // block_n), block_n, sm_count, requested)\n    answer = _SPLITS.get(key)\n    if answer is None:\n        if len(_SPLITS) >= _LAUNCH_CACHE_SIZE:\n            _SPLITS.clear()\n        answer = _SPLITS[key] = _num_splits(programs, span, block_n, sm_count, requested)\n    return answer\n\n\ndef _num_splits(programs, span, block_n, sm_count, requested=0):\n    """(splits, keys per split): attngen/tiling/decode.py\'s num_splits, integers only. A\n    requested count (decode\'s num_splits, else FORCE_NUM_SPLITS) replaces the rule\'s: the keys\n    in min(requested, MAX_SPLITS) splits of ceil(blocks / that) blocks, the empty ones\n    dropped, so at most one split per key block and MAX_SPLITS in all (the combine\'s bound)."""\n    blocks = max(1, -(-span // block_n))\n    if requested:\n        per_split = -(-blocks // min(requested, MAX_SPLITS))\n        return -(-blocks // per_split), per_split * block_n\n    most = max(1, min(blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))\n    wanted = min(-(-SPLIT_WAVES * sm_count // max(programs, 1)), most)\n    best, best_total, best_waves = wanted, 0, 1\n    for splits in range(wanted, min(2 * wanted, most) + 1):\n        total = programs * splits\n        waves = -(-total // sm_count)\n        if total * best_waves > best_total * waves:  # a fuller last wave\n            best, best_total, best_waves = splits, total, waves\n    per_split = -(-blocks // best)\n    return -(-blocks // per_split), per_split * block_n\n\n\n# The split kernel\'s compile options'
    if ((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype) == 'fp32'):
        pass
        yield ' (fp32: see the Note on fp32 scores)'
    yield '.\n_OPTIONS = {"num_warps": CONFIG["num_warps"], "num_stages": CONFIG["num_stages"]'
    if ((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype) == 'fp32'):
        pass
        yield ',\n            "enable_fp_fusion": False'
    yield '}\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield '\n\ndef _values_are_latent_keys(k_cache, v_cache):\n    """Whether v_cache is k_cache[..., :HEAD_DIM_V] (the absorbed MLA decode\'s latent cache:\n    the values are the keys\' first HEAD_DIM_V dims): the same first element and strides (the\n    shapes are checked), so the kernel may use its latent key tile as V (V_FROM_K). Any other\n    v_cache is read as a tensor of its own."""\n    return (type(v_cache) is torch.Tensor and v_cache.data_ptr() == k_cache.data_ptr()\n            and v_cache.stride() == k_cache.stride())\n'
    yield '\n\n'
    template = environment.get_template('_decode_checks.py.jinja', '_decode_launch.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'config': l_0_config, 'step': l_0_step}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield '\n\n'
    template = environment.get_template('_decode_plan.py.jinja', '_decode_launch.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'config': l_0_config, 'step': l_0_step}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield '\n\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='checks') if l_0_checks is missing else l_0_checks), 'decode_validation')), '\n'))
    yield '\n\n\ndef decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None,\n           sm_scale=None, alibi_slopes=None, return_lse=False, out=None, num_splits=0,\n           rotary_cos=None, rotary_sin=None, rotary_interleaved=True,\n           rotary_q_per_token='
    yield str(((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none'))
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ', sinks=None'
    yield '):\n    """One decode step: the step\'s queries attend to their sequences\' KV caches.\n\n    softmax(q @ k^T * sm_scale'
    if (undefined(name='softcap') if l_0_softcap is missing else l_0_softcap):
        pass
        yield ', softcapped'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield ', ALiBi'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none'):
        pass
        yield ', masked'
    yield ') @ v, exact.\n\n    q [B, HQ, NQ, '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield '] in '
    yield str((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype))
    yield ', NQ <= '
    yield str((undefined(name='max_query_tokens') if l_0_max_query_tokens is missing else l_0_max_query_tokens))
    yield ": the step's last NQ tokens of each sequence.\n"
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '    k_cache [num_pages, '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ', HKV, '
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield '], v_cache [num_pages, '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ', HKV, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '], block_table int32\n    [B, max_pages]: key j of sequence b is slot j % '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ' of page block_table[b, j // '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield '].\n'
    else:
        pass
        yield '    k_cache [B, HKV, Lmax, '
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield '], v_cache [B, HKV, Lmax, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '], any strides; block_table must be None.\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield '    v_cache = k_cache[..., :'
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '] (the latent values; v_new = k_new[..., :'
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield ']) reads\n    each key once; another v_cache is read as a tensor of its own (SEPARATE_V_CONFIG).\n'
    yield '    cache_seqlens int32 [B], contiguous: keys already in the cache; not modified.\n    k_new [B, HKV, NNEW, '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield '], v_new [B, HKV, NNEW, '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield '] (optional): written into the caches in\n    place at positions cache_seqlens[b] .. + NNEW before attending, so sequence b has\n    cache_seqlens[b] + NNEW keys.\n    sm_scale defaults to 1/sqrt('
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield ').'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield " alibi_slopes: [HQ] or [B, HQ] fp32, last dim contiguous; bias\n    -slope * |i' - j|, i' = L_b - NQ + t the query's position."
    yield '\n\n    rotary_cos, rotary_sin [seqlen_ro >= the capacity, rotary_dim / 2] in '
    yield str((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype))
    yield ", any strides\n    (optional, with k_new): flash-attn's rotary embedding, applied by the kernels to the new keys\n    as they are appended and to q as it is loaded (rotary_interleaved: pairs 2i, 2i + 1, else\n    halves), on dims [0, rotary_dim), in float32 rounded to "
    yield str((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype))
    yield ". New key t is at position\n    cache_seqlens[b] + t; query token t at cache_seqlens[b] + t with rotary_q_per_token\n    (flash-attn's causal or local calls), else at cache_seqlens[b]. A query whose position is\n    past cos/sin's rows gets NaN output and LSE.\n"
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield "    sinks: [HQ] float32, contiguous, required: head h's sink logit joins every row's softmax\n    normaliser and LSE (natural log, after the scale); a row that sees no key gets output 0\n    and LSE sinks[h].\n\n"
    yield '    Returns out [B, HQ, NQ, '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield "] in q's dtype, and with return_lse the log-sum-exp\n    [B, HQ, NQ] in float32 (natural log). A query that sees no key (an empty sequence)\n    gets output 0 and LSE -inf. No host synchronization: capturable in a CUDA graph. With\n    out= (that shape, dtype and device, any strides whose elements do not overlap, e.g. a\n    [B, NQ, HQ, "
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield "] tensor transposed; no memory shared with q, the caches or the new keys)\n    the output is written there and out is returned. num_splits: 0 lets the split rule\n    choose; s >= 1 splits the keys in s (flash-attn's hint): at most one split per key\n    block of the call's span and MAX_SPLITS in all (_num_splits). LAST_NUM_SPLITS is the\n    count the latest launch used.\n\n    The kernels never touch memory outside what a sequence was given, whatever the device\n    tensors hold: a sequence whose request does not fit (cache_seqlens[b] < 0,\n    cache_seqlens[b] + NNEW above the capacity "
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield 'max_pages * '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ', or a block-table entry\n    the step reads or appends to outside [0, num_pages))'
    else:
        pass
        yield 'Lmax)'
    yield ' gets NaN output and LSE and\n    nothing appended. NNEW above the capacity raises a ValueError. With the environment\n    variable ATTNGEN_CHECKS=1 (read at each call) the index tensors are validated on the\n    host instead (a device sync, so not in a CUDA graph) and a bad one raises a ValueError\n    naming the tensor, the sequence and the value.\n    """\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '    key = _call_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sm_scale,\n                    alibi_slopes, return_lse, out, num_splits, rotary_cos, rotary_sin,\n                    rotary_interleaved, rotary_q_per_token)\n    if key is not None:\n        plan = _CALL_PLANS.get(key)\n        if plan is not None:\n            done = _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,\n                             out, rotary_cos, rotary_sin)\n            if done is not None:\n                return done if return_lse else done[0]\n'
    yield '    if not _inputs_ok(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new):\n        _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)\n    batch, num_q_heads, num_q_tokens, _ = q.shape\n    num_kv_heads = k_cache.shape['
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '2'
    else:
        pass
        yield '1'
    yield ']\n    '
    yield str(('stride_slopes_b' if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi) else '_'))
    yield ' = _check_alibi(alibi_slopes, num_q_heads, q, batch)\n    if type(num_splits) is not int or num_splits < 0:\n        raise ValueError(f"num_splits: got {num_splits!r}; allowed: an int >= 0 (0: the split "\n                         "rule chooses)")\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield '    _check_sinks(sinks, num_q_heads, q)\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'check_sm_scale')), '\n'))
    yield '\n    num_new = 0 if k_new is None else k_new.shape[2]\n    if out is None:\n        out = q.new_empty((batch, num_q_heads, num_q_tokens, HEAD_DIM_V))\n    else:\n        _check_out(out, (batch, num_q_heads, num_q_tokens, HEAD_DIM_V), q,\n                   (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),\n                    ("v_new", v_new), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)))\n    lse = None\n    if return_lse:\n        lse = q.new_empty((batch, num_q_heads, num_q_tokens), dtype=torch.float32)\n    capacity, num_pages = _cache_size(k_cache, block_table)\n'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '    table, table_strides = block_table, block_table.stride()\n'
    else:
        pass
        yield '    table, table_strides = cache_seqlens, (0, 0)  # unused by the contiguous layout\n'
    yield '    if num_new > capacity:\n        raise ValueError(f"k_new: {num_new} new keys (dim 2) exceed the cache\'s capacity "\n                         f"{capacity}'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield ' (max_pages * PAGE_SIZE)'
    yield '")\n    cos, sin, rotary_ints, rotary_q_step, rotary = _rotary_args(\n        rotary_cos, rotary_sin, rotary_interleaved, rotary_q_per_token, k_new, q, capacity)\n    if _checked():\n        _validate_indices(cache_seqlens, block_table, num_new, num_q_tokens, capacity, num_pages)\n    # The ints that follow the caches\' size: their strides, and `sizes` (split_len, max_cached,\n    # num_pages) below; a plan derives them again at each call (_decode_plan.py.jinja).\n    strides = (*_cache_strides(k_cache), *_cache_strides(v_cache))\n    device = q.get_device()\n    append = split = combine = append_parts = None\n    if batch and num_new:\n        append_blocks = -(-num_new // _APPEND_ROWS)\n        append_parts = ((*k_new.stride(), *v_new.stride()),\n                        (*table_strides, num_kv_heads, num_new, append_blocks, num_q_tokens),\n                        rotary_ints[:4])\n        append = _Step(\n            _append_kernel, batch * num_kv_heads * append_blocks,\n            _ints_around(append_parts, strides, (capacity - num_new, num_pages)),\n            # rotary: no FMA contraction, so the cache holds what torch\'s rotation rounds to\n            (), {"ROWS": _APPEND_ROWS, **rotary}, {"enable_fp_fusion": False} if cos is not q\n            else {},\n        )\n        _run_step(append, device, (k_new, v_new, k_cache, v_cache, cache_seqlens, table, cos, sin))\n    if out.numel() == 0:  # (not planned: nothing to launch but the append)\n        return (out, lse) if return_lse else out\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield '    v_from_k = _values_are_latent_keys(k_cache, v_cache)\n    config = CONFIG if v_from_k else SEPARATE_V_CONFIG\n    options = _OPTIONS if v_from_k else {**_OPTIONS, "num_warps": config["num_warps"],\n                                          "num_stages": config["num_stages"]}\n'
    l_0_config = ('config' if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim) else 'CONFIG')
    context.vars['config'] = l_0_config
    context.exported_vars.add('config')
    yield '    block_n = '
    yield str((undefined(name='config') if l_0_config is missing else l_0_config))
    yield '["BLOCK_N"]\n    q_per_kv = num_q_heads // num_kv_heads\n    rows = q_per_kv * num_q_tokens\n    block_rows = min('
    yield str((undefined(name='config') if l_0_config is missing else l_0_config))
    yield '["BLOCK_M"], max(16, 1 << (rows - 1).bit_length()))\n    num_row_blocks = -(-rows // block_rows)\n    programs = batch * num_kv_heads * num_row_blocks\n    sm_count, requested = _sm_count(q.device), num_splits or FORCE_NUM_SPLITS or 0\n    splits, split_len = _split_count(programs, capacity, block_n, num_q_tokens, sm_count,\n                                     requested)\n    global LAST_NUM_SPLITS\n    LAST_NUM_SPLITS = splits\n    if programs * splits >= 2**31:\n        raise ValueError(f"shape: {programs * splits} programs exceed the grid\'s 2**31 - 1")\n    qk_scale = '
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'kernel_scale')))
    yield '\n    lse_arg = out if lse is None else lse\n    slopes_arg = out if alibi_slopes is None else alibi_slopes\n    part_out = part_lse = out  # unused when one split writes the output directly\n    if splits > 1:\n        part_out, part_lse = _partials(q, batch * num_q_heads * num_q_tokens, splits)\n    sizes = (split_len, capacity - num_new, num_pages)\n    split_parts = (q.stride(), (*out.stride(), *table_strides, num_kv_heads, q_per_kv,\n                                num_q_tokens, num_new, num_row_blocks),\n                   ('
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield 'stride_slopes_b, '
    yield '*rotary_ints, rotary_q_step))\n    split = _Step(\n        _decode_split_kernel, programs * splits,\n        _ints_around(split_parts, strides, (splits, *sizes)), (qk_scale,),\n        {"DIRECT": splits == 1, "STORE_LSE": return_lse, "BLOCK_ROWS": block_rows,\n         "BLOCK_N": block_n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield ', "V_FROM_K": v_from_k'
    yield ', **rotary},\n        '
    yield str(('options' if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim) else '_OPTIONS'))
    yield ',\n    )\n    _run_step(split, device, (q, k_cache, v_cache, out, lse_arg, part_out, part_lse,\n                              cache_seqlens, table, cos, sin, slopes_arg'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ', sinks'
    yield '))\n    if splits > 1:\n        combine = _Step(\n            _decode_combine_kernel, batch * num_q_heads * num_q_tokens,\n            (*out.stride(), num_q_heads, num_q_tokens, splits), (),\n            {"STORE_LSE": return_lse, "BLOCK_SPLITS": max(2, 1 << (splits - 1).bit_length())},\n            {"num_warps": 4},\n        )\n        _run_step(combine, device, (part_out, part_lse, out, lse_arg'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ', sinks'
    yield '))\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '    if key is not None:  # the checks passed: the next call of this layout runs from its plan\n        _remember_launches(\n            key, _launch_class(splits, strides, sizes), (append, split, combine),\n'
        if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
            pass
            yield '            config=(dict(CONFIG), dict(SEPARATE_V_CONFIG)), out_shape=out.shape,\n'
        else:
            pass
            yield '            config=dict(CONFIG), out_shape=out.shape,\n'
        yield '            lse_shape=None if lse is None else lse.shape, num_new=num_new,\n            num_q_tokens=num_q_tokens, programs=programs, block_n=block_n, sm_count=sm_count,\n            requested=requested, rows=batch * num_q_heads * num_q_tokens,\n            append_parts=append_parts, split_parts=split_parts,\n        )\n'
    yield '    return (out, lse) if return_lse else out\n'

blocks = {}
debug_info = '3=30&4=32&5=34&55=37&56=41&58=45&71=49&74=56&77=63&83=65&86=70&88=80&89=86&90=89&91=97&93=104&95=108&96=111&100=116&103=120&107=126&110=128&114=130&120=134&124=136&132=138&139=147&154=151&155=158&159=160&162=163&174=165&181=172&206=176&212=179&213=183&216=185&226=187&235=189&240=193&241=197&244=199&252=203&253=207&257=210'