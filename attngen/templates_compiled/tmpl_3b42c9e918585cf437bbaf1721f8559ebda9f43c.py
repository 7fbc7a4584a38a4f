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
        l_1_block_dv = resolve('block_dv')
        l_1_sinks = resolve('sinks')
        l_1_head_dim_v = resolve('head_dim_v')
        pass
        t_2.extend((
            "# The merge reads a row's splits _MERGE_SPLITS at a time and DV in chunks of _MERGE_COLS\n# columns, so one load brings a [_MERGE_SPLITS, _MERGE_COLS] tile (16 fp32 a thread with 4\n# warps): a row of 16 splits costs two L2 round trips (its LSEs, then LSEs and partials\n# together), where a loop over single splits cost two per split and made the merge the\n# step's longest part at B 1 (9.5 us of a 17.2 us kernel, 16 splits, on the H200).\n_MERGE_SPLITS = tl.constexpr(16)\n_MERGE_COLS = tl.constexpr(min(",
            str((undefined(name='block_dv') if l_1_block_dv is missing else l_1_block_dv)),
            ", 2048 // 16))\n\n\n# Note: a function the split kernel calls, not inlined, and given only the kernel's own\n# arguments (pointers and ints the launch passes, which need no register until the call): it\n# finds its tile from the program id again. Inlined, or given values the kernel computed\n# (its tile's indices), the merge raised the split kernel's registers for every split\n# program, where only a tile's last one merges: sm80 124 -> 152 (Llama 4 chunked) and\n# 128 -> 168 (Qwen 2.5) inlined, sm90 96 -> 156 (Mistral) called with the indices.\n# tools/decode_compile_check.py records the split kernel's registers with the merge.\n@triton.jit(noinline=True)\ndef _decode_merge_tile(\n    Counters, Out, Lse, PartOut, PartLse,",
        ))
        if (undefined(name='sinks') if l_1_sinks is missing else l_1_sinks):
            pass
            t_2.append(
                ' Sinks,',
            )
        t_2.append(
            ' stride_ob, stride_oh,\n    stride_ot, stride_od, num_kv_heads, q_per_kv, num_q_tokens, num_row_blocks, num_splits,\n    STORE_LSE: tl.constexpr,\n    BLOCK_ROWS: tl.constexpr,\n):\n    # The splits of a tile (one sequence, KV head and row block: adjacent programs, as in the\n    # split kernel) count themselves on Counters[tile]. Note: the barrier puts every thread\'s\n    # partial stores before the atomic, whose release (acq_rel, GPU scope) publishes them; the\n    # program that sees the count num_splits - 1 acquires them all, and it zeroes the counter\n    # for the next launch (the launcher keeps one buffer per stream, zero between launches).\n    tile = tl.program_id(0) // num_splits\n    row_block = tile % num_row_blocks\n    off_bh = tile // num_row_blocks\n    off_b = (off_bh // num_kv_heads).to(tl.int64)\n    off_hkv = (off_bh % num_kv_heads).to(tl.int64)\n    tl.debug_barrier()\n    arrived = tl.atomic_add(Counters + tile, 1, sem="acq_rel")\n    if arrived == num_splits - 1:\n        tl.store(Counters + tile, 0)\n        # Each of the tile\'s rows: out = sum_s w_s o_s / sum_s w_s with w_s = exp2(lse_s -\n        # max lse); a split that saw no key has lse_s = -inf and w_s = 0, a NaN (a request\n        # that does not fit) stays NaN. The max and the weights\' sum in one pass over the\n        # LSEs (the sum rescaled when the max grows), then the partials. Loads bypass L1\n        # (.cg): the partials are other programs\' stores.\n        offs_s = tl.arange(0, _MERGE_SPLITS)\n        tile_rows = q_per_kv * num_q_tokens\n        first_row = row_block * BLOCK_ROWS\n        for row_in_head in range(first_row, tl.minimum(first_row + BLOCK_ROWS, tile_rows)):\n            offs_t = row_in_head % num_q_tokens\n            off_h = off_hkv * q_per_kv + row_in_head // num_q_tokens\n            base = ((off_b * num_kv_heads + off_hkv) * tile_rows + row_in_head) * num_splits\n            lse_max = float("-inf")\n            total = 0.0\n            for first_split in range(0, num_splits, _MERGE_SPLITS):\n                split_ok = first_split + offs_s < num_splits\n                lse = tl.load(PartLse + base + first_split + offs_s, mask=split_ok,\n                              other=float("-inf"), cache_modifier=".cg")\n                new_max = tl.maximum(lse_max, tl.max(lse, 0))\n                new_ref = tl.where(new_max == float("-inf"), 0.0, new_max)\n                total = (total * tl.math.exp2(lse_max - new_ref)\n                         + tl.sum(tl.math.exp2(lse - new_ref), 0))\n                lse_max = new_max\n',
        )
        if (undefined(name='sinks') if l_1_sinks is missing else l_1_sinks):
            pass
            t_2.append(
                '            # the row\'s learned sink: one more term in the normaliser, with no value\n            sink_log2 = tl.load(Sinks + off_h) * _LOG2E_C\n            new_max = tl.maximum(lse_max, sink_log2)\n            new_ref = tl.where(new_max == float("-inf"), 0.0, new_max)\n            total = total * tl.math.exp2(lse_max - new_ref) + tl.math.exp2(sink_log2 - new_ref)\n            lse_max = new_max\n',
            )
        t_2.append(
            '            m_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)\n            total_safe = tl.where(total == 0.0, 1.0, total)\n            if STORE_LSE:\n                lse2 = tl.where(total == 0.0, float("-inf"), m_ref + tl.math.log2(total_safe))\n                tl.store(Lse + base // num_splits, lse2 / _LOG2E_C)\n            o_row = Out + off_b * stride_ob + off_h * stride_oh + offs_t.to(tl.int64) * stride_ot\n            for first_col in tl.static_range(0, _BLOCK_DV, _MERGE_COLS):\n                offs_c = first_col + tl.arange(0, _MERGE_COLS)\n                merged = tl.zeros([_MERGE_COLS], dtype=tl.float32)\n                for first_split in range(0, num_splits, _MERGE_SPLITS):\n                    split_ok = first_split + offs_s < num_splits\n                    parts = base + first_split + offs_s\n                    lse = tl.load(PartLse + parts, mask=split_ok, other=float("-inf"),\n                                  cache_modifier=".cg")\n                    part_o = tl.load(PartOut + parts[:, None] * _BLOCK_DV + offs_c[None, :],\n                                     mask=split_ok[:, None]',
        )
        if ((undefined(name='block_dv') if l_1_block_dv is missing else l_1_block_dv) != (undefined(name='head_dim_v') if l_1_head_dim_v is missing else l_1_head_dim_v)):
            pass
            t_2.append(
                ' & (offs_c < _HEAD_DIM_V)[None, :]',
            )
        t_2.append(
            ',\n                                     other=0.0, cache_modifier=".cg")\n                    merged += tl.sum(part_o * tl.math.exp2(lse - m_ref)[:, None], 0)\n                tl.store(o_row + offs_c * stride_od, (merged / total_safe).to(Out.dtype.element_ty)',
        )
        if ((undefined(name='block_dv') if l_1_block_dv is missing else l_1_block_dv) != (undefined(name='head_dim_v') if l_1_head_dim_v is missing else l_1_head_dim_v)):
            pass
            t_2.append(
                ', mask=offs_c < _HEAD_DIM_V',
            )
        t_2.append(
            ')',
        )
        return concat(t_2)
    context.exported_vars.add('merge_tile_function')
    context.vars['merge_tile_function'] = l_0_merge_tile_function = Macro(environment, macro, 'merge_tile_function', (), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '5=12&11=19&16=31&23=39&35=42&77=50&100=58&104=66'