from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_key_loop.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_tma = resolve('tma')
    l_0_dropout = resolve('dropout')
    l_0_mask = resolve('mask')
    l_0_tma_masked_blocks = resolve('tma_masked_blocks')
    l_0_block_d = resolve('block_d')
    l_0_head_dim = resolve('head_dim')
    l_0_block_dv = resolve('block_dv')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_score_code = l_0_step = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_score_code = context.vars['score_code'] = environment.get_template('_scores.py.jinja', '_key_loop.py.jinja').make_module(context.get_all(), True, {'score_code': l_0_score_code, 'step': l_0_step})
    context.exported_vars.discard('score_code')
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', '_key_loop.py.jinja').make_module(context.get_all(), True, {'score_code': l_0_score_code, 'step': l_0_step})
    context.exported_vars.discard('step')
    yield '@triton.jit\ndef _attn_fwd_inner(\n    acc, l_i, m_i, q, q_pos, first_q_pos, last_q_pos,\n    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,'
    if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
        pass
        yield ' k_desc, v_desc, desc_b, desc_h,'
    yield '\n    start_n, end_n, seqlen_k, qk_scale, slope_log2,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    q_rows32, batch_head, seed, philox_offset, drop_threshold,\n'
    yield '    MASKED: tl.constexpr,\n    BLOCK_M: tl.constexpr,\n    BLOCK_N: tl.constexpr,\n'
    if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
        pass
        yield '    USE_TMA: tl.constexpr,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    DROPOUT_ON: tl.constexpr,\n'
    yield '):\n    offs_n = tl.arange(0, BLOCK_N)\n    offs_d = tl.arange(0, _BLOCK_D)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield str(t_1(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'window_live_bounds')), '\n'))
        yield '\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield str(t_1(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'chunk_bounds')), '\n'))
        yield '\n'
    yield '    for start in tl.range(start_n, end_n, BLOCK_N):\n        start = tl.multiple_of(start, BLOCK_N)\n        key_pos = start + offs_n\n        key_rows = key_pos.to(tl.int64)\n        k_ptrs = k_base + key_rows[None, :] * stride_kn + offs_d[:, None] * stride_kd\n        v_ptrs = v_base + key_rows[:, None] * stride_vn + offs_dv[None, :] * stride_vd\n        # -- load K^T [D, BLOCK_N] and V [BLOCK_N, DV] ---------------------------------\n        if MASKED:\n            # Note: keys no row of this tile may see are zeroed on load, not only masked\n            # in the scores: a NaN stored there (padding, cache tails) would survive\n            # 0 * NaN in P @ V.\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'key_live')), '\n'))
    yield '\n            k_mask = key_live[None, :]'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_d'), ':, None'))
    yield '\n            v_mask = key_live[:, None]'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_dv'), 'None, :'))
    yield '\n'
    if (undefined(name='tma_masked_blocks') if l_0_tma_masked_blocks is missing else l_0_tma_masked_blocks):
        pass
        yield "            # Note: BLOCK_M >= 64 is Hopper's wgmma path. On mma.sync (smaller tiles) V\n            # zeroed in registers goes back to shared memory for the dot: a whole extra\n            # [BLOCK_N, DV] buffer (the compiler's count), so there these stay pointer loads.\n            if USE_TMA and BLOCK_M >= 64:\n                # The copy engine zero-fills rows past the sequence; keys inside it that no\n                # row sees get V zeroed here and K masked in the scores. Reading these\n                # blocks through TMA too lets both key loops share one pipeline: it made\n                # 64x64 tiles the fastest at causal D = 128 (tools/exp_prefill.py).\n"
        yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'tma_load_kv'), '                '))
        yield '\n                v = tl.where(key_live[:, None], v, 0.0)\n            else:\n                k = tl.load(k_ptrs, mask=k_mask, other=0.0)\n                v = tl.load(v_ptrs, mask=v_mask, other=0.0)\n'
    else:
        pass
        yield '            k = tl.load(k_ptrs, mask=k_mask, other=0.0)\n            v = tl.load(v_ptrs, mask=v_mask, other=0.0)\n'
    if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
        pass
        yield '        elif USE_TMA:\n            # Every key of the block is visible: the tensor-memory accelerator copies the\n            # whole [BLOCK_N, D] tiles (head-dim padding beyond D comes back as zeros).\n'
        yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'tma_load_kv'), '            '))
        yield '\n'
    yield '        else:\n'
    if ((undefined(name='block_d') if l_0_block_d is missing else l_0_block_d) != (undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim)):
        pass
        yield '            k = tl.load(k_ptrs, mask=(offs_d < _HEAD_DIM)[:, None], other=0.0)\n'
    else:
        pass
        yield '            k = tl.load(k_ptrs)\n'
    if ((undefined(name='block_dv') if l_0_block_dv is missing else l_0_block_dv) != (undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v)):
        pass
        yield '            v = tl.load(v_ptrs, mask=(offs_dv < _HEAD_DIM_V)[None, :], other=0.0)\n'
    else:
        pass
        yield '            v = tl.load(v_ptrs)\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'score_tile'), mask_if='MASKED'))
    yield '\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'online_update')))
    yield '\n    return acc, l_i, m_i\n'

blocks = {}
debug_info = '4=26&5=28&9=31&12=35&18=39&21=42&28=46&29=48&30=50&31=52&44=55&45=57&46=59&47=61&56=64&65=69&69=72&72=75&77=81&82=87&83=89'