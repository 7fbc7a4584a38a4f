from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_autograd.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_varlen = resolve('varlen')
    l_0_shorter_configs = resolve('shorter_configs')
    l_0_dropout = resolve('dropout')
    l_0_sinks = resolve('sinks')
    l_0_common = l_0_entry = l_0_fwd_config = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_common = context.vars['common'] = environment.get_template('_common.py.jinja', '_autograd.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'entry': l_0_entry, 'fwd_config': l_0_fwd_config})
    context.exported_vars.discard('common')
    l_0_entry = ('attention_varlen' if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen) else 'attention')
    context.vars['entry'] = l_0_entry
    context.exported_vars.add('entry')
    l_0_fwd_config = ('config_for(max(max_seqlen_q, max_seqlen_k))' if (undefined(name='shorter_configs') if l_0_shorter_configs is missing else l_0_shorter_configs) else 'CONFIG')
    context.vars['fwd_config'] = l_0_fwd_config
    context.exported_vars.add('fwd_config')
    yield '\n\ndef _resolved_sm_scale(sm_scale):\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'check_sm_scale')), '\n'))
    yield '\n    return float(sm_scale)\n\n\n'
    if (not (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout)):
        pass
        yield '_DROP_BITS = 16\n\n\n'
    yield 'def _dropout_option(q, dropout_p, rng_state):\n    """None (no dropout) or (rng_state, threshold): keep a score when its 16-bit uniform is\n    >= threshold = round(dropout_p * 2**16); rng_state is int64 [2] (seed, Philox offset) on\n    q\'s device, drawn from torch\'s default generator when not given (so torch.manual_seed\n    reproduces it)."""\n    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not (\n            0.0 <= dropout_p < 1.0):\n        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")\n    threshold = round(dropout_p * 2**_DROP_BITS)\n    if threshold == 0:\n        return None\n'
    if (not (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout)):
        pass
        yield '    raise ValueError(f"dropout_p: got {dropout_p!r}; this module was built with dropout: false "\n                     "(pass 0.0, or build a spec with dropout: true)")\n'
    else:
        pass
        yield '    if threshold >= 2**_DROP_BITS:\n        raise ValueError(f"dropout_p: {dropout_p!r} rounds to 1 in steps of 1/65536; "\n                         "expected a float in [0, 1 - 2**-17)")\n    if rng_state is None:\n        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))\n        rng_state = torch.tensor([seed, 0], dtype=torch.int64, device=q.device)\n    elif (not isinstance(rng_state, torch.Tensor) or rng_state.shape != (2,)\n          or rng_state.dtype != torch.int64 or rng_state.device != q.device):\n        got = (f"{tuple(rng_state.shape)} {rng_state.dtype} on {rng_state.device}"\n               if isinstance(rng_state, torch.Tensor) else repr(rng_state))\n        raise ValueError(f"rng_state: expected an int64 tensor [2] (seed, offset) on "\n                         f"{q.device}, got {got}")\n    return rng_state.contiguous(), threshold\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '\n\ndef _dropout_launch(dropout, q):\n    """The dropout arguments of a kernel launch (DROPOUT_ON=False: compiled without the RNG)."""\n    if dropout is None:\n        return {"RngState": q, "drop_threshold": 0, "keep_scale": 1.0, "DROPOUT_ON": False}\n    rng_state, threshold = dropout\n    return {"RngState": rng_state, "drop_threshold": threshold,\n            "keep_scale": 2**_DROP_BITS / (2**_DROP_BITS - threshold), "DROPOUT_ON": True}\n'
    yield '\n\n'
    template = environment.get_template('_backward_launch.py.jinja', '_autograd.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'entry': l_0_entry, 'fwd_config': l_0_fwd_config}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield '\n\nclass _AttentionFunction(torch.autograd.Function):\n    """(out, lse) = the forward kernel; backward = the gradient kernels (_backward):\n    deterministic=True, no atomics, so gradients are bitwise reproducible; False, dQ added by\n    fp32 atomics (five products, not seven). ALiBi slopes get no gradient (as in\n    flash-attn)'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield '; the sinks do, when they require it'
    yield '."""\n\n    @staticmethod\n    def forward(ctx, q, k, v, sm_scale, alibi_slopes, dropout, lengths'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ', sinks'
    yield ',\n                deterministic=True):\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = lengths\n        out, lse = _forward_attention_varlen(\n            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sm_scale=sm_scale,\n            alibi_slopes=alibi_slopes, return_lse=True'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ', dropout=dropout'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ',\n            sinks=sinks'
        yield ')\n'
    else:
        pass
        yield '        out, lse = _forward_attention(q, k, v, sm_scale=sm_scale, alibi_slopes=alibi_slopes,\n                                      return_lse=True'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ', dropout=dropout'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ',\n                                      sinks=sinks'
        yield ')\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield '        ctx.save_for_backward(q, k, v, out, lse, sinks)\n'
    else:
        pass
        yield '        ctx.save_for_backward(q, k, v, out, lse)\n'
    yield '        ctx.options = (sm_scale, alibi_slopes, dropout, lengths)\n        ctx.deterministic = deterministic\n        ctx.set_materialize_grads(False)\n        return out, lse\n\n    @staticmethod\n    def backward(ctx, dout, dlse):\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield '        q, k, v, out, lse, sinks = ctx.saved_tensors\n        if dout is None:\n            dout = torch.zeros_like(out)\n        dq, dk, dv, dsinks = _backward(dout, q, k, v, out, lse, dlse, *ctx.options, sinks,\n                                       deterministic=ctx.deterministic)\n        return (dq, dk, dv, None, None, None, None,\n                dsinks if ctx.needs_input_grad[7] else None, None)\n'
    else:
        pass
        yield '        q, k, v, out, lse = ctx.saved_tensors\n        if dout is None:\n            dout = torch.zeros_like(out)\n        dq, dk, dv = _backward(dout, q, k, v, out, lse, dlse, *ctx.options,\n                               deterministic=ctx.deterministic)\n        return dq, dk, dv, None, None, None, None, None\n'
    yield '\n\ndef _check_deterministic(deterministic):\n    if not isinstance(deterministic, bool):\n        raise ValueError(f"deterministic: expected True or False, got {deterministic!r}")\n\n\ndef _needs_grad(*tensors):\n    return torch.is_grad_enabled() and any(\n        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)\n\n\ndef _refuse_out_with_grad(out):\n    if out is not None:\n        raise ValueError("out: not supported when q, k or v requires grad (the output is a new "\n                         "tensor of the autograd graph); pass out=None")\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '\n\ndef _check_key_lengths(cu_seqlens_k, max_seqlen_k):\n    """ATTNGEN_CHECKS=1: the backward\'s grid covers max_seqlen_k keys per sequence."""\n    bounds = cu_seqlens_k.tolist()\n    for b in range(len(bounds) - 1):\n        if bounds[b + 1] - bounds[b] > max_seqlen_k:\n            raise ValueError(f"cu_seqlens_k: sequence {b} has {bounds[b + 1] - bounds[b]} keys, "\n                             f"more than max_seqlen_k = {max_seqlen_k} (the backward\'s bound)")\n\n\ndef attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,\n                     sm_scale=None, alibi_slopes=None, return_lse=False, seqused_k=None,\n                     out=None, dropout_p=0.0, rng_state=None'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks=None'
        yield ',\n                     deterministic=True):\n    """The packed-sequence attention of _forward_attention_varlen (same arguments, layout and\n    results), differentiable in q, k, v (and through the LSE) when one of them requires grad\n    (then without out=: the output is a new tensor of the autograd graph).\n\n    For the backward, max_seqlen_k must also bound every key length (a sequence with more\n    keys gets NaN gradients; ATTNGEN_CHECKS=1 raises instead); seqused_k (a KV cache read in\n    place) has no backward. dropout_p in [0, 1) (training; rounded to steps of 1/65536,\n    kept values scaled exactly by 1 / (1 - rounded p))'
        if (not (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout)):
            pass
            yield '; it needs a module\n    built with dropout: true'
        yield ".\n    rng_state (int64 [2]: seed, Philox offset, on q's device) defaults to a draw from torch's\n    default generator. deterministic: the backward's path (_backward): True (the default)\n    bitwise reproducible, False dQ by fp32 atomics (five products).\n"
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '    sinks [HQ] fp32 (required) get a gradient when they require one.\n'
        yield '\n    """\n    dropout = _dropout_option(q, dropout_p, rng_state)\n    _check_deterministic(deterministic)\n    if not _needs_grad(q, k, v'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks'
        yield '):\n        return _forward_attention_varlen(\n            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sm_scale=sm_scale,\n            alibi_slopes=alibi_slopes, return_lse=return_lse, seqused_k=seqused_k, out=out'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ',\n            dropout=dropout'
            if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
                pass
                yield ', sinks=sinks'
        elif (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ',\n            sinks=sinks'
        yield ')\n    _refuse_out_with_grad(out)\n    if seqused_k is not None:\n        raise ValueError("seqused_k: no backward for a KV cache read in place; pass None when "\n                         "q, k or v requires grad")\n    sm_scale = _resolved_sm_scale(sm_scale)\n    if _checked() and isinstance(cu_seqlens_k, torch.Tensor):\n        _check_key_lengths(cu_seqlens_k, max_seqlen_k)\n    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)\n    out, lse = _AttentionFunction.apply(q, k, v, sm_scale, alibi_slopes, dropout, lengths,\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield 'sinks, '
        yield 'deterministic)\n    return (out, lse) if return_lse else out\n\n\ndef attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,\n                              max_seqlen_k, *, sm_scale=None, alibi_slopes=None, dropout_p=0.0,\n                              rng_state=None, dlse=None'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks=None'
        yield ',\n                              deterministic=True):\n    """(dq, dk, dv'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', dsinks'
        yield ") of attention_varlen for the output gradient dout (and dlse, the LSE's),\n    given its out and lse [HQ, total_q]; dropout_p and rng_state as the forward had them"
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ';\n    sinks [HQ] fp32 (required) as well, dsinks [HQ] fp32 their gradient'
        yield ';\n    deterministic as attention_varlen\'s."""\n    dropout = _dropout_option(q, dropout_p, rng_state)\n    _check_deterministic(deterministic)\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '    _check_sinks(sinks, q.shape[1], q)\n'
        yield '    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)\n    return _backward(dout, q, k, v, out, lse, dlse, _resolved_sm_scale(sm_scale),\n                     alibi_slopes, dropout, lengths'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks'
        yield ',\n                     deterministic=deterministic)\n'
    else:
        pass
        yield '\n\ndef attention(q, k, v, *, sm_scale=None, alibi_slopes=None, return_lse=False, out=None,\n              dropout_p=0.0, rng_state=None'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks=None'
        yield ', deterministic=True):\n    """The attention of _forward_attention (same arguments, layout and results),\n    differentiable in q, k, v (and through the LSE) when one of them requires grad (then\n    without out=: the output is a new tensor of the autograd graph).\n\n    dropout_p in [0, 1) (training; rounded to steps of 1/65536, kept values scaled exactly by\n    1 / (1 - rounded p))'
        if (not (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout)):
            pass
            yield '; it needs a module built with dropout: true'
        yield ".\n    rng_state (int64 [2]: seed, Philox offset, on q's device) defaults to a draw from torch's\n    default generator. deterministic: the backward's path (_backward): True (the default)\n    bitwise reproducible, False dQ by fp32 atomics (five products).\n"
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '    sinks [HQ] fp32 (required) get a gradient when they require one.\n'
        yield '\n    """\n    dropout = _dropout_option(q, dropout_p, rng_state)\n    _check_deterministic(deterministic)\n    if not _needs_grad(q, k, v'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks'
        yield '):\n        return _forward_attention(q, k, v, sm_scale=sm_scale, alibi_slopes=alibi_slopes,\n                                  return_lse=return_lse, out=out'
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            yield ',\n                                  dropout=dropout'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks=sinks'
        yield ')\n    _refuse_out_with_grad(out)\n    sm_scale = _resolved_sm_scale(sm_scale)\n    out, lse = _AttentionFunction.apply(q, k, v, sm_scale, alibi_slopes, dropout, None,\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield 'sinks, '
        yield 'deterministic)\n    return (out, lse) if return_lse else out\n\n\ndef attention_backward(dout, q, k, v, out, lse, *, sm_scale=None, alibi_slopes=None,\n                       dropout_p=0.0, rng_state=None, dlse=None'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks=None'
        yield ',\n                       deterministic=True):\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '    """(dq, dk, dv, dsinks) of attention for the output gradient dout (and dlse, the LSE\'s),\n    given its\n'
        else:
            pass
            yield '    """(dq, dk, dv) of attention for the output gradient dout (and dlse, the LSE\'s), given its\n'
        yield '    out and lse [B, HQ, M]; dropout_p and rng_state as the forward had them'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '; sinks [HQ]\n    fp32 (required) as well, dsinks [HQ] fp32 their gradient'
        yield ';\n    deterministic as attention\'s."""\n    dropout = _dropout_option(q, dropout_p, rng_state)\n    _check_deterministic(deterministic)\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '    _check_sinks(sinks, q.shape[1], q)\n'
        yield '    return _backward(dout, q, k, v, out, lse, dlse, _resolved_sm_scale(sm_scale),\n                     alibi_slopes, dropout, None'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield ', sinks'
        yield ',\n                     deterministic=deterministic)\n'

blocks = {}
debug_info = '4=22&5=24&6=27&10=31&14=33&30=37&48=43&61=47&68=54&71=58&73=62&77=65&81=75&84=82&96=89&128=96&142=99&151=103&156=107&163=111&166=115&167=118&178=125&184=129&186=133&187=137&192=141&197=145&203=152&209=156&213=160&220=164&222=168&223=171&227=175&232=179&234=183&240=190&245=194&249=198'