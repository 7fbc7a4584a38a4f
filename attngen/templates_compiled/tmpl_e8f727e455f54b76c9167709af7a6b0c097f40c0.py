from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_backward_dq.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_dropout = resolve('dropout')
    l_0_block_d = resolve('block_d')
    l_0_head_dim = resolve('head_dim')
    l_0_block_dv = resolve('block_dv')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_softcap = resolve('softcap')
    l_0_sinks = resolve('sinks')
    l_0_varlen = resolve('varlen')
    l_0_alibi = resolve('alibi')
    l_0_sink_tokens = resolve('sink_tokens')
    l_0_mask = resolve('mask')
    l_0_score_code = l_0_bw = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_score_code = context.vars['score_code'] = environment.get_template('_scores.py.jinja', '_backward_dq.py.jinja').make_module(context.get_all(), True, {'bw': l_0_bw, 'score_code': l_0_score_code})
    context.exported_vars.discard('score_code')
    l_0_bw = context.vars['bw'] = environment.get_template('_backward_macros.py.jinja', '_backward_dq.py.jinja').make_module(context.get_all(), True, {'bw': l_0_bw, 'score_code': l_0_score_code})
    context.exported_vars.discard('bw')
    yield '@triton.jit\ndef _attn_bwd_dq_inner(\n    dq, q, do, lse2, delta, q_pos, q_rows32, first_q_pos, last_q_pos, batch_head,\n    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,\n    start_n, end_n, seqlen_k, qk_scale, slope_log2,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    seed, philox_offset, drop_threshold, keep_scale,\n'
    yield '    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield ' DROPOUT_ON: tl.constexpr,'
    yield '\n):\n    offs_n = tl.arange(0, BLOCK_N)\n    offs_d = tl.arange(0, _BLOCK_D)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n    for start in tl.range(start_n, end_n, BLOCK_N):\n        start = tl.multiple_of(start, BLOCK_N)\n        key_pos = start + offs_n\n        key_rows = key_pos.to(tl.int64)\n        k_ptrs = k_base + key_rows[:, None] * stride_kn + offs_d[None, :] * stride_kd\n        vT_ptrs = v_base + key_rows[None, :] * stride_vn + offs_dv[:, None] * stride_vd\n        # -- load K [BLOCK_N, D] and V^T [DV, BLOCK_N]. Note: row-major tiles transposed\n        # inside the dot: the other orientation makes mma.sync targets transpose a tile in\n        # registers, unpipelined (168 -> 235 registers at 32x64, D = 128 on sm80).\n        if MASKED:\n            # Keys no row of this tile sees are zeroed: a NaN there would survive 0 * NaN.\n            key_live = _bwd_key_live(first_q_pos, last_q_pos, key_pos, seqlen_k)\n            k = tl.load(k_ptrs, mask=key_live[:, None]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_d'), 'None, :'))
    yield ', other=0.0)\n            vT = tl.load(vT_ptrs, mask=key_live[None, :]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_dv'), ':, None'))
    yield ',\n                         other=0.0)\n        else:\n'
    if ((undefined(name='block_d') if l_0_block_d is missing else l_0_block_d) != (undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim)):
        pass
        yield '            k = tl.load(k_ptrs, mask=(offs_d < _HEAD_DIM)[None, :], other=0.0)\n'
    else:
        pass
        yield '            k = tl.load(k_ptrs)\n'
    if ((undefined(name='block_dv') if l_0_block_dv is missing else l_0_block_dv) != (undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v)):
        pass
        yield '            vT = tl.load(vT_ptrs, mask=(offs_dv < _HEAD_DIM_V)[:, None], other=0.0)\n'
    else:
        pass
        yield '            vT = tl.load(vT_ptrs)\n'
    yield '        # -- P, dP, dS [BLOCK_M, BLOCK_N] -------------------------------------------------\n        qk = tl.dot(q, tl.trans(k)'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dot_precision')))
    yield ')\n        p, t = _bwd_probs(qk, qk_scale, lse2[:, None], q_pos[:, None], key_pos[None, :],\n                          slope_log2)\n        if MASKED:\n            p = tl.where(_bwd_visible(q_pos[:, None], key_pos[None, :], seqlen_k), p, 0.0)\n        dp = tl.dot(do, vT'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dot_precision')))
    yield ')\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '        if DROPOUT_ON:  # dP of the kept probabilities, scaled as in the forward\n            keep = _dropout_keep(seed, philox_offset, batch_head, q_rows32, start,\n                                 drop_threshold, BLOCK_N)\n            dp = tl.where(keep, dp * keep_scale, 0.0)\n'
    yield '        ds = p * (dp - delta[:, None])\n'
    if (undefined(name='softcap') if l_0_softcap is missing else l_0_softcap):
        pass
        yield '        ds = ds * (1.0 - t * t)  # d(c tanh(x / c)) / dx = 1 - tanh^2\n'
    yield '        '
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'accumulate_dot'), 'dq', 'ds.to(k.dtype)', 'k'))
    yield '\n    return dq\n\n\n@triton.jit\ndef _attn_bwd_dq_kernel(\n    Q, K, V, Out, DOut, DQ, Lse, DLse, Delta, Slopes,'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ' Sinks, DSinkPartial,'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield ' RngState,'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield ' CuSeqlensQ, CuSeqlensK,'
    yield '\n    stride_qb, stride_qh, stride_qm, stride_qd,\n    stride_kb, stride_kh, stride_kn, stride_kd,\n    stride_vb, stride_vh, stride_vn, stride_vd,\n    stride_ob, stride_oh, stride_om, stride_od,\n    stride_dob, stride_doh, stride_dom, stride_dod,\n    stride_dqb, stride_dqh, stride_dqm, stride_dqd,\n    stride_lse_b, stride_lse_h,\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '    num_q_heads, q_per_kv, total_q, total_k, max_rows_q, max_rows_k, num_m_blocks,\n'
    else:
        pass
        yield '    num_q_heads, q_per_kv, seqlen_q, seqlen_k, num_m_blocks,\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield '    stride_slopes_b,\n'
    yield '    qk_scale, sm_scale,'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield ' drop_threshold, keep_scale,'
    yield '\n    HAS_DLSE: tl.constexpr,'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield ' DROPOUT_ON: tl.constexpr,'
    yield "\n    BLOCK_M: tl.constexpr,\n    BLOCK_N: tl.constexpr,\n    DELTA_ONLY: tl.constexpr,\n):\n    # DELTA_ONLY: delta (and d sinks' shares) alone, no key loop: the preprocess of the\n    # atomic-dQ backward, whose dK/dV kernel adds dQ into DQ (then fp32, zeroed: a sequence\n    # that does not fit still gets NaN rows here).\n    tl.static_assert(BLOCK_N % 16 == 0)\n    tl.static_assert(BLOCK_M % 16 == 0)\n    pid = tl.program_id(0)\n    # -- which tile: as the forward's (the last query block, under causal the heaviest, first)\n    m_block = num_m_blocks - 1 - pid % num_m_blocks\n    batch_head = pid // num_m_blocks\n    off_b = (batch_head // num_q_heads).to(tl.int64)\n    off_h = (batch_head % num_q_heads).to(tl.int64)\n    off_hkv = off_h // q_per_kv\n"
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield str(t_1(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'sequence')), '\n'))
        yield '\n    if not seq_ok:\n        _store_nan_grad_rows(DQ, q_first, q_end, total_q, off_h, m_block, num_m_blocks,\n                             stride_dqm, stride_dqh, stride_dqd, _HEAD_DIM, _BLOCK_D, BLOCK_M)\n'
        if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
            pass
            yield '        tl.store(DSinkPartial + pid, float("nan"))  # its rows\' share of d sinks is unknown\n'
        yield '        return\n'
    else:
        pass
        yield '    q_offset = off_b * 0\n    k_offset = off_b * 0\n'
    yield '    q_start = m_block * BLOCK_M\n    if q_start >= seqlen_q:\n        return\n    q_base = Q + off_b * stride_qb + q_offset * stride_qm + off_h * stride_qh\n    k_base = K + off_b * stride_kb + k_offset * stride_kn + off_hkv * stride_kh\n    v_base = V + off_b * stride_vb + k_offset * stride_vn + off_hkv * stride_vh\n    o_base = Out + off_b * stride_ob + q_offset * stride_om + off_h * stride_oh\n    do_base = DOut + off_b * stride_dob + q_offset * stride_dom + off_h * stride_doh\n    dq_base = DQ + off_b * stride_dqb + q_offset * stride_dqm + off_h * stride_dqh\n    row_base = off_b * stride_lse_b + off_h * stride_lse_h + q_offset  # LSE, delta\n    offs_m = q_start + tl.arange(0, BLOCK_M)\n    offs_d = tl.arange(0, _BLOCK_D)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n    row_ok = offs_m < seqlen_q\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'diagonal')), '\n'))
    yield '\n    q_pos = offs_m + diagonal\n    first_q_pos = q_start + diagonal\n    last_q_pos = tl.minimum(q_start + BLOCK_M, seqlen_q) - 1 + diagonal\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'key_ranges')), '\n'))
    yield '\n    # -- the resident tiles: Q [BLOCK_M, D], dO [BLOCK_M, DV]; LSE and delta per row -------\n    q_rows = offs_m.to(tl.int64)\n    q_mask = row_ok[:, None]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_d'), 'None, :'))
    yield '\n    do_mask = row_ok[:, None]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_dv'), 'None, :'))
    yield '\n    if DELTA_ONLY:  # Q is not read (the code after `return` below still needs a q)\n        q = tl.zeros([BLOCK_M, _BLOCK_D], dtype=Q.dtype.element_ty)\n    else:\n        q = tl.load(q_base + q_rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,\n                    mask=q_mask, other=0.0)\n    do = tl.load(do_base + q_rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,\n                 mask=do_mask, other=0.0)\n    # -- delta = rowsum(dO * O), minus dLSE when the LSE has a gradient (d LSE / d S = P, so\n    # it enters dS = P * (dP - delta) with the opposite sign) -------------------------------\n    o = tl.load(o_base + q_rows[:, None] * stride_om + offs_dv[None, :] * stride_od,\n                mask=do_mask, other=0.0)\n    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)\n    if HAS_DLSE:\n        delta = delta - tl.load(DLse + row_base + offs_m, mask=row_ok, other=0.0)\n    tl.store(Delta + row_base + offs_m, delta, mask=row_ok)\n    lse = tl.load(Lse + row_base + offs_m, mask=row_ok, other=float("-inf"))\n    # Note: a row that sees no key has LSE -inf; +inf in its place makes its P exactly 0.\n    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E_C)\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield "    # -- d sink_h = -sum over the head's rows of exp(sink_h - LSE) * delta (d LSE / d sink is\n    # the sink's probability; O = sum_j P_j V_j loses that share). This tile's share, in fp32,\n    # one value per program, summed on the host in a fixed order: no atomics, deterministic.\n    # A row that sees nothing and has LSE -inf (a sink of -inf) has p_sink 0 through lse2.\n    p_sink = tl.math.exp2(tl.load(Sinks + off_h) * _LOG2E_C - lse2)\n    tl.store(DSinkPartial + pid, -tl.sum(tl.where(row_ok, p_sink * delta, 0.0), 0))\n"
    yield '    if DELTA_ONLY:\n        return\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield "    slope_log2 = tl.load(Slopes + off_b * stride_slopes_b + off_h) * _LOG2E_C  # as the forward's\n"
    else:
        pass
        yield '    slope_log2 = 0.0\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'rng_state')), '\n'))
    yield '\n    dq = tl.zeros([BLOCK_M, _BLOCK_D], dtype=tl.float32)\n'
    if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
        pass
        yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dq_phase'), "the sink tokens' keys left of the window: masked", '0, sink_hi', True))
        yield '\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dq_phase'), "keys left of the window's fully visible part: masked", 'lo, full_lo', True))
        yield '\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dq_phase'), "keys of the first row's chunk left of the part every row sees: masked", 'lo, full_lo', True))
        yield '\n'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dq_phase'), 'keys every row of the tile sees: no mask', 'full_lo, full_hi', False))
    yield '\n'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dq_phase'), ('keys at the diagonal' if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none') else 'the last, partial key block'), 'full_hi, hi', True))
    yield '\n    dq = dq * sm_scale\n    tl.store(dq_base + q_rows[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,\n             dq.to(DQ.dtype.element_ty), mask=q_mask)\n\n\n'

blocks = {}
debug_info = '2=29&3=31&9=34&12=38&30=42&31=44&34=46&39=52&45=59&50=61&51=63&58=67&61=71&67=73&76=83&81=89&84=93&86=97&104=101&105=103&109=105&131=113&135=115&138=117&139=119&158=121&168=125&173=131&175=133&176=135&178=137&179=139&180=141&181=143&183=145&184=147'