from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_launch.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_shorter_configs = resolve('shorter_configs')
    l_0_backward = resolve('backward')
    l_0_dropout = resolve('dropout')
    l_0_varlen = resolve('varlen')
    l_0_call_plans = resolve('call_plans')
    l_0_sinks = resolve('sinks')
    l_0_softcap = resolve('softcap')
    l_0_alibi = resolve('alibi')
    l_0_mask = resolve('mask')
    l_0_head_dim = resolve('head_dim')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_dtype = resolve('dtype')
    l_0_bottom_right = resolve('bottom_right')
    l_0_tma = resolve('tma')
    l_0_gluon = resolve('gluon')
    l_0_block_d = resolve('block_d')
    l_0_block_dv = resolve('block_dv')
    l_0_tile_launch = resolve('tile_launch')
    l_0_common = l_0_checks = l_0_step = l_0_launch_config = l_0_entry_prefix = l_0_dropout_param = missing
    try:
        t_1 = environment.filters['indent']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'indent' found.")
    try:
        t_2 = environment.filters['length']
    except KeyError:
        @internalcode
        def t_2(*unused):
            raise TemplateRuntimeError("No filter named 'length' found.")
    pass
    l_0_common = context.vars['common'] = environment.get_template('_common.py.jinja', '_launch.py.jinja').make_module(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'dropout_param': l_0_dropout_param, 'entry_prefix': l_0_entry_prefix, 'launch_config': l_0_launch_config, 'step': l_0_step, 'tile_launch': l_0_tile_launch})
    context.exported_vars.discard('common')
    l_0_checks = context.vars['checks'] = environment.get_template('_checks.py.jinja', '_launch.py.jinja').make_module(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'dropout_param': l_0_dropout_param, 'entry_prefix': l_0_entry_prefix, 'launch_config': l_0_launch_config, 'step': l_0_step, 'tile_launch': l_0_tile_launch})
    context.exported_vars.discard('checks')
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', '_launch.py.jinja').make_module(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'dropout_param': l_0_dropout_param, 'entry_prefix': l_0_entry_prefix, 'launch_config': l_0_launch_config, 'step': l_0_step, 'tile_launch': l_0_tile_launch})
    context.exported_vars.discard('step')
    l_0_launch_config = ('config' if (undefined(name='shorter_configs') if l_0_shorter_configs is missing else l_0_shorter_configs) else 'CONFIG')
    context.vars['launch_config'] = l_0_launch_config
    context.exported_vars.add('launch_config')
    l_0_entry_prefix = ('_forward_' if (undefined(name='backward') if l_0_backward is missing else l_0_backward) else '')
    context.vars['entry_prefix'] = l_0_entry_prefix
    context.exported_vars.add('entry_prefix')
    l_0_dropout_param = (', dropout=None' if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout) else '')
    context.vars['dropout_param'] = l_0_dropout_param
    context.exported_vars.add('dropout_param')
    template = environment.get_template('_launch_helpers.py.jinja', '_launch.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'dropout_param': l_0_dropout_param, 'entry_prefix': l_0_entry_prefix, 'launch_config': l_0_launch_config, 'step': l_0_step, 'tile_launch': l_0_tile_launch}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
            pass
            yield '\n\n'
            template = environment.get_template('_varlen_plan.py.jinja', '_launch.py.jinja')
            gen = template.root_render_func(template.new_context(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'dropout_param': l_0_dropout_param, 'entry_prefix': l_0_entry_prefix, 'launch_config': l_0_launch_config, 'step': l_0_step, 'tile_launch': l_0_tile_launch}))
            try:
                for event in gen:
                    yield event
            finally: gen.close()
        yield '\n\ndef '
        yield str((undefined(name='entry_prefix') if l_0_entry_prefix is missing else l_0_entry_prefix))
        yield 'attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,\n'
        yield str((' ' * t_2((undefined(name='entry_prefix') if l_0_entry_prefix is missing else l_0_entry_prefix))))
        yield '                     max_seqlen_k, *, sm_scale=None, alibi_slopes=None, return_lse=False,\n'
        yield str((' ' * t_2((undefined(name='entry_prefix') if l_0_entry_prefix is missing else l_0_entry_prefix))))
        yield '                     seqused_k=None, out=None'
        yield str((undefined(name='dropout_param') if l_0_dropout_param is missing else l_0_dropout_param))
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks=None'
        yield '):\n    """softmax(q @ k^T * sm_scale'
        if (undefined(name='softcap') if l_0_softcap is missing else l_0_softcap):
            pass
            yield ', softcapped'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield ', ALiBi'
        if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none'):
            pass
            yield ', masked'
        yield ') @ v per packed sequence.\n\n    q [total_q, HQ, '
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield '], k [total_k, HKV, '
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield '], v [total_k, HKV, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '] in '
        yield str((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype))
        yield ', any strides.\n    Sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against the keys and values\n    k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]], or with seqused_k (int32 [B]) against the\n    seqused_k[b] rows from cu_seqlens_k[b] (a KV cache read in place).\n    cu_seqlens_* are int32 [B + 1] and seqused_k int32 [B], contiguous; cu_seqlens_* are\n    nondecreasing within 0..total rows, and seqused_k[b] at most the keys cu_seqlens_k gives\n    sequence b. max_seqlen_q must be at least every query length (the grid is sized from it:\n    the lengths stay on the device); max_seqlen_k is accepted for flash-attn compatibility.\n    Lengths of 0 are allowed.\n    sm_scale defaults to 1/sqrt('
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield ').'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield " alibi_slopes: [HQ] or [B, HQ] fp32, last dim contiguous; bias\n    -slope * |i' - j| with i' "
            if (((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'none') or (undefined(name='bottom_right') if l_0_bottom_right is missing else l_0_bottom_right)):
                pass
                yield '= i + (Nk - Nq) per sequence (bottom-right)'
            else:
                pass
                yield '= i (top-left)'
            yield '.'
        yield '\n\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield "    sinks: [HQ] float32, contiguous, required: head h's sink logit joins every row's softmax\n    normaliser and LSE (natural log, after the scale); a row that sees no key gets output 0\n    and LSE sinks[h].\n\n"
        yield '    Returns out [total_q, HQ, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '] in q\'s dtype (0 in rows no sequence covers),\n    and with return_lse also the log-sum-exp [HQ, total_q] in float32 (flash-attn\'s varlen\n    LSE layout; natural log; -inf for a row that sees no key, whose output is 0). With out=\n    (that shape, dtype and device, any strides whose elements do not overlap, no memory\n    shared with q, k, v) the kernel writes every row of it and out is returned.\n\n    The kernel never reads or writes outside the packed tensors, whatever the device index\n    tensors hold: a sequence that does not lie inside them (or is longer than max_seqlen_q\n    allows) reads nothing, and its rows inside q get NaN output and LSE. With the\n    environment variable ATTNGEN_CHECKS=1 (read at each call) the index tensors are validated\n    on the host instead (a device sync) and a bad one raises a ValueError naming the tensor,\n    the sequence and the value.\n    """\n'
        if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
            pass
            yield '    key = _call_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sm_scale,\n                    alibi_slopes, return_lse, seqused_k, out)\n    if key is not None:\n        plan = _CALL_PLANS.get(key)\n        if plan is not None:\n            done = _run_plan(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k,\n                             out)\n            if done is not None:\n                return done if return_lse else done[0]\n'
        yield '    if not _tensors_ok(q, k, v, 3, 0, DTYPE, HEAD_DIM, HEAD_DIM_V):\n        _check_tensors(q, k, v, "[T, H, D]", DTYPE, HEAD_DIM, HEAD_DIM_V)\n    if not _varlen_ok(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k):\n        _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)\n    if _checked():\n        _validate_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k)\n    total_q, num_q_heads, _ = q.shape\n    num_kv_heads = k.shape[1]\n    '
        yield str(('stride_slopes_b' if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi) else '_'))
        yield ' = _check_alibi(alibi_slopes, num_q_heads, q, cu_seqlens_q.numel() - 1)\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '    _check_sinks(sinks, num_q_heads, q)\n'
        yield '    qk_scale = _kernel_scale(sm_scale)\n    batch = cu_seqlens_q.numel() - 1\n    # Note: not filled here. The kernel writes every row of q (the rows no sequence covers 0\n    # and LSE -inf, a sequence that does not fit NaN; _fill_rows), so a launch needs no fill.\n    if out is None:\n        out = q.new_empty((total_q, num_q_heads, HEAD_DIM_V))\n    else:\n        _check_out(out, (total_q, num_q_heads, HEAD_DIM_V), q, (("q", q), ("k", k), ("v", v)))\n    lse = None\n    if return_lse:\n        lse = torch.empty((num_q_heads, total_q), dtype=torch.float32, device=q.device)\n'
        if (undefined(name='shorter_configs') if l_0_shorter_configs is missing else l_0_shorter_configs):
            pass
            yield '    config = config_for(max(max_seqlen_q, max_seqlen_k))\n'
        yield '    num_m_blocks = -(-max_seqlen_q // '
        yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
        yield '["BLOCK_M"])\n    num_programs = num_m_blocks * batch * num_q_heads\n    if out.numel() == 0 or num_programs == 0:  # no launch: no sequence has a query row\n        out.zero_()\n        if lse is not None:\n            lse.fill_(float("-inf"))\n        return (out, lse) if return_lse else out\n    _check_grid(num_programs)\n    lse_arg = out if lse is None else lse\n    slopes_arg = out if alibi_slopes is None else alibi_slopes\n    used_arg = cu_seqlens_k if seqused_k is None else seqused_k\n'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield '    drop = _dropout_launch(dropout, q)\n'
        yield '    step = _Step(\n        _attn_fwd_kernel, num_programs,\n        (*q.stride(), *k.stride(), *v.stride(), *out.stride(),\n         0 if lse is None else lse.stride(0),\n         num_q_heads, num_q_heads // num_kv_heads, num_m_blocks, total_q, k.shape[0]'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield ',\n         stride_slopes_b'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ',\n         drop["drop_threshold"]'
        yield '),\n        (qk_scale,'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ' drop["keep_scale"]'
        yield '),\n        {"USE_SEQUSED_K": seqused_k is not None,'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ' "DROPOUT_ON": drop["DROPOUT_ON"],'
        yield '         "STORE_LSE": return_lse,\n         "BLOCK_M": '
        yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
        yield '["BLOCK_M"], "BLOCK_N": '
        yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
        yield '["BLOCK_N"]},\n        _options('
        yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
        yield '),\n    )\n    _run_step(step, q.get_device(), (q, k, v, out, lse_arg, slopes_arg,'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ' sinks,'
        yield ' cu_seqlens_q,\n                                     cu_seqlens_k, used_arg'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ', drop["RngState"]'
        yield '))\n'
        if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
            pass
            yield '    if key is not None:  # the checks passed: the next call of this layout runs from its plan\n        _remember_plan(key, config=dict('
            yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
            yield '),\n                       longest=max(max_seqlen_q, max_seqlen_k),\n                       out_shape=out.shape, lse_shape=None if lse is None else lse.shape,\n                       step=step)\n'
        yield '    return (out, lse) if return_lse else out\n'
    else:
        pass
        if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
            pass
            yield '\n\n'
            template = environment.get_template('_tma_load.py.jinja', '_launch.py.jinja')
            gen = template.root_render_func(template.new_context(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'dropout_param': l_0_dropout_param, 'entry_prefix': l_0_entry_prefix, 'launch_config': l_0_launch_config, 'step': l_0_step, 'tile_launch': l_0_tile_launch}))
            try:
                for event in gen:
                    yield event
            finally: gen.close()
        if (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon):
            pass
            yield '\n\n'
            template = environment.get_template('_gluon_launch.py.jinja', '_launch.py.jinja')
            gen = template.root_render_func(template.new_context(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'dropout_param': l_0_dropout_param, 'entry_prefix': l_0_entry_prefix, 'launch_config': l_0_launch_config, 'step': l_0_step, 'tile_launch': l_0_tile_launch}))
            try:
                for event in gen:
                    yield event
            finally: gen.close()
        if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
            pass
            yield '\n\n'
            template = environment.get_template('_call_plan.py.jinja', '_launch.py.jinja')
            gen = template.root_render_func(template.new_context(context.get_all(), True, {'checks': l_0_checks, 'common': l_0_common, 'dropout_param': l_0_dropout_param, 'entry_prefix': l_0_entry_prefix, 'launch_config': l_0_launch_config, 'step': l_0_step, 'tile_launch': l_0_tile_launch}))
            try:
                for event in gen:
                    yield event
            finally: gen.close()
        yield '\n\ndef '
        yield str((undefined(name='entry_prefix') if l_0_entry_prefix is missing else l_0_entry_prefix))
        yield 'attention(q, k, v, *, sm_scale=None, alibi_slopes=None,\n'
        yield str((' ' * t_2((undefined(name='entry_prefix') if l_0_entry_prefix is missing else l_0_entry_prefix))))
        yield '              return_lse=False, out=None'
        yield str((undefined(name='dropout_param') if l_0_dropout_param is missing else l_0_dropout_param))
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks=None'
        yield '):\n    """softmax(q @ k^T * sm_scale'
        if (undefined(name='softcap') if l_0_softcap is missing else l_0_softcap):
            pass
            yield ', softcapped'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield ', ALiBi'
        if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none'):
            pass
            yield ', masked'
        yield ') @ v.\n\n    q [B, HQ, M, '
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield '], k [B, HKV, N, '
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield '], v [B, HKV, N, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '] in '
        yield str((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype))
        yield ', any strides.\n    sm_scale defaults to 1/sqrt('
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield ').'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield " alibi_slopes: [HQ] or [B, HQ] fp32, last dim contiguous; bias\n    -slope * |i' - j| with i' "
            if (((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'none') or (undefined(name='bottom_right') if l_0_bottom_right is missing else l_0_bottom_right)):
                pass
                yield '= i + (N - M) (bottom-right)'
            else:
                pass
                yield '= i (top-left)'
            yield '.'
        yield '\n\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield "    sinks: [HQ] float32, contiguous, required: head h's sink logit joins every row's softmax\n    normaliser and LSE (natural log, after the scale); a row that sees no key gets output 0\n    and LSE sinks[h].\n\n"
        yield '    Returns out [B, HQ, M, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield "] in q's dtype, and with return_lse also the\n    log-sum-exp of the scores [B, HQ, M] in float32 (natural log; -inf for a row that sees\n    no key, whose output is 0). With out= (that shape, dtype and device, any strides whose\n    elements do not overlap, e.g. a [B, M, HQ, "
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '] tensor transposed; no memory shared with\n    q, k, v) the output is written there and out is returned.\n    """\n'
        if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
            pass
            yield '    key = _call_key(q, k, v, sm_scale, alibi_slopes, return_lse, out)\n    if key is not None:\n        plan = _CALL_PLANS.get(key)\n        if plan is not None:\n            done = _run_plan(plan, q, k, v, out)\n            if done is not None:\n                return done if return_lse else done[0]\n'
        yield '    if not _tensors_ok(q, k, v, 4, 2, DTYPE, HEAD_DIM, HEAD_DIM_V):\n        _check_tensors(q, k, v, "[B, H, N, D]", DTYPE, HEAD_DIM, HEAD_DIM_V)\n    if not (q.shape[0] == k.shape[0] == v.shape[0]):\n        raise ValueError(\n            f"batch: expected equal sizes, got q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}"\n        )\n    batch, num_q_heads, seqlen_q, _ = q.shape\n    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]\n    '
        yield str(('stride_slopes_b' if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi) else '_'))
        yield ' = _check_alibi(alibi_slopes, num_q_heads, q, batch)\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '    _check_sinks(sinks, num_q_heads, q)\n'
        yield '    qk_scale = _kernel_scale(sm_scale)\n    if out is None:\n        out = q.new_empty((batch, num_q_heads, seqlen_q, HEAD_DIM_V))\n    else:\n        _check_out(out, (batch, num_q_heads, seqlen_q, HEAD_DIM_V), q,\n                   (("q", q), ("k", k), ("v", v)))\n    lse = None\n    if return_lse:\n        lse = q.new_empty((batch, num_q_heads, seqlen_q), dtype=torch.float32)\n    if out.numel() == 0:\n        return (out, lse) if return_lse else out\n'
        if (undefined(name='shorter_configs') if l_0_shorter_configs is missing else l_0_shorter_configs):
            pass
            yield '    config = config_for(max(seqlen_q, seqlen_k))\n'
        yield '    num_m_blocks = -(-seqlen_q // '
        yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
        yield '["BLOCK_M"])\n    num_programs = num_m_blocks * batch * num_q_heads\n    _check_grid(num_programs)\n    # Unused pointer arguments (LSE without return_lse, slopes without ALiBi) get `out`.\n    lse_arg = out if lse is None else lse\n    slopes_arg = out if alibi_slopes is None else alibi_slopes\n'
        if (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon):
            pass
            yield '    gluon_plan = _gluon_layout(q, k, v, out, return_lse)\n    gluon_why = _gluon_why(gluon_plan, q, k, v, out)  # None: the Gluon kernel runs the call\n'
        if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
            pass
            yield '    block_n = '
            yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
            yield '["BLOCK_N"]\n    pairs = num_programs * -(-seqlen_k // block_n)\n    use_tma = '
            if (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon):
                pass
                yield 'gluon_why is not None and '
            yield 'pairs > POINTER_LOADS_UP_TO and _uses_tma(k, v)\n    k_desc = v_desc = None\n    if use_tma:\n        k_desc = _descriptor(k, (1, 1, block_n, '
            yield str((undefined(name='block_d') if l_0_block_d is missing else l_0_block_d))
            yield '))\n        v_desc = _descriptor(v, (1, 1, block_n, '
            yield str((undefined(name='block_dv') if l_0_block_dv is missing else l_0_block_dv))
            yield '))\n'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield '    drop = _dropout_launch(dropout, q)\n'
        yield '    ints = (*q.stride(), *k.stride(), *v.stride(), *out.stride(),\n            num_q_heads, num_q_heads // num_kv_heads, seqlen_q, seqlen_k, num_m_blocks'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield ',\n            stride_slopes_b'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ',\n            drop["drop_threshold"]'
        yield ')\n    constexprs = {'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield '"DROPOUT_ON": drop["DROPOUT_ON"], '
        yield '"STORE_LSE": return_lse, "BLOCK_M": '
        yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
        yield '["BLOCK_M"],\n                  "BLOCK_N": '
        yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
        yield '["BLOCK_N"]'
        if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
            pass
            yield ', "USE_TMA": use_tma'
        yield '}\n    options = _options('
        yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
        yield ')\n'
        t_3 = []
        pass
        t_3.append(
            '    _launch(\n        _attn_fwd_kernel, num_programs, q.get_device(),\n        (q, k, v, out, lse_arg, slopes_arg',
        )
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            t_3.append(
                ', sinks',
            )
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            t_3.append(
                ', drop["RngState"]',
            )
        t_3.append(
            '),\n        ints, (qk_scale,',
        )
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            t_3.append(
                ' drop["keep_scale"],',
            )
        if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
            pass
            t_3.append(
                ' k_desc, v_desc',
            )
        t_3.append(
            '),\n        constexprs, options,\n    )\n',
        )
        l_0_tile_launch = (Markup if context.eval_ctx.autoescape else identity)(concat(t_3))
        context.vars['tile_launch'] = l_0_tile_launch
        context.exported_vars.add('tile_launch')
        if (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon):
            pass
            yield '    if gluon_why is None:\n        _gluon_run(gluon_plan[0], q, k, v, out, lse_arg, qk_scale)\n    else:\n'
            yield str(t_1((undefined(name='tile_launch') if l_0_tile_launch is missing else l_0_tile_launch), 4, first=True))
        else:
            pass
            yield str((undefined(name='tile_launch') if l_0_tile_launch is missing else l_0_tile_launch))
        if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
            pass
            yield '    if key is not None:  # the checks passed: the next call of this layout runs from its plan\n        _remember_plan(\n            key, config=dict('
            yield str((undefined(name='launch_config') if l_0_launch_config is missing else l_0_launch_config))
            yield '), longest=max(seqlen_q, seqlen_k),\n            grid=num_programs, ints=ints, qk_scale=qk_scale,\n            out_shape=(batch, num_q_heads, seqlen_q, HEAD_DIM_V),\n            lse_shape=None if lse is None else lse.shape, options=options,\n'
            if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
                pass
                yield '            constexprs={False: dict(constexprs, USE_TMA=False),\n                        True: dict(constexprs, USE_TMA=True)},\n            pairs=pairs, tma_layout=_tma_layout_fits(k, v),\n'
            else:
                pass
                yield '            constexprs={False: constexprs}, pairs=0, tma_layout=False,\n'
            if (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon):
                pass
                yield '            gluon=gluon_plan,\n'
            yield '        )\n'
        yield '    return (out, lse) if return_lse else out\n'

blocks = {}
debug_info = '4=42&5=44&6=46&9=48&12=51&13=54&14=57&15=63&16=65&19=68&23=75&24=77&25=79&26=86&28=96&37=104&38=109&41=117&46=121&59=123&78=127&79=129&93=133&96=137&107=139&114=143&115=146&117=150&118=154&120=158&121=162&123=164&124=168&125=172&127=175&134=180&137=183&139=189&142=192&144=198&147=201&151=208&152=210&153=217&155=227&156=235&157=240&160=248&165=252&168=254&171=256&188=260&189=262&203=266&206=270&212=272&216=275&217=278&219=280&222=284&223=286&225=288&229=292&230=295&232=299&233=305&234=311&238=318&239=331&235=344&243=347&247=350&249=353&251=354&254=357&258=359&265=365'