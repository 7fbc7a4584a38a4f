from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_backward_dkdv.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_dropout = resolve('dropout')
    l_0_alibi = resolve('alibi')
    l_0_block_d = resolve('block_d')
    l_0_head_dim = resolve('head_dim')
    l_0_block_dv = resolve('block_dv')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_softcap = resolve('softcap')
    l_0_varlen = resolve('varlen')
    l_0_mask = resolve('mask')
    l_0_bw = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_bw = context.vars['bw'] = environment.get_template('_backward_macros.py.jinja', '_backward_dkdv.py.jinja').make_module(context.get_all(), True, {'bw': l_0_bw})
    context.exported_vars.discard('bw')
    yield '@triton.jit\ndef _attn_bwd_dkdv_inner(\n    dk, dv, k, v, Q, DOut, Lse, Delta, DQ, group_slopes_log2,\n    q_base0, do_base0, row_base0, dq_base0, batch_head0, stride_qh, stride_doh, stride_lse_h,\n    stride_qm, stride_qd, stride_dom, stride_dod, stride_dqh, stride_dqm, stride_dqd, q_per_kv,\n    key_pos, first_k_pos, last_k_pos, diagonal,\n    start_m, end_m, seqlen_q, seqlen_k, qk_scale, sm_scale,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    seed, philox_offset, drop_threshold, keep_scale,\n'
    yield '    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GRADS: tl.constexpr,\n    ATOMIC_DQ: tl.constexpr,\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield '    GROUP_MAX: tl.constexpr,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    DROPOUT_ON: tl.constexpr,\n'
    yield "):\n    # GRADS: 3 accumulates dK and dV, 1 dV alone, 2 dK alone (two launches, one accumulator\n    # each: the wider key tiles a large head dim needs to reach wgmma). ATOMIC_DQ (with\n    # GRADS & 2): also dQ's share of this key block, dS @ K, added to DQ (fp32) by atomics.\n    offs_m = tl.arange(0, BLOCK_M)\n    offs_d = tl.arange(0, _BLOCK_D)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n    # Note: one flat loop over (query head of the KV group, query block) pairs, not a loop\n    # over heads around a loop over blocks: a runtime outer loop keeps the inner pipeline's\n    # state live across it (D = 128, 64x64, 8 warps on sm90: spills, 198 registers without).\n    num_blocks = tl.cdiv(end_m - start_m, BLOCK_M)\n    for step in tl.range(0, q_per_kv * num_blocks):\n        group_head = step // num_blocks\n        start = tl.multiple_of(start_m + (step - group_head * num_blocks) * BLOCK_M, BLOCK_M)\n        q_base = Q + q_base0 + group_head * stride_qh\n        do_base = DOut + do_base0 + group_head * stride_doh\n        lse_ptr = Lse + row_base0 + group_head * stride_lse_h\n        delta_ptr = Delta + row_base0 + group_head * stride_lse_h\n"
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '        batch_head = batch_head0 + group_head\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield "        # The head's slope picked from registers: a load here would be pipelined through\n        # shared memory (4-16 B, and 1 KiB of alignment on wgmma).\n        slope_log2 = tl.sum(tl.where(tl.arange(0, GROUP_MAX) == group_head,\n                                     group_slopes_log2, 0.0))\n"
    else:
        pass
        yield '        slope_log2 = 0.0\n'
    yield '        rows = start + offs_m\n        q_rows = rows.to(tl.int64)\n        q_pos = rows + diagonal\n        q_ptrs = q_base + q_rows[:, None] * stride_qm + offs_d[None, :] * stride_qd\n        do_ptrs = do_base + q_rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod\n        # -- load Q [BLOCK_M, D], dO [BLOCK_M, DV], LSE and delta ---------------------------\n        if MASKED:\n            # Rows that see no key of this block are zeroed: a NaN there would survive\n            # 0 * NaN in dS^T Q.\n            row_ok = rows < seqlen_q\n            live = _bwd_row_live(first_k_pos, last_k_pos, q_pos, row_ok)\n            q = tl.load(q_ptrs, mask=live[:, None]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_d'), 'None, :'))
    yield ', other=0.0)\n            do = tl.load(do_ptrs, mask=live[:, None]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_dv'), 'None, :'))
    yield ', other=0.0)\n            lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("-inf"))\n            if GRADS & 2:\n                delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)\n        else:\n'
    if ((undefined(name='block_d') if l_0_block_d is missing else l_0_block_d) != (undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim)):
        pass
        yield '            q = tl.load(q_ptrs, mask=(offs_d < _HEAD_DIM)[None, :], other=0.0)\n'
    else:
        pass
        yield '            q = tl.load(q_ptrs)\n'
    if ((undefined(name='block_dv') if l_0_block_dv is missing else l_0_block_dv) != (undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v)):
        pass
        yield '            do = tl.load(do_ptrs, mask=(offs_dv < _HEAD_DIM_V)[None, :], other=0.0)\n'
    else:
        pass
        yield '            do = tl.load(do_ptrs)\n'
    yield '            lse = tl.load(lse_ptr + rows)\n            if GRADS & 2:\n                delta = tl.load(delta_ptr + rows)\n        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E_C)\n        # -- P^T, dP^T, dS^T [BLOCK_N, BLOCK_M] ---------------------------------------------\n        qkT = tl.dot(k, tl.trans(q)'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dot_precision')))
    yield ')\n        pT, tT = _bwd_probs(qkT, qk_scale, lse2[None, :], q_pos[None, :], key_pos[:, None],\n                            slope_log2)\n        if MASKED:\n            pT = tl.where(_bwd_visible(q_pos[None, :], key_pos[:, None], seqlen_k), pT, 0.0)\n        if GRADS & 2:\n            dpT = tl.dot(v, tl.trans(do)'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dot_precision')))
    yield ')\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield "        if DROPOUT_ON:  # the forward's mask, transposed\n            keepT = tl.trans(_dropout_keep(seed, philox_offset, batch_head, rows, first_k_pos,\n                                           drop_threshold, BLOCK_N))\n            pdT = tl.where(keepT, pT * keep_scale, 0.0)\n            if GRADS & 2:\n                dpT = tl.where(keepT, dpT * keep_scale, 0.0)\n        else:\n            pdT = pT\n        if GRADS & 1:\n            "
        yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'accumulate_dot'), 'dv', 'pdT.to(k.dtype)', 'do'))
        yield '\n'
    else:
        pass
        yield '        if GRADS & 1:\n            '
        yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'accumulate_dot'), 'dv', 'pT.to(k.dtype)', 'do'))
        yield '\n'
    yield '        if GRADS & 2:\n            dsT = pT * (dpT - delta[None, :])\n'
    if (undefined(name='softcap') if l_0_softcap is missing else l_0_softcap):
        pass
        yield '            dsT = dsT * (1.0 - tT * tT)  # d(c tanh(x / c)) / dx = 1 - tanh^2\n'
    yield '            '
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'accumulate_dot'), 'dk', 'dsT.to(k.dtype)', 'q'))
    yield "\n            if ATOMIC_DQ:\n                # dQ's share (dS @ K) [BLOCK_M, D], scaled here: DQ holds the finished sum\n                dq = tl.dot(tl.trans(dsT.to(k.dtype)), k"
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dot_precision')))
    yield ') * sm_scale\n                dq_ptrs = (DQ + dq_base0 + group_head * stride_dqh + q_rows[:, None] * stride_dqm\n                           + offs_d[None, :] * stride_dqd)\n                if MASKED:\n                    dq_mask = (rows < seqlen_q)[:, None]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_d'), 'None, :'))
    yield '\n                    tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")\n                else:\n'
    if ((undefined(name='block_d') if l_0_block_d is missing else l_0_block_d) != (undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim)):
        pass
        yield '                    tl.atomic_add(dq_ptrs, dq, mask=(offs_d < _HEAD_DIM)[None, :], sem="relaxed")\n'
    else:
        pass
        yield '                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")\n'
    yield '    return dk, dv\n\n\n@triton.jit\ndef _attn_bwd_dkdv_kernel(\n    Q, K, V, DOut, DK, DV, Lse, Delta, DQ, Slopes,'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield ' RngState,'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield ' CuSeqlensQ, CuSeqlensK,'
    yield '\n    stride_qb, stride_qh, stride_qm, stride_qd,\n    stride_kb, stride_kh, stride_kn, stride_kd,\n    stride_vb, stride_vh, stride_vn, stride_vd,\n    stride_dob, stride_doh, stride_dom, stride_dod,\n    stride_dkb, stride_dkh, stride_dkn, stride_dkd,\n    stride_dvb, stride_dvh, stride_dvn, stride_dvd,\n    stride_dqb, stride_dqh, stride_dqm, stride_dqd,\n    stride_lse_b, stride_lse_h,\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '    num_q_heads, q_per_kv, total_q, total_k, max_rows_q, max_rows_k, num_n_blocks,\n'
    else:
        pass
        yield '    num_q_heads, q_per_kv, seqlen_q, seqlen_k, num_n_blocks,\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield '    stride_slopes_b,\n'
    yield '    qk_scale, sm_scale,'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield ' drop_threshold, keep_scale,'
    yield '\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield '    GROUP_MAX: tl.constexpr,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    DROPOUT_ON: tl.constexpr,\n'
    yield '    BLOCK_M: tl.constexpr,\n    BLOCK_N: tl.constexpr,\n    GRADS: tl.constexpr,\n    ATOMIC_DQ: tl.constexpr,\n):\n    tl.static_assert(BLOCK_N % 16 == 0)\n    tl.static_assert(BLOCK_M % 16 == 0)\n    pid = tl.program_id(0)\n    # -- which tile: key blocks of one KV head are adjacent programs (they share Q and dO in\n    # L2); the first key block, under causal the one most queries see, goes first.\n    n_block = pid % num_n_blocks\n    batch_kv_head = pid // num_n_blocks\n    num_kv_heads = num_q_heads // q_per_kv\n    off_b = (batch_kv_head // num_kv_heads).to(tl.int64)\n    off_hkv = (batch_kv_head % num_kv_heads).to(tl.int64)\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield str(t_1(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'sequence')), '\n'))
        yield '\n    if not seq_ok:\n        if GRADS & 2:\n            _store_nan_grad_rows(DK, k_first, k_end, total_k, off_hkv, n_block, num_n_blocks,\n                                 stride_dkn, stride_dkh, stride_dkd, _HEAD_DIM, _BLOCK_D,\n                                 BLOCK_N)\n        if GRADS & 1:\n            _store_nan_grad_rows(DV, k_first, k_end, total_k, off_hkv, n_block, num_n_blocks,\n                                 stride_dvn, stride_dvh, stride_dvd, _HEAD_DIM_V, _BLOCK_DV,\n                                 BLOCK_N)\n        return\n'
    else:
        pass
        yield '    q_offset = off_b * 0\n    k_offset = off_b * 0\n'
    yield '    k_start = n_block * BLOCK_N\n    if k_start >= seqlen_k:\n        return\n    k_base = K + off_b * stride_kb + k_offset * stride_kn + off_hkv * stride_kh\n    v_base = V + off_b * stride_vb + k_offset * stride_vn + off_hkv * stride_vh\n    dk_base = DK + off_b * stride_dkb + k_offset * stride_dkn + off_hkv * stride_dkh\n    dv_base = DV + off_b * stride_dvb + k_offset * stride_dvn + off_hkv * stride_dvh\n    key_pos = k_start + tl.arange(0, BLOCK_N)\n    offs_d = tl.arange(0, _BLOCK_D)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'diagonal')), '\n'))
    yield '\n    first_k_pos = k_start\n    last_k_pos = tl.minimum(k_start + BLOCK_N, seqlen_k) - 1\n    lo, full_lo, full_hi, hi = _bwd_query_ranges(first_k_pos, last_k_pos, diagonal, seqlen_q,\n                                                 BLOCK_M)\n    # -- the resident tiles: K [BLOCK_N, D], V [BLOCK_N, DV]; keys no query of the sequence\n    # sees are zeroed (their gradients are 0, and a NaN stored there must not make them NaN)\n    seen = _bwd_key_live(diagonal, seqlen_q - 1 + diagonal, key_pos, seqlen_k)\n    key_rows = key_pos.to(tl.int64)\n    k = tl.load(k_base + key_rows[:, None] * stride_kn + offs_d[None, :] * stride_kd,\n                mask=seen[:, None]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_d'), 'None, :'))
    yield ', other=0.0)\n    if GRADS & 2:\n        v = tl.load(v_base + key_rows[:, None] * stride_vn + offs_dv[None, :] * stride_vd,\n                    mask=seen[:, None]'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_dv'), 'None, :'))
    yield ', other=0.0)\n    else:\n        v = k  # not read: the dV kernel has no dP\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'rng_state')), '\n'))
    yield '\n    dk = tl.zeros([BLOCK_N, _BLOCK_D], dtype=tl.float32)\n    dv = tl.zeros([BLOCK_N, _BLOCK_DV], dtype=tl.float32)\n    # -- every query head of the KV group (GQA: their dK, dV summed here, no atomics) --------\n    first_head = off_hkv * q_per_kv\n    q_base0 = off_b * stride_qb + q_offset * stride_qm + first_head * stride_qh\n    do_base0 = off_b * stride_dob + q_offset * stride_dom + first_head * stride_doh\n    row_base0 = off_b * stride_lse_b + first_head * stride_lse_h + q_offset\n    dq_base0 = off_b * stride_dqb + q_offset * stride_dqm + first_head * stride_dqh\n    batch_head0 = off_b * num_q_heads + first_head\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield "    # The group's slopes, once (GROUP_MAX: q_per_kv rounded up to a power of two).\n    group = tl.arange(0, GROUP_MAX)\n    group_slopes_log2 = tl.load(Slopes + off_b * stride_slopes_b + first_head + group,\n                                mask=group < q_per_kv, other=0.0) * _LOG2E_C\n"
    else:
        pass
        yield '    group_slopes_log2 = 0.0\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none'):
        pass
        yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dkdv_phase'), "rows before the fully visible part (the diagonal, the window's edge): masked", 'lo, full_lo', True))
        yield '\n'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dkdv_phase'), 'rows that see every key of the block: no mask', 'full_lo, full_hi', False))
    yield '\n'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'dkdv_phase'), "rows after it (the window's far edge, the sequence's end): masked", 'full_hi, hi', True))
    yield '\n    key_ok = (key_pos < seqlen_k)[:, None]\n    if GRADS & 2:\n        dk = dk * sm_scale\n        tl.store(dk_base + key_rows[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,\n                 dk.to(DK.dtype.element_ty), mask=key_ok'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_d'), 'None, :'))
    yield ')\n    if GRADS & 1:\n        tl.store(dv_base + key_rows[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,\n                 dv.to(DV.dtype.element_ty), mask=key_ok'
    yield str(context.call(environment.getattr((undefined(name='bw') if l_0_bw is missing else l_0_bw), 'pad_dv'), 'None, :'))
    yield ')\n\n\n'

blocks = {}
debug_info = '2=27&10=30&15=34&18=37&39=41&42=44&61=51&62=53&67=55&72=61&82=68&88=70&89=72&99=75&102=80&106=83&109=87&112=89&116=91&119=93&129=100&139=107&144=113&147=117&149=121&152=124&170=128&171=130&196=136&206=138&209=140&212=142&222=144&230=150&231=152&233=154&234=156&239=158&242=160'