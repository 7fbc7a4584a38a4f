from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_backward.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_bwd_dq_config = resolve('bwd_dq_config')
    l_0_bwd_dkdv_config = resolve('bwd_dkdv_config')
    l_0_bwd_dkdv_split = resolve('bwd_dkdv_split')
    l_0_bwd_dkdv_atomic_config = resolve('bwd_dkdv_atomic_config')
    l_0_softcap = resolve('softcap')
    l_0_alibi = resolve('alibi')
    l_0_mask = resolve('mask')
    l_0_sink_tokens = resolve('sink_tokens')
    l_0_dtype = resolve('dtype')
    l_0_varlen = resolve('varlen')
    l_0_bw = missing
    pass
    l_0_bw = context.vars['bw'] = environment.get_template('_backward_macros.py.jinja', '_backward.py.jinja').make_module(context.get_all(), True, {'bw': l_0_bw})
    context.exported_vars.discard('bw')
    yield "# The backward kernels' launch configs, derived like CONFIG (attngen/tiling/backward.py).\nBWD_DQ_CONFIG = "
    yield str((undefined(name='bwd_dq_config') if l_0_bwd_dq_config is missing else l_0_bwd_dq_config))
    yield '\nBWD_DKDV_CONFIG = '
    yield str((undefined(name='bwd_dkdv_config') if l_0_bwd_dkdv_config is missing else l_0_bwd_dkdv_config))
    yield '\n# None, or (dV config, dK config): dK and dV by two launches of the dK/dV kernel, one\n# accumulator each (wider key tiles where both accumulators would not fit in registers).\nBWD_DKDV_SPLIT = '
    yield str((undefined(name='bwd_dkdv_split') if l_0_bwd_dkdv_split is missing else l_0_bwd_dkdv_split))
    yield '\n# deterministic=False: the config of the dK/dV launch that also adds dQ by atomics (with the\n# split, the dK launch), or None where its shared memory would not fit: deterministic=False\n# then runs the deterministic kernels (attngen/tiling/backward.py, atomic_dkdv_config).\nBWD_DKDV_ATOMIC_CONFIG = '
    yield str((undefined(name='bwd_dkdv_atomic_config') if l_0_bwd_dkdv_atomic_config is missing else l_0_bwd_dkdv_atomic_config))
    yield '\n\n\n@triton.jit\ndef _bwd_probs(qk, qk_scale, lse2, q_pos2, key_pos2, slope_log2):\n    """P = exp(S - LSE) from the forward\'s LSE (lse2 = LSE * log2 e, broadcast to the tile;\n    +inf for a row that sees no key, so that its P is 0), in the forward\'s log2 domain, and\n'
    if (undefined(name='softcap') if l_0_softcap is missing else l_0_softcap):
        pass
        yield 'tanh of the softcap (its derivative is 1 - tanh^2)'
    else:
        pass
        yield 'qk (unused)'
    yield '.\n    q_pos2, key_pos2 broadcast to the tile in either orientation."""\n'
    if (undefined(name='softcap') if l_0_softcap is missing else l_0_softcap):
        pass
        yield '    t = _tanh(qk * qk_scale)\n    scores = t * _SOFTCAP_LOG2\n'
    elif (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield '    t = qk\n    scores = qk * qk_scale\n'
    else:
        pass
        yield '    t = qk\n    scores = qk\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield '    scores = scores - slope_log2 * tl.abs(q_pos2 - key_pos2).to(tl.float32)\n'
    if ((undefined(name='softcap') if l_0_softcap is missing else l_0_softcap) or (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi)):
        pass
        yield '    p = tl.math.exp2(scores - lse2)\n'
    else:
        pass
        yield '    p = tl.math.exp2(scores * qk_scale - lse2)\n'
    yield '    return p, t\n\n\n@triton.jit\ndef _bwd_visible(q_pos2, key_pos2, seqlen_k):\n    """Which (row, key) pairs of a tile are visible; broadcast shapes, either orientation."""\n    visible = key_pos2 < seqlen_k\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'causal'):
        pass
        yield '    visible = visible & (key_pos2 <= q_pos2)\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield "    # causal inside the row's chunk: chunk_first(i') <= j <= i' (a row with i' < 0 sees no\n    # key, so it may take chunk 0); one division per row of the broadcast q_pos2\n    q_chunk_first = (tl.maximum(q_pos2, 0) // _CHUNK_SIZE) * _CHUNK_SIZE\n    visible = visible & (key_pos2 <= q_pos2) & (key_pos2 >= q_chunk_first)\n"
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield "    # i' - j (bounded by the lengths) against the sides; i' -/+ a side may overflow.\n    offset = q_pos2 - key_pos2\n"
        if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
            pass
            yield "    # the first _SINK_TOKENS keys ignore the window's left side\n    left_ok = (offset <= _WINDOW_LEFT) | (key_pos2 < _SINK_TOKENS)\n"
        else:
            pass
            yield '    left_ok = offset <= _WINDOW_LEFT\n'
        yield '    visible = visible & left_ok & (offset >= -_WINDOW_RIGHT)\n'
    yield '    return visible\n\n\n@triton.jit\ndef _bwd_key_live(first_q_pos, last_q_pos, key_pos, seqlen_k):\n    """Keys that some row with aligned position in [first_q_pos, last_q_pos] sees."""\n    live = key_pos < seqlen_k\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'causal'):
        pass
        yield '    live = live & (key_pos <= last_q_pos)\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield '    # int64, then clamped to the keys: a side may be 2**31 - 1.\n    live_first = tl.maximum(first_q_pos.to(tl.int64) - _WINDOW_LEFT, 0).to(tl.int32)\n    live_last = tl.minimum(last_q_pos.to(tl.int64) + _WINDOW_RIGHT, seqlen_k - 1).to(tl.int32)\n'
        if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
            pass
            yield '    live = live & ((key_pos >= live_first) | (key_pos < _SINK_TOKENS)) & (key_pos <= live_last)\n'
        else:
            pass
            yield '    live = live & (key_pos >= live_first) & (key_pos <= live_last)\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield '    # from the chunk start of the first row to the last row\n    live_first = (tl.maximum(first_q_pos, 0) // _CHUNK_SIZE) * _CHUNK_SIZE\n    live = live & (key_pos >= live_first) & (key_pos <= last_q_pos)\n'
    yield '    return live\n\n\n@triton.jit\ndef _bwd_row_live(first_k_pos, last_k_pos, q_pos, row_ok):\n    """Rows (aligned positions q_pos) that see some key of [first_k_pos, last_k_pos]."""\n    live = row_ok\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'causal'):
        pass
        yield '    live = live & (q_pos >= first_k_pos)\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
            pass
            yield '    # a block that starts with a sink token is seen by every row within the right side\n    left_ok = (q_pos - last_k_pos <= _WINDOW_LEFT) | (first_k_pos < _SINK_TOKENS)\n    live = live & left_ok & (first_k_pos - q_pos <= _WINDOW_RIGHT)\n'
        else:
            pass
            yield '    live = live & (q_pos - last_k_pos <= _WINDOW_LEFT) & (first_k_pos - q_pos <= _WINDOW_RIGHT)\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield "    # i' >= first_k_pos, and i''s chunk starts at or before last_k_pos: i' is below the end\n    # of last_k_pos's chunk (compared as a difference of non-negative int32s: no overflow)\n    last_chunk_first = (last_k_pos // _CHUNK_SIZE) * _CHUNK_SIZE\n    live = live & (q_pos >= first_k_pos)\n    live = live & (tl.maximum(q_pos, first_k_pos) - last_chunk_first < _CHUNK_SIZE)\n"
    yield '    return live\n\n\n@triton.jit\ndef _bwd_query_ranges(first_k_pos, last_k_pos, diagonal, seqlen_q, BLOCK_M: tl.constexpr):\n    """The dual of the forward\'s key ranges for a key block [first_k_pos, last_k_pos]: rows\n    [full_lo, full_hi) see every key of it (no mask), [lo, full_lo) and [full_hi, hi) some\n    (masked), rows outside [lo, hi) none (skipped). Multiples of BLOCK_M except hi."""\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'causal'):
        pass
        yield '    rows_lo = first_k_pos - diagonal\n    rows_hi = seqlen_q\n    full_rows_lo = last_k_pos - diagonal\n    full_rows_hi = seqlen_q\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield '    # int64: a side may be 2**31 - 1; clamped to [0, seqlen_q] below, so int32 again.\n    rows_lo = first_k_pos.to(tl.int64) - _WINDOW_RIGHT - diagonal\n    rows_hi = last_k_pos.to(tl.int64) + _WINDOW_LEFT - diagonal + 1\n    full_rows_lo = last_k_pos.to(tl.int64) - _WINDOW_RIGHT - diagonal\n'
        if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
            pass
            yield "    # Sink tokens ignore the left side: a block that starts with one is seen by every row\n    # from rows_lo on, one made of them only by every row from full_rows_lo on; otherwise\n    # every row to the first non-sink key's window edge sees the whole block.\n    full_rows_hi = (tl.maximum(first_k_pos, _SINK_TOKENS).to(tl.int64) + _WINDOW_LEFT\n                    - diagonal + 1)\n    rows_hi = tl.where(first_k_pos < _SINK_TOKENS, seqlen_q, rows_hi)\n    full_rows_hi = tl.where(last_k_pos < _SINK_TOKENS, seqlen_q, full_rows_hi)\n"
        else:
            pass
            yield '    full_rows_hi = first_k_pos.to(tl.int64) + _WINDOW_LEFT - diagonal + 1\n'
        yield '    rows_lo = tl.minimum(tl.maximum(rows_lo, 0), seqlen_q).to(tl.int32)\n    rows_hi = tl.minimum(tl.maximum(rows_hi, 0), seqlen_q).to(tl.int32)\n    full_rows_lo = tl.minimum(tl.maximum(full_rows_lo, 0), seqlen_q).to(tl.int32)\n    full_rows_hi = tl.minimum(tl.maximum(full_rows_hi, 0), seqlen_q).to(tl.int32)\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield "    # Rows i' from first_k_pos to the end of last_k_pos's chunk see some key of the block;\n    # those from last_k_pos to the end of first_k_pos's chunk every key (none when the block\n    # spans a chunk boundary). At most chunk_size + BLOCK_N rows: O(N x chunk) work in all.\n    # int64: a chunk's end may pass 2**31 - 1; clamped to [0, seqlen_q] below.\n    rows_lo = first_k_pos.to(tl.int64) - diagonal\n    rows_hi = ((last_k_pos // _CHUNK_SIZE).to(tl.int64) + 1) * _CHUNK_SIZE - diagonal\n    full_rows_lo = last_k_pos.to(tl.int64) - diagonal\n    full_rows_hi = ((first_k_pos // _CHUNK_SIZE).to(tl.int64) + 1) * _CHUNK_SIZE - diagonal\n    rows_lo = tl.minimum(tl.maximum(rows_lo, 0), seqlen_q).to(tl.int32)\n    rows_hi = tl.minimum(tl.maximum(rows_hi, 0), seqlen_q).to(tl.int32)\n    full_rows_lo = tl.minimum(tl.maximum(full_rows_lo, 0), seqlen_q).to(tl.int32)\n    full_rows_hi = tl.minimum(tl.maximum(full_rows_hi, 0), seqlen_q).to(tl.int32)\n"
    else:
        pass
        yield '    rows_lo = seqlen_q * 0\n    rows_hi = seqlen_q\n    full_rows_lo = rows_lo\n    full_rows_hi = seqlen_q\n'
    yield '    rows_lo = tl.minimum(tl.maximum(rows_lo, 0), seqlen_q)\n    lo = (rows_lo // BLOCK_M) * BLOCK_M\n    hi = tl.minimum(rows_hi, seqlen_q)\n    hi = tl.where(hi > rows_lo, hi, lo)  # no row sees the block: nothing to do\n    full_lo = tl.minimum(tl.cdiv(tl.maximum(full_rows_lo, lo), BLOCK_M) * BLOCK_M, hi)\n    full_hi = tl.maximum((tl.minimum(full_rows_hi, hi) // BLOCK_M) * BLOCK_M, full_lo)\n    return lo, full_lo, full_hi, hi\n\n\n'
    if ((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype) == 'fp32'):
        pass
        yield '@triton.jit\ndef _bwd_add_dot(acc, a, b):\n    """acc + a @ b, the block\'s product summed on its own first. Note: fp32 dots are FMA\n    loops that chain each product into the accumulator they are given: dot(a, b, acc) across\n    a loop would sum all its terms (every block; in the dK/dV kernel, every head of the KV\n    group) in one sequential chain. A product per block, then one add per block (a two-level\n    sum), keeps the chains, and the rounding error with them, to a block\'s length plus the\n    number of blocks. acc + dot(a, b) would not do: Triton folds it into dot(a, b, acc); an\n    FMA by 1.0 (acc + a @ b exactly, rounded once) is not folded."""\n    return tl.fma(tl.dot(a, b, input_precision="ieee"), 1.0, acc)\n\n\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '@triton.jit\ndef _store_nan_grad_rows(Grad, first, end, total, off_h, block, num_blocks,\n                         stride_row, stride_h, stride_d, DIM: tl.constexpr,\n                         BLOCK_DIM: tl.constexpr, BLOCK: tl.constexpr):\n    """A sequence that does not fit: NaN gradients in its rows that lie inside the packed\n    tensor (the sequence\'s programs take every num_blocks-th block of BLOCK rows)."""\n    lo = tl.minimum(tl.maximum(first, 0), total)\n    hi = tl.minimum(tl.maximum(end, lo), total)\n    offs_d = tl.arange(0, BLOCK_DIM)\n    nan = tl.full([BLOCK, BLOCK_DIM], float("nan"), dtype=Grad.dtype.element_ty)\n    for start in tl.range(lo + block * BLOCK, hi, num_blocks * BLOCK):\n        rows = start + tl.arange(0, BLOCK)\n        ptrs = (Grad + rows.to(tl.int64)[:, None] * stride_row + off_h * stride_h\n                + offs_d[None, :] * stride_d)\n        tl.store(ptrs, nan, mask=(rows < hi)[:, None] & (offs_d < DIM)[None, :])\n\n\n'
    template = environment.get_template('_backward_dq.py.jinja', '_backward.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'bw': l_0_bw}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    template = environment.get_template('_backward_dkdv.py.jinja', '_backward.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'bw': l_0_bw}))
    try:
        for event in gen:
            yield event
    finally: gen.close()

blocks = {}
debug_info = '13=22&15=25&16=27&19=29&23=31&30=33&32=40&35=43&42=49&45=52&57=59&59=62&64=65&67=68&82=76&84=79&88=82&93=88&105=92&107=95&108=97&115=103&130=107&135=110&140=113&155=120&183=127&197=130&216=133&217=139'