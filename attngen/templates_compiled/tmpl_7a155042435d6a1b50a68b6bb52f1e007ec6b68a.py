from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_decode_combine.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_sinks = resolve('sinks')
    l_0_block_dv = resolve('block_dv')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_step = missing
    pass
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', '_decode_combine.py.jinja').make_module(context.get_all(), True, {'step': l_0_step})
    context.exported_vars.discard('step')
    yield '@triton.jit\ndef _decode_combine_kernel(\n    PartOut, PartLse, Out, Lse,'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ' Sinks,'
    yield '\n    stride_ob, stride_oh, stride_ot, stride_od,\n    num_q_heads, num_q_tokens, num_splits,\n    STORE_LSE: tl.constexpr,\n    BLOCK_SPLITS: tl.constexpr,\n):\n    # One program per output row (b, h, t): out = sum_s w_s o_s / sum_s w_s with\n    # w_s = exp2(lse_s - max lse); a split that saw no key has lse_s = -inf, w_s = 0.\n    row = tl.program_id(0).to(tl.int64)\n    offs_t = row % num_q_tokens\n    off_h = (row // num_q_tokens) % num_q_heads\n    off_b = row // (num_q_tokens * num_q_heads)\n    offs_s = tl.arange(0, BLOCK_SPLITS)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n    split_ok = offs_s < num_splits\n    lse = tl.load(PartLse + row * num_splits + offs_s, mask=split_ok, other=float("-inf"))\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield "    # the row's learned sink: one more term in the normaliser, with no value\n    sink_log2 = tl.load(Sinks + off_h) * _LOG2E_C\n    m = tl.maximum(tl.max(lse, 0), sink_log2)\n"
    else:
        pass
        yield '    m = tl.max(lse, 0)\n'
    yield '    m_ref = tl.where(m == float("-inf"), 0.0, m)\n    w = tl.math.exp2(lse - m_ref)\n    part = (row * num_splits + offs_s)[:, None] * _BLOCK_DV + offs_dv[None, :]\n    o = tl.load(PartOut + part, mask=split_ok[:, None]'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_dv'), 'None, :'))
    yield ', other=0.0)\n    total = tl.sum(w, 0)'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ' + tl.math.exp2(sink_log2 - m_ref)'
    yield '\n    total_safe = tl.where(total == 0.0, 1.0, total)\n    out = tl.sum(o * w[:, None], 0) / total_safe\n    o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + offs_t * stride_ot\n    tl.store(o_ptrs + offs_dv * stride_od, out.to(Out.dtype.element_ty)'
    if ((undefined(name='block_dv') if l_0_block_dv is missing else l_0_block_dv) != (undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v)):
        pass
        yield ', mask=offs_dv < _HEAD_DIM_V'
    yield ')\n    if STORE_LSE:\n        lse_out = tl.where(total == 0.0, float("-inf"), (m_ref + tl.math.log2(total_safe)))\n        tl.store(Lse + row, lse_out / _LOG2E_C)\n'

blocks = {}
debug_info = '3=15&6=18&23=22&33=29&34=31&40=35'