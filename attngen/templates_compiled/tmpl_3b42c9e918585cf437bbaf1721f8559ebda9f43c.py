from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_decode_merge.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_merge_splits = l_0_merge_tile_function = missing
    pass
    def macro():
        t_1 = []
        l_1_sinks = resolve('sinks')
        pass
        t_1.append(
            "        # Partials [B, HQ, NQ, splits, DV] and [B, HQ, NQ, splits], fp32, log2-domain LSE.\n        part = rows * num_splits + split\n        tl.store(PartOut + part[:, None] * _BLOCK_DV + offs_dv[None, :], out, mask=o_mask)\n        tl.store(PartLse + part, lse2, mask=row_ok)\n        # -- the tile's last split to finish merges every split's partial ----------------\n        _decode_merge_tile(Counters, Out, Lse, PartOut, PartLse,",
        )
        if (undefined(name='sinks') if l_1_sinks is missing else l_1_sinks):
            pass
            t_1.append(
                ' Sinks,',
            )
        t_1.append(
            ' stride_ob, stride_oh,\n                           stride_ot, stride_od, num_kv_heads, q_per_kv, num_q_tokens,\n                           num_row_blocks, num_splits, STORE_LSE, BLOCK_ROWS)',
        )
        return concat(t_1)
    context.exported_vars.add('merge_splits')
    context.vars['merge_splits'] = l_0_merge_splits = Macro(environment, macro, 'merge_splits', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_2 = []
        l_1_sinks = resolve('sinks')
        pass
        t_2.append(
            "# The merge's tile: at most this many elements of the [rows, DV] output at a time (8 fp32 a\n# thread with 4 warps), DV in chunks of columns, so that its registers stay below the key\n# loop's whatever the row tile and DV.\n_MERGE_ELEMENTS = tl.constexpr(1024)\n\n\n# Note: a function the split kernel calls, not inlined, and given only the kernel's own\n# arguments (pointers and ints the launch passes, which need no register until the call): it\n# finds its tile from the program id again. Inlined, or given values the kernel computed\n# (its tile's indices), the merge raised the split kernel's registers for every split\n# program, where only a tile's last one merges: sm80 124 -> 152 (Llama 4 chunked) and\n# 128 -> 168 (Qwen 2.5) inlined, sm90 96 -> 156 (Mistral) called with the indices. As it is,\n# no example's split kernel needs more registers than without the merge\n# (tools/decode_compile_check.py).\n@triton.jit(noinline=True)\ndef _decode_merge_tile(\n    Counters, Out, Lse, PartOut, PartLse,",
        )
        if (undefined(name='sinks') if l_1_sinks is missing else l_1_sinks):
            pass
            t_2.append(
                ' Sinks,',
            )
        t_2.append(
            ' stride_ob, stride_oh,\n    stride_ot, stride_od, num_kv_heads, q_per_kv, num_q_tokens, num_row_blocks, num_splits,\n    STORE_LSE: tl.constexpr,\n    BLOCK_ROWS: tl.constexpr,\n):\n    # The splits of a tile (one sequence, KV head and row block: adjacent programs, as in the\n    # split kernel) count themselves on Counters[tile]. Note: the barrier puts every thread\'s\n    # partial stores before the atomic, whose release (acq_rel, GPU scope) publishes them; the\n    # program that sees the count num_splits - 1 acquires them all, and it zeroes the counter\n    # for the next launch (the launcher keeps one buffer per stream, zero between launches).\n    tile = tl.program_id(0) // num_splits\n    row_block = tile % num_row_blocks\n    off_bh = tile // num_row_blocks\n    off_b = (off_bh // num_kv_heads).to(tl.int64)\n    off_hkv = (off_bh % num_kv_heads).to(tl.int64)\n    tl.debug_barrier()\n    arrived = tl.atomic_add(Counters + tile, 1, sem="acq_rel")\n    if arrived == num_splits - 1:\n        tl.store(Counters + tile, 0)\n        # The tile\'s rows (as the split kernel\'s): out = sum_s w_s o_s / sum_s w_s with\n        # w_s = exp2(lse_s - max lse); a split that saw no key has lse_s = -inf and w_s = 0, a\n        # NaN (a request that does not fit) stays NaN. Two passes over the splits\' LSEs (the\n        # max, then the weights\' sum), then per chunk of COLS columns one split\'s partial at\n        # a time, its weight read again (a few bytes, from L2). Loads bypass L1 (.cg): the\n        # partials are other programs\' stores.\n        COLS: tl.constexpr = min(_BLOCK_DV, _MERGE_ELEMENTS // BLOCK_ROWS)\n        offs_r = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)\n        row_ok = offs_r < q_per_kv * num_q_tokens\n        offs_t = offs_r % num_q_tokens\n        offs_h = off_hkv * q_per_kv + (offs_r // num_q_tokens).to(tl.int64)\n        rows = (off_b * num_kv_heads * q_per_kv + offs_h) * num_q_tokens + offs_t\n        base = rows * num_splits\n        lse_max = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)\n        for s in range(0, num_splits):\n            lse_s = tl.load(PartLse + base + s, mask=row_ok, other=float("-inf"),\n                            cache_modifier=".cg")\n            lse_max = tl.maximum(lse_max, lse_s)\n',
        )
        if (undefined(name='sinks') if l_1_sinks is missing else l_1_sinks):
            pass
            t_2.append(
                "        # the row's learned sink: one more term in the normaliser, with no value\n        sink_log2 = tl.load(Sinks + offs_h, mask=row_ok, other=0.0) * _LOG2E_C\n        lse_max = tl.maximum(lse_max, sink_log2)\n",
            )
        t_2.append(
            '        m_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)\n        total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)\n        for s in range(0, num_splits):\n            lse_s = tl.load(PartLse + base + s, mask=row_ok, other=float("-inf"),\n                            cache_modifier=".cg")\n            total += tl.math.exp2(lse_s - m_ref)\n',
        )
        if (undefined(name='sinks') if l_1_sinks is missing else l_1_sinks):
            pass
            t_2.append(
                '        total += tl.math.exp2(sink_log2 - m_ref)\n',
            )
        t_2.append(
            '        total_safe = tl.where(total == 0.0, 1.0, total)\n        if STORE_LSE:\n            lse2 = tl.where(total == 0.0, float("-inf"), m_ref + tl.math.log2(total_safe))\n            tl.store(Lse + rows, lse2 / _LOG2E_C, mask=row_ok)\n        o_rows = off_b * stride_ob + offs_h * stride_oh + offs_t.to(tl.int64) * stride_ot\n        for first_col in range(0, _BLOCK_DV, COLS):\n            offs_c = first_col + tl.arange(0, COLS)\n            c_mask = row_ok[:, None] & (offs_c < _HEAD_DIM_V)[None, :]\n            merged = tl.zeros([BLOCK_ROWS, COLS], dtype=tl.float32)\n            for s in range(0, num_splits):\n                lse_s = tl.load(PartLse + base + s, mask=row_ok, other=float("-inf"),\n                                cache_modifier=".cg")\n                w = tl.math.exp2(lse_s - m_ref)\n                part_o = tl.load(PartOut + (base + s)[:, None] * _BLOCK_DV + offs_c[None, :],\n                                 mask=c_mask, other=0.0, cache_modifier=".cg")\n                merged += part_o * w[:, None]\n            merged = merged / total_safe[:, None]\n            tl.store(Out + o_rows[:, None] + offs_c[None, :] * stride_od,\n                     merged.to(Out.dtype.element_ty), mask=c_mask)',
        )
        return concat(t_2)
    context.exported_vars.add('merge_tile_function')
    context.vars['merge_tile_function'] = l_0_merge_tile_function = Macro(environment, macro, 'merge_tile_function', (), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '5=12&11=19&16=31&33=38&70=46&81=54'