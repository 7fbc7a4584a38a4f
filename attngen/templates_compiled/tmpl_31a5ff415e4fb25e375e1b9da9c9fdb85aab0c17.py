from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_decode_flash_entry.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_kv_layout = resolve('kv_layout')
    l_0_sinks = resolve('sinks')
    l_0_call_plans = resolve('call_plans')
    l_0_mask = resolve('mask')
    l_0_head_dim = resolve('head_dim')
    l_0_page_size = resolve('page_size')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_paged = l_0_sinks_param = l_0_sinks_arg = missing
    pass
    l_0_paged = ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged')
    context.vars['paged'] = l_0_paged
    context.exported_vars.add('paged')
    l_0_sinks_param = (', sinks=None' if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks) else '')
    context.vars['sinks_param'] = l_0_sinks_param
    context.exported_vars.add('sinks_param')
    l_0_sinks_arg = (', sinks' if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks) else '')
    context.vars['sinks_arg'] = l_0_sinks_arg
    context.exported_vars.add('sinks_arg')
    yield "\n\n# -- flash-attn's layouts -------------------------------------------------------------------\n# decode() reads and writes every tensor through its strides, so a [B, N, H, D] tensor is a\n# [B, H, N, D] view with the same pointer and the same ints. These entry points' full path\n# checks the call in the caller's layout and calls decode() on views, writing a\n# [B, NQ, HQ, DV] output it allocates (or the caller's out=) in place; their plan (the one\n# decode() left for the views, kept under the call's own key, its launches shared) then\n# launches from the caller's tensors themselves: no views, no output view.\n_FLASH_LENGTH_DIM = "
    yield str((0 if (undefined(name='paged') if l_0_paged is missing else l_0_paged) else 1))
    yield "  # decode_flash's caches vary along it ("
    yield str(('pages' if (undefined(name='paged') if l_0_paged is missing else l_0_paged) else 'positions'))
    yield ')\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '_FLASH_PLANS = ({}, {})  # [tensors in flash-attn\'s layout]: _call_key(...) -> a _CallPlan\n\n\ndef _keep_flash_plan(plans, key, views_key, length_dim, out_shape):\n    """Keep under `key` the plan decode() left for the call\'s views (none: nothing kept), as\n    one whose caches vary along length_dim and that allocates a [B, NQ, HQ, DV] output."""\n    plan = _CALL_PLANS.get(views_key)\n    if plan is not None:\n        if len(plans) >= _LAUNCH_CACHE_SIZE:\n            plans.clear()\n        plans[key] = plan.heads_last(length_dim, out_shape)\n'
    yield '\n\ndef _flash_views(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new):\n'
    if (undefined(name='paged') if l_0_paged is missing else l_0_paged):
        pass
        yield '    """decode()\'s [B, H, N, D] views of decode_flash\'s [B, N, H, D] q and new keys (the paged\n    caches as they are), once they pass decode()\'s checks; else the check that fails, named\n    in flash-attn\'s layout."""\n'
    else:
        pass
        yield '    """decode()\'s [B, H, N, D] views of decode_flash\'s [B, N, H, D] q, caches and new keys,\n    once they pass decode()\'s checks; else the check that fails, named in flash-attn\'s\n    layout."""\n'
    yield '    tensors = (q, k_cache, v_cache, k_new, v_new)\n    if all(t is None or (isinstance(t, torch.Tensor) and t.dim() == 4) for t in tensors):\n        views = [None if t is None else t.transpose(1, 2) for t in tensors]\n'
    if (undefined(name='paged') if l_0_paged is missing else l_0_paged):
        pass
        yield '        views[1:3] = k_cache, v_cache\n'
    yield '        if _inputs_ok(*views[:3], cache_seqlens, block_table, *views[3:]):\n            return views\n    _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, flash=True)\n    return views  # (the checks passed, so the tensors had rank 4: views is set)\n\n\ndef _heads_last_decode(flash, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,\n                       sm_scale, alibi_slopes, return_lse, out, num_splits, rotary_cos,\n                       rotary_sin, rotary_interleaved, rotary_q_per_token'
    yield str((undefined(name='sinks_arg') if l_0_sinks_arg is missing else l_0_sinks_arg))
    yield '):\n    """decode_flash (flash: q, caches, new keys in [B, N, H, D]) or decode_flash_out (in\n    [B, H, N, D]): out [B, NQ, HQ, DV], and the LSE [B, HQ, NQ] with return_lse."""\n    length_dim = _FLASH_LENGTH_DIM if flash else _LENGTH_DIM\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '    key = _call_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sm_scale,\n                    alibi_slopes, return_lse, out, num_splits, rotary_cos, rotary_sin,\n                    rotary_interleaved, rotary_q_per_token, length_dim)\n    if key is not None:\n        plan = _FLASH_PLANS[flash].get(key)\n        if plan is not None:\n            done = _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,\n                             out, rotary_cos, rotary_sin)\n            if done is not None:\n                return done if return_lse else done[0]\n'
    yield '    if flash:\n        views = _flash_views(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)\n        capacity = _cache_size(k_cache, block_table, length_dim)[0]\n        if k_new is not None and k_new.shape[1] > capacity:\n            raise ValueError(f"k_new: {k_new.shape[1]} new keys (dim 1) exceed the cache\'s "\n                             f"capacity {capacity}'
    if (undefined(name='paged') if l_0_paged is missing else l_0_paged):
        pass
        yield ' (max_pages * PAGE_SIZE)'
    yield '")\n        q_, k_cache_, v_cache_, k_new_, v_new_ = views\n    else:\n        q_, k_cache_, v_cache_, k_new_, v_new_ = q, k_cache, v_cache, k_new, v_new\n        if not isinstance(q, torch.Tensor) or q.dim() != 4:\n            _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)\n    batch, num_q_heads, num_q_tokens = q_.shape[:3]\n    out_shape = (batch, num_q_tokens, num_q_heads, HEAD_DIM_V)\n    if out is None:\n        out = q.new_empty(out_shape)\n    else:\n        _check_out(out, out_shape, q,\n                   (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),\n                    ("v_new", v_new), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)))\n    out_view = out.transpose(1, 2)\n    result = decode(q_, k_cache_, v_cache_, cache_seqlens, block_table=block_table,\n                    k_new=k_new_, v_new=v_new_, sm_scale=sm_scale, alibi_slopes=alibi_slopes,\n                    return_lse=return_lse, out=out_view, num_splits=num_splits,\n                    rotary_cos=rotary_cos, rotary_sin=rotary_sin,\n                    rotary_interleaved=rotary_interleaved,\n                    rotary_q_per_token=rotary_q_per_token'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ', sinks=sinks'
    yield ')\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '    if key is not None:  # decode() ran: the plan it left for the views serves this layout\n        views_key = _call_key(q_, k_cache_, v_cache_, cache_seqlens, block_table, k_new_,\n                              v_new_, sm_scale, alibi_slopes, return_lse, out_view, num_splits,\n                              rotary_cos, rotary_sin, rotary_interleaved, rotary_q_per_token)\n        _keep_flash_plan(_FLASH_PLANS[flash], key, views_key, length_dim, out_shape)\n'
    yield '    return (out, result[1]) if return_lse else out\n\n\ndef decode_flash(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None,\n                 v_new=None, sm_scale=None, alibi_slopes=None, return_lse=False, out=None,\n                 num_splits=0, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,\n                 rotary_q_per_token='
    yield str(((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none'))
    yield str((undefined(name='sinks_param') if l_0_sinks_param is missing else l_0_sinks_param))
    yield '):\n    """decode() in flash-attn\'s layout (flash_attn_with_kvcache\'s): q [B, NQ, HQ, '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield '],\n'
    if (undefined(name='paged') if l_0_paged is missing else l_0_paged):
        pass
        yield '    k_cache [num_pages, '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ', HKV, '
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield '], v_cache [num_pages, '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ', HKV, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '] (as decode() takes them),\n'
    else:
        pass
        yield '    k_cache [B, Lmax, HKV, '
        yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
        yield '], v_cache [B, Lmax, HKV, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield '],\n'
    yield '    k_new [B, NNEW, HKV, '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield '], v_new [B, NNEW, HKV, '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield '], any strides; the same arguments and\n    checks otherwise (named in this layout), and bit for bit the output, LSE and appended\n    caches decode() gives for their [B, H, N, D] transposes (the same kernel launches: the\n    kernels take strides, so nothing is copied or transposed).\n\n    Returns out [B, NQ, HQ, '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield '] in q\'s dtype, contiguous (with out=: that shape, dtype and\n    device, any strides whose elements do not overlap, no memory shared with the inputs;\n    written in place and returned), and with return_lse also the LSE [B, HQ, NQ] as decode()\n    returns it (flash-attn\'s softmax_lse layout).\n    """\n    return _heads_last_decode(True, q, k_cache, v_cache, cache_seqlens, block_table, k_new,\n                              v_new, sm_scale, alibi_slopes, return_lse, out, num_splits,\n                              rotary_cos, rotary_sin, rotary_interleaved,\n                              rotary_q_per_token'
    yield str((undefined(name='sinks_arg') if l_0_sinks_arg is missing else l_0_sinks_arg))
    yield ')\n\n\ndef decode_flash_out(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None,\n                     v_new=None, sm_scale=None, alibi_slopes=None, return_lse=False, out=None,\n                     num_splits=0, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,\n                     rotary_q_per_token='
    yield str(((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none'))
    yield str((undefined(name='sinks_param') if l_0_sinks_param is missing else l_0_sinks_param))
    yield '):\n    """decode() (every tensor as there: q [B, HQ, NQ, '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield "], as transformers passes it) with its\n    output in flash-attn's layout, out [B, NQ, HQ, "
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield '] as decode_flash returns it\n    (transformers\' attention-function contract): bit for bit decode()\'s output transposed,\n    written where it belongs."""\n    return _heads_last_decode(False, q, k_cache, v_cache, cache_seqlens, block_table, k_new,\n                              v_new, sm_scale, alibi_slopes, return_lse, out, num_splits,\n                              rotary_cos, rotary_sin, rotary_interleaved,\n                              rotary_q_per_token'
    yield str((undefined(name='sinks_arg') if l_0_sinks_arg is missing else l_0_sinks_arg))
    yield ')\n'

blocks = {}
debug_info = '7=19&8=22&9=25&19=29&20=33&36=37&48=44&59=48&63=50&80=54&100=58&101=62&114=66&115=69&116=71&117=74&119=85&121=90&126=94&134=96&140=98&141=101&142=103&148=105'