from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_flash_entry.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_backward = resolve('backward')
    l_0_sinks = resolve('sinks')
    l_0_call_plans = resolve('call_plans')
    l_0_head_dim = resolve('head_dim')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_extra_params = l_0_extra_args = l_0_options = missing
    pass
    l_0_extra_params = ((', dropout_p=0.0, rng_state=None' if (undefined(name='backward') if l_0_backward is missing else l_0_backward) else '') + (', sinks=None' if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks) else ''))
    context.vars['extra_params'] = l_0_extra_params
    context.exported_vars.add('extra_params')
    l_0_extra_args = ((', dropout_p=dropout_p, rng_state=rng_state' if (undefined(name='backward') if l_0_backward is missing else l_0_backward) else '') + (', sinks=sinks' if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks) else ''))
    context.vars['extra_args'] = l_0_extra_args
    context.exported_vars.add('extra_args')
    l_0_options = ((', dropout_p, rng_state' if (undefined(name='backward') if l_0_backward is missing else l_0_backward) else '') + (', sinks' if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks) else ''))
    context.vars['options'] = l_0_options
    context.exported_vars.add('options')
    yield "\n\n# -- flash-attn's output layout -------------------------------------------------------------\n# attention() reads and writes every tensor through its strides, so a [B, N, H, D] tensor is\n# a [B, H, N, D] view with the same pointer and the same ints. These entry points' full path\n# calls attention() on views, writing a [B, M, HQ, DV] output it allocates (or the caller's\n# out=) in place; their plan (the one attention() left for the views, kept under the call's\n# own key) then launches from the caller's tensors themselves: no views, no output view, and\n# no out= layout or storage checks when the output is the plan's own.\n"
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '_FLASH_PLANS = ({}, {})  # [q, k, v in [B, N, H, D]]: _call_key(...) -> a heads-last _CallPlan\n\n\ndef _keep_flash_plan(plans, key, views_key, flash, out_shape):\n    """Keep under `key` the plan attention() left for the call\'s views (none: nothing kept),\n    as one that allocates a [B, M, HQ, DV] output (_CallPlan.heads_last)."""\n    plan = _CALL_PLANS.get(views_key)\n    if plan is not None:\n        if len(plans) >= _LAUNCH_CACHE_SIZE:\n            plans.clear()\n        plans[key] = plan.heads_last(flash, out_shape)\n'
    yield '\n\ndef _check_rank4(q, k, v, layout):\n    for name, t in (("q", q), ("k", k), ("v", v)):\n        if not isinstance(t, torch.Tensor):\n            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")\n        if t.dim() != 4:\n            raise ValueError(f"{name}: expected rank 4 {layout}, got {tuple(t.shape)}")\n\n\ndef _heads_last_out(q, k, v, flash, sm_scale, alibi_slopes, return_lse,\n                    out'
    yield str((undefined(name='options') if l_0_options is missing else l_0_options))
    yield '):\n    """attention_flash (flash: q, k, v in [B, N, H, D]) or attention_flash_out (in\n    [B, H, N, D]): out [B, M, HQ, DV], and the LSE with return_lse."""\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        if (undefined(name='backward') if l_0_backward is missing else l_0_backward):
            pass
            yield '    key = None\n    if type(dropout_p) is float and not dropout_p and not _needs_grad(q, k, v):\n        key = _call_key(q, k, v, sm_scale, alibi_slopes, return_lse, out)\n'
        else:
            pass
            yield '    key = _call_key(q, k, v, sm_scale, alibi_slopes, return_lse, out)\n'
        yield '    if key is not None:\n        plan = _FLASH_PLANS[flash].get(key)\n        if plan is not None:\n            done = _run_plan(plan, q, k, v, out)\n            if done is not None:\n                return done if return_lse else done[0]\n'
    yield '    _check_rank4(q, k, v, "[B, N, H, D]" if flash else "[B, H, N, D]")\n    views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)) if flash else (q, k, v)\n'
    if (undefined(name='backward') if l_0_backward is missing else l_0_backward):
        pass
        yield '    if _needs_grad(q, k, v'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks'
        yield '):\n        _refuse_out_with_grad(out)\n        result = attention(*views, sm_scale=sm_scale, alibi_slopes=alibi_slopes,\n                           return_lse=return_lse, dropout_p=dropout_p, rng_state=rng_state'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ',\n                           sinks=sinks'
        yield ')\n        return (result[0].transpose(1, 2), result[1]) if return_lse else result.transpose(1, 2)\n'
    yield '    batch, num_q_heads, seqlen_q = views[0].shape[:3]\n    out_shape = (batch, seqlen_q, num_q_heads, HEAD_DIM_V)\n    if out is None:\n        out = q.new_empty(out_shape)\n    else:\n        _check_out(out, out_shape, q, (("q", q), ("k", k), ("v", v)))\n    out_view = out.transpose(1, 2)\n    result = attention(*views, sm_scale=sm_scale, alibi_slopes=alibi_slopes,\n                       return_lse=return_lse,\n                       out=out_view'
    yield str((undefined(name='extra_args') if l_0_extra_args is missing else l_0_extra_args))
    yield ')\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '    if key is not None:  # attention() ran: the plan it left for the views serves this layout\n        _keep_flash_plan(_FLASH_PLANS[flash], key,\n                         _call_key(*views, sm_scale, alibi_slopes, return_lse, out_view), flash,\n                         out_shape)\n'
    yield '    return (out, result[1]) if return_lse else out\n\n\ndef attention_flash(q, k, v, *, sm_scale=None, alibi_slopes=None, return_lse=False,\n                    out=None'
    yield str((undefined(name='extra_params') if l_0_extra_params is missing else l_0_extra_params))
    yield '):\n    """attention() in flash-attn\'s layout: q [B, M, HQ, '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield '], k [B, N, HKV, '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield '],\n    v [B, N, HKV, '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield '], any strides; the same arguments and checks otherwise, and bit for\n    bit the output attention() gives for their [B, H, N, D] transposes (the same kernel\n    launch: the kernel takes strides, so nothing is copied or transposed).\n\n    Returns out [B, M, HQ, '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield "] in q's dtype, contiguous (with out=: that shape, dtype and\n    device, any strides whose elements do not overlap, no memory shared with q, k, v; written\n    in place and returned), and with return_lse also the LSE [B, HQ, M] as attention() does."
    if (undefined(name='backward') if l_0_backward is missing else l_0_backward):
        pass
        yield '\n    When q, k or v requires grad, out= is refused and out is the [B, M, HQ, '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield "] transpose\n    of attention()'s new output (a tensor of the autograd graph)."
    yield '\n    """\n    return _heads_last_out(q, k, v, True, sm_scale, alibi_slopes, return_lse,\n                           out'
    yield str((undefined(name='options') if l_0_options is missing else l_0_options))
    yield ')\n\n\ndef attention_flash_out(q, k, v, *, sm_scale=None, alibi_slopes=None, return_lse=False,\n                        out=None'
    yield str((undefined(name='extra_params') if l_0_extra_params is missing else l_0_extra_params))
    yield '):\n    """attention() (q, k, v [B, H, N, D] as there) with its output in flash-attn\'s layout,\n    out [B, M, HQ, '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield '] as attention_flash returns it (transformers\' attention-function\n    contract): bit for bit attention()\'s output transposed, written where it belongs."""\n    return _heads_last_out(q, k, v, False, sm_scale, alibi_slopes, return_lse,\n                           out'
    yield str((undefined(name='options') if l_0_options is missing else l_0_options))
    yield ')\n'

blocks = {}
debug_info = '6=17&7=20&8=23&18=27&42=31&45=33&46=35&62=43&63=46&66=50&79=55&80=57&90=61&91=63&92=67&96=69&98=71&100=74&105=77&109=79&111=81&114=83'