from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_varlen_sequence.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_store_nan_rows_kernel = l_0_sequence_bounds = missing
    pass
    def macro():
        t_1 = []
        l_1_step = resolve('step')
        pass
        t_1.extend((
            '@triton.jit\ndef _fill_rows(Out, Lse, first, end, total_q, off_h, m_block, num_m_blocks,\n               stride_om, stride_oh, stride_od, stride_lse_h,\n               NAN: tl.constexpr, STORE_LSE: tl.constexpr, BLOCK_M: tl.constexpr):\n    """Rows [first, end) that lie inside q, output and LSE: NaN (NAN, a sequence that does not\n    fit) or 0 with LSE -inf (rows no sequence covers). A sequence\'s programs each take every\n    num_m_blocks-th block of BLOCK_M rows; nothing is read."""\n    q_lo = tl.minimum(tl.maximum(first, 0), total_q)\n    q_hi = tl.minimum(tl.maximum(end, q_lo), total_q)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n    fill_out = tl.full([BLOCK_M, _BLOCK_DV], float("nan") if NAN else 0.0,\n                       dtype=Out.dtype.element_ty)\n    fill_lse = tl.full([BLOCK_M], float("nan") if NAN else float("-inf"), dtype=tl.float32)\n    for start in tl.range(q_lo + m_block * BLOCK_M, q_hi, num_m_blocks * BLOCK_M):\n        rows = start + tl.arange(0, BLOCK_M)\n        row_ok = rows < q_hi\n        rows = rows.to(tl.int64)\n        o_ptrs = Out + rows[:, None] * stride_om + off_h * stride_oh + offs_dv[None, :] * stride_od\n        tl.store(o_ptrs, fill_out, mask=row_ok[:, None]',
            str(context.call(environment.getattr((undefined(name='step') if l_1_step is missing else l_1_step), 'pad_dv'), 'None, :')),
            ')\n        if STORE_LSE:\n            tl.store(Lse + off_h * stride_lse_h + rows, fill_lse, mask=row_ok)',
        ))
        return concat(t_1)
    context.exported_vars.add('store_nan_rows_kernel')
    context.vars['store_nan_rows_kernel'] = l_0_store_nan_rows_kernel = Macro(environment, macro, 'store_nan_rows_kernel', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_2 = []
        pass
        t_2.append(
            "    off_b = batch_head // num_q_heads\n    off_h = (batch_head % num_q_heads).to(tl.int64)\n    off_hkv = off_h // q_per_kv\n    # -- this program's sequence: rows [q_first, q_end) of the packed q, [k_first, k_end) of k\n    q_first = tl.load(CuSeqlensQ + off_b)\n    q_end = tl.load(CuSeqlensQ + off_b + 1)\n    k_first = tl.load(CuSeqlensK + off_b)\n    k_end = tl.load(CuSeqlensK + off_b + 1)\n    # Note: the lengths are the caller's device data, never read by the host, so they are\n    # bounded here, once per program: a sequence must lie inside the packed tensors and\n    # within the grid that max_seqlen_q sized ((M - 1) // BLOCK_M < blocks, no overflow).\n    seqlen_q = q_end - q_first\n    seq_ok = ((q_first >= 0) & (q_first <= q_end) & (q_end <= total_q)\n              & (k_first >= 0) & (k_first <= k_end) & (k_end <= total_k)\n              & ((seqlen_q - 1) // BLOCK_M < num_m_blocks))\n    if USE_SEQUSED_K:\n        # flash-attn's seqused_k: the sequence's keys start at cu_seqlens_k[b] and only the\n        # first seqused_k[b] of them are used (a KV cache read in place, gaps allowed).\n        seqlen_k = tl.load(SequsedK + off_b)\n        seq_ok = seq_ok & (seqlen_k >= 0) & (seqlen_k <= k_end - k_first)\n    else:\n        seqlen_k = k_end - k_first\n    # Rows no sequence covers read 0 (LSE -inf) without a fill on the host: the first\n    # sequence's programs write the rows before cu_seqlens_q[0], the last sequence's those from\n    # cu_seqlens_q[B] on. With each sequence's own rows (its output, or NaN) that is every row\n    # of q whatever cu_seqlens holds: from cu_seqlens_q[0] to cu_seqlens_q[B] each row lies in\n    # some step upwards [cu_seqlens_q[b], cu_seqlens_q[b + 1]).\n    if off_b == 0:\n        _fill_rows(Out, Lse, 0, q_first, total_q, off_h, m_block, num_m_blocks,\n                   stride_om, stride_oh, stride_od, stride_lse_h, False, STORE_LSE, BLOCK_M)\n    if off_b == tl.num_programs(0) // (num_m_blocks * num_q_heads) - 1:\n        _fill_rows(Out, Lse, q_end, total_q, total_q, off_h, m_block, num_m_blocks,\n                   stride_om, stride_oh, stride_od, stride_lse_h, False, STORE_LSE, BLOCK_M)\n    if not seq_ok:\n        _fill_rows(Out, Lse, q_first, q_end, total_q, off_h, m_block, num_m_blocks,\n                   stride_om, stride_oh, stride_od, stride_lse_h, True, STORE_LSE, BLOCK_M)\n        return\n    q_offset = q_first.to(tl.int64)\n    k_offset = k_first.to(tl.int64)\n    q_start = m_block * BLOCK_M\n    if q_start >= seqlen_q:\n        return\n    q_base = Q + q_offset * stride_qm + off_h * stride_qh\n    k_base = K + k_offset * stride_kn + off_hkv * stride_kh\n    v_base = V + k_offset * stride_vn + off_hkv * stride_vh\n    o_base = Out + q_offset * stride_om + off_h * stride_oh",
        )
        return concat(t_2)
    context.exported_vars.add('sequence_bounds')
    context.vars['sequence_bounds'] = l_0_sequence_bounds = Macro(environment, macro, 'sequence_bounds', (), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '6=12&25=18&30=25'