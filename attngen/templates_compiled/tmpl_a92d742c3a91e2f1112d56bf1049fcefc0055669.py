from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = 'decode.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_kv_layout = resolve('kv_layout')
    l_0_module_name = resolve('module_name')
    l_0_max_query_tokens = resolve('max_query_tokens')
    l_0_head_dim = resolve('head_dim')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_mask = resolve('mask')
    l_0_window_left = resolve('window_left')
    l_0_window_right = resolve('window_right')
    l_0_chunk_size = resolve('chunk_size')
    l_0_sink_tokens = resolve('sink_tokens')
    l_0_sinks = resolve('sinks')
    l_0_page_size = resolve('page_size')
    l_0_rope_dim = resolve('rope_dim')
    l_0_split_waves = resolve('split_waves')
    l_0_min_blocks_per_split = resolve('min_blocks_per_split')
    l_0_max_splits = resolve('max_splits')
    l_0_interpreter_sm_count = resolve('interpreter_sm_count')
    l_0_alibi = resolve('alibi')
    l_0_block_n = resolve('block_n')
    l_0_host_code = resolve('host_code')
    l_0_score_code = l_0_common = l_0_step = l_0_latent = missing
    try:
        t_1 = environment.filters['indent']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'indent' found.")
    try:
        t_2 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_2(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_score_code = context.vars['score_code'] = environment.get_template('_scores.py.jinja', 'decode.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step})
    context.exported_vars.discard('score_code')
    l_0_common = context.vars['common'] = environment.get_template('_common.py.jinja', 'decode.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step})
    context.exported_vars.discard('common')
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', 'decode.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step})
    context.exported_vars.discard('step')
    l_0_latent = context.vars['latent'] = environment.get_template('_decode_latent.py.jinja', 'decode.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step})
    context.exported_vars.discard('latent')
    template = environment.get_template('_header.py.jinja', 'decode.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield '"""Decode attention against a '
    yield str((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout))
    yield ' KV cache: split-KV (flash-decoding), exact.\n\nModule '
    yield str((undefined(name='module_name') if l_0_module_name is missing else l_0_module_name))
    yield '.\n\nNotation: B sequences, HQ query heads, HKV KV heads (query head h reads KV head\nh // (HQ // HKV)), NQ <= '
    yield str((undefined(name='max_query_tokens') if l_0_max_query_tokens is missing else l_0_max_query_tokens))
    yield ' query tokens per step, D = '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield ', DV = '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield ".\nSequence b holds L_b = cache_seqlens[b] + NNEW keys once the step's NNEW new keys are\nappended; its NQ queries are its last tokens: query t sits at position L_b - NQ + t\n(bottom-right alignment)"
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'causal'):
        pass
        yield ' and sees keys j <= L_b - NQ + t'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield ' and sees keys j with\nL_b - NQ + t - '
        yield str((undefined(name='window_left') if l_0_window_left is missing else l_0_window_left))
        yield ' <= j <= L_b - NQ + t + '
        yield str((undefined(name='window_right') if l_0_window_right is missing else l_0_window_right))
        yield ', j < L_b'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield ' and sees keys j of its own\nchunk up to it: (L_b - NQ + t) // '
        yield str((undefined(name='chunk_size') if l_0_chunk_size is missing else l_0_chunk_size))
        yield ' * '
        yield str((undefined(name='chunk_size') if l_0_chunk_size is missing else l_0_chunk_size))
        yield ' <= j <= L_b - NQ + t'
    else:
        pass
        yield ' and sees every key j < L_b'
    yield '.\n'
    if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
        pass
        yield 'The first '
        yield str((undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens))
        yield " keys ignore the window's left side (sink tokens).\n"
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield "Each query head h has a learned sink logit s_h (`sinks`): one more term exp(s_h) in every\nrow's normaliser (and LSE) that takes no value.\n"
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield 'The cache is paged: key j of sequence b is slot j % '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ' of page block_table[b, j // '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ']\nin caches [num_pages, '
        yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
        yield ', HKV, D].\n'
    else:
        pass
        yield 'The cache is contiguous: caches [B, HKV, Lmax, D], any strides.\n'
    yield '\nA program owns one (sequence, KV head, split): its query tile packs every query head of\nthe KV head and every query token (q_per_kv * NQ rows, padded to BLOCK_ROWS >= 16), so\neach K/V byte is read from HBM once; it streams the split\'s keys in BLOCK_N tiles with an\nonline softmax in the log2 domain. CONFIG["BLOCK_M"] is the largest query tile (a larger\ngroup is split into row blocks that each read the KV again). With one split the program\nwrites the output; with several, each writes a normalized partial and its LSE and a\ncombine kernel merges them exactly (rescaled by the largest LSE). The split count comes\nfrom shapes (or the call\'s num_splits) only, never from device data, so a launch can be\ncaptured in a CUDA graph.\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield '\nMulti-head latent attention, absorbed: q.k is two dots over one key tile, the latent\n(the first DV = '
        yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
        yield ' dims) and the rope ('
        yield str((undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim))
        yield "), with no padding of D; with\nv_cache = k_cache[..., :DV] the latent tile is also V (V_FROM_K: each key read once), any\nother v_cache is read as a tensor of its own with SEPARATE_V_CONFIG's tile.\n"
    yield '"""\n\n'
    yield str(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'spec_constants')))
    yield '\nKV_LAYOUT = "'
    yield str((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout))
    yield '"\nPAGE_SIZE = '
    yield str((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size))
    yield '\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield str(context.call(environment.getattr((undefined(name='latent') if l_0_latent is missing else l_0_latent), 'constants')))
        yield '\n'
    yield 'MAX_QUERY_TOKENS = '
    yield str((undefined(name='max_query_tokens') if l_0_max_query_tokens is missing else l_0_max_query_tokens))
    yield '\n\n'
    yield str(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'compile_constants')))
    yield '\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield str(context.call(environment.getattr((undefined(name='latent') if l_0_latent is missing else l_0_latent), 'separate_v_constants')))
        yield '\n'
    yield '\n# The split rule (attngen/tiling/decode.py, `attngen explain` works it out).\nSPLIT_WAVES = '
    yield str((undefined(name='split_waves') if l_0_split_waves is missing else l_0_split_waves))
    yield '\nMIN_BLOCKS_PER_SPLIT = '
    yield str((undefined(name='min_blocks_per_split') if l_0_min_blocks_per_split is missing else l_0_min_blocks_per_split))
    yield '\nMAX_SPLITS = '
    yield str((undefined(name='max_splits') if l_0_max_splits is missing else l_0_max_splits))
    yield '\nINTERPRETER_SM_COUNT = '
    yield str((undefined(name='interpreter_sm_count') if l_0_interpreter_sm_count is missing else l_0_interpreter_sm_count))
    yield "\n# Tests set this to force a split count for calls without num_splits (None: the rule decides).\nFORCE_NUM_SPLITS = None\nLAST_NUM_SPLITS = 0  # the split count of this module's latest launch (0: none yet)\n_APPEND_ROWS = 16\n"
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '_PAGE_SIZE = tl.constexpr(PAGE_SIZE)\n_PAGE_CHUNK = tl.constexpr(128)  # block-table entries checked at once (_pages_ok)\n'
    yield '\n\n'
    template = environment.get_template('_cache.py.jinja', 'decode.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield '\n\n@triton.jit\ndef _decode_split_kernel(\n    Q, K, V, Out, Lse, PartOut, PartLse, SeqLens, BlockTable, Cos, Sin, Slopes,'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ' Sinks,'
    yield '\n    stride_qb, stride_qh, stride_qt, stride_qd,\n    stride_k0, stride_kh, stride_kn, stride_kd,\n    stride_v0, stride_vh, stride_vn, stride_vd,\n    stride_ob, stride_oh, stride_ot, stride_od,\n    stride_btb, stride_btp,\n    num_kv_heads, q_per_kv, num_q_tokens, num_new, num_row_blocks, num_splits, split_len,\n    max_cached, num_pages,'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield ' stride_slopes_b,'
    yield '\n    stride_cos_r, stride_cos_c, stride_sin_r, stride_sin_c, seqlen_ro, rotary_q_step, qk_scale,\n    DIRECT: tl.constexpr,\n    STORE_LSE: tl.constexpr,\n    BLOCK_ROWS: tl.constexpr,\n    BLOCK_N: tl.constexpr,\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield '    V_FROM_K: tl.constexpr,\n'
    yield '    ROTARY_HALF: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,\n):\n    tl.static_assert(BLOCK_N % 16 == 0)\n    tl.static_assert(BLOCK_ROWS % 16 == 0)\n    # -- which program: the splits of one (sequence, KV head, row block) are adjacent -------\n    pid = tl.program_id(0)\n    split = pid % num_splits\n    rest = pid // num_splits\n    row_block = rest % num_row_blocks\n    off_bh = rest // num_row_blocks\n    off_b = (off_bh // num_kv_heads).to(tl.int64)\n    off_hkv = (off_bh % num_kv_heads).to(tl.int64)\n    # -- the packed query tile: row r is query head hkv * q_per_kv + r // NQ, token r % NQ ----\n    offs_r = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)\n    row_ok = offs_r < q_per_kv * num_q_tokens\n    offs_t = offs_r % num_q_tokens\n    offs_h = off_hkv * q_per_kv + (offs_r // num_q_tokens).to(tl.int64)\n    offs_n = tl.arange(0, BLOCK_N)\n'
    if (not (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim)):
        pass
        yield '    offs_d = tl.arange(0, _BLOCK_D)\n'
    yield "    offs_dv = tl.arange(0, _BLOCK_DV)\n    # Note: cache_seqlens is the caller's device data, bounded here once per program: a\n    # sequence whose keys would not fit its memory reads nothing (seqlen_k = 0) and gets NaN;\n    # the pages a split reads are checked below, once its keys are known.\n    cached, fits = _request_fits(SeqLens, BlockTable, off_b, stride_btb, stride_btp, num_new,\n                                 num_q_tokens, max_cached, num_pages, CHECK_READS=False)\n    seqlen_k = tl.where(fits, cached + num_new, 0)\n    q_pos = seqlen_k - num_q_tokens + offs_t\n"
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) in ('sliding_window', 'chunked')):
        pass
        yield '    first_q_pos = seqlen_k - num_q_tokens\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none'):
        pass
        yield '    last_q_pos = seqlen_k - 1\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield str(context.call(environment.getattr((undefined(name='latent') if l_0_latent is missing else l_0_latent), 'load_q')))
        yield '\n    rotary_ok = row_ok  # (the launcher refuses rotary for the split dot: ROTARY_HALF is 0)\n'
    else:
        pass
        yield '    q_ptrs = (Q + off_b * stride_qb + offs_h[:, None] * stride_qh\n              + offs_t.to(tl.int64)[:, None] * stride_qt + offs_d[None, :] * stride_qd)\n    q = tl.load(q_ptrs, mask=row_ok[:, None]'
        yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_d'), 'None, :'))
        yield ', other=0.0)\n    q, rotary_ok = _rotate_q(q, q_ptrs, stride_qd, cached, offs_t, rotary_q_step, row_ok & fits,\n                             seqlen_ro, Cos, Sin, stride_cos_r, stride_cos_c, stride_sin_r,\n                             stride_sin_c, ROTARY_HALF, ROTARY_INTERLEAVED)\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield '    # [HQ] slopes have stride_slopes_b 0, [B, HQ] ones their row stride (off_b < B, checked)\n    slope_ptrs = Slopes + off_b * stride_slopes_b + offs_h\n    slope_log2 = (tl.load(slope_ptrs, mask=row_ok, other=0.0) * _LOG2E_C)[:, None]\n'
    yield "    # -- this split's keys: [start, end), BLOCK_N-aligned from the first key any row sees ----\n"
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield '    lo = '
        yield str(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'window_lo')))
        yield '\n    lo = lo.to(tl.int32)\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield '    lo = (((tl.maximum(first_q_pos, 0) // _CHUNK_SIZE) * _CHUNK_SIZE) // BLOCK_N) * BLOCK_N\n'
    else:
        pass
        yield '    lo = 0\n'
    if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
        pass
        yield "    # The splits share one run of key blocks: the sink tokens' blocks left of the window,\n    # [0, sink_hi), then the window's, [lo, L_b); block v of the run is key block\n    # v < sink_hi ? v : v - sink_hi + lo.\n    sink_hi = tl.minimum(tl.cdiv(tl.minimum(seqlen_k, _SINK_TOKENS), BLOCK_N) * BLOCK_N, lo)\n    start_n = split * split_len\n    end_n = tl.minimum(start_n + split_len, sink_hi + seqlen_k - lo)\n"
    else:
        pass
        yield '    start_n = lo + split * split_len\n    end_n = tl.minimum(start_n + split_len, seqlen_k)\n'
    yield '    k_base = K + off_hkv * stride_kh\n    v_base = V + off_hkv * stride_vh\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'init_state'), 'BLOCK_ROWS'))
    yield '\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield str(t_2(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'window_live_bounds')), '\n'))
        yield '\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield str(t_2(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'chunk_bounds')), '\n'))
        yield '\n'
    if (((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged') and ((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size) < (undefined(name='block_n') if l_0_block_n is missing else l_0_block_n))):
        pass
        yield "    # Note: the block-table entries of the keys this split reads are checked once, ahead of\n    # the loop: 4 B a page against the page's K and V the loop reads. Per key in the loop,\n    # the flags cost up to 49% of a step at B 64, L 4096; the scan 2-6% (the loop's masks\n    # included; tools/exp_page_check.py). The loop still masks loads outside the cache.\n"
        if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
            pass
            yield "    # Keys a row sees: the sink tokens' and the window's. The run's sink blocks are keys\n    # [start_n, min(end_n, sink_hi)), its window blocks [win_first, win_end) (shifted).\n    sink_end = tl.minimum(_SINK_TOKENS, live_last + 1)\n    win_first = tl.maximum(start_n, sink_hi) - sink_hi + lo\n    win_end = end_n - sink_hi + lo\n    scan_end = tl.minimum(tl.minimum(end_n, sink_hi), sink_end)\n    fits = fits & _pages_ok(BlockTable, off_b, stride_btb, stride_btp, start_n, scan_end,\n                            start_n < scan_end, num_pages)\n    scan_end = tl.minimum(win_end, sink_end)\n    fits = fits & _pages_ok(BlockTable, off_b, stride_btb, stride_btp, win_first, scan_end,\n                            win_first < scan_end, num_pages)\n    scan_first = tl.maximum(win_first, live_first)\n    scan_end = tl.minimum(win_end, live_last + 1)\n"
        elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
            pass
            yield '    scan_first = tl.maximum(start_n, live_first)\n    scan_end = tl.minimum(end_n, live_last + 1)\n'
        elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
            pass
            yield '    scan_first, scan_end = tl.maximum(start_n, live_first), end_n\n'
        else:
            pass
            yield '    scan_first, scan_end = start_n, end_n\n'
        yield '    fits = fits & _pages_ok(BlockTable, off_b, stride_btb, stride_btp, scan_first, scan_end,\n                            scan_first < scan_end, num_pages)\n'
    yield "    # A split past the sequence's end runs no iteration and leaves m_i = -inf, l_i = 0.\n    for start in tl.range(start_n, end_n, BLOCK_N):\n"
    if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
        pass
        yield '        start = tl.where(start < sink_hi, start, start - sink_hi + lo)\n'
    yield "        start = tl.multiple_of(start, BLOCK_N)\n        key_pos = start + offs_n\n        # Note: keys no row may see (past the length, outside the window) are zeroed on load,\n        # not only masked in the scores: a NaN stored there (unused cache slots, other\n        # sequences' pages) would survive 0 * NaN in P @ V.\n"
    yield str(t_2(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'key_live'), pad='        '), '\n'))
    yield '\n        key_rows = key_pos.to(tl.int64)\n'
    if (((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged') and ((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size) >= (undefined(name='block_n') if l_0_block_n is missing else l_0_block_n))):
        pass
        yield '        # A tile never straddles pages (PAGE_SIZE is a multiple of BLOCK_N and tiles start\n        # at multiples of BLOCK_N), so one block-table entry serves it.\n        page = tl.load(BlockTable + off_b * stride_btb + (start // _PAGE_SIZE) * stride_btp)\n        in_cache = (page >= 0) & (page < num_pages)\n        slots = key_rows % _PAGE_SIZE\n        k_rows = page.to(tl.int64) * stride_k0 + slots * stride_kn\n        v_rows = page.to(tl.int64) * stride_v0 + slots * stride_vn\n'
    else:
        pass
        yield '        k_rows, in_cache = _cache_rows(BlockTable, off_b, stride_btb, stride_btp, key_rows,\n                                       key_live, num_pages, stride_k0, stride_kn)\n        v_rows, _ = _cache_rows(BlockTable, off_b, stride_btb, stride_btp, key_rows, key_live,\n                                num_pages, stride_v0, stride_vn)\n'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield "        # Note: a page that is not the cache's is not read, and if a live key needs it the\n        # sequence gets NaN.\n"
        if ((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size) >= (undefined(name='block_n') if l_0_block_n is missing else l_0_block_n)):
            pass
            yield '        # Every tile of the loop holds a key some row sees, so its page is needed: a NaN in\n        # the running sums l_i stays NaN through the merge, with no flag carried.\n        page_nan = tl.where(in_cache, 0.0, float("nan"))\n'
        yield '        key_live = key_live & in_cache\n'
    if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
        pass
        yield str(context.call(environment.getattr((undefined(name='latent') if l_0_latent is missing else l_0_latent), 'load_kv')))
        yield '\n'
    else:
        pass
        yield '        k = tl.load(k_base + k_rows[None, :] + offs_d[:, None] * stride_kd,\n                    mask=key_live[None, :]'
        yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_d'), ':, None'))
        yield ', other=0.0)\n        v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd,\n                    mask=key_live[:, None]'
        yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_dv'), 'None, :'))
        yield ', other=0.0)\n'
        yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'score_tile')))
        yield '\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'online_update'), (' + page_nan' if (((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged') and ((undefined(name='page_size') if l_0_page_size is missing else l_0_page_size) >= (undefined(name='block_n') if l_0_block_n is missing else l_0_block_n))) else '')))
    yield '\n    # -- epilogue -----------------------------------------------------------------------\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield '    if DIRECT:  # with several splits, the combine adds the sink: one term per row\n'
        yield str(t_1(t_2(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'fold_sink'), sink='tl.load(Sinks + offs_h, mask=row_ok, other=0.0)'), '\n'), 4, first=True))
        yield '\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'normalise')))
    yield '\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'row_lse'), 'lse2', log2=True))
    yield '\n    # A request that does not fit gets NaN (as does one that needs a page that is not the\n    # cache\'s, through l_i or the scan); the combine keeps it: NaN weights give NaN.\n    out = tl.where(fits, out, float("nan"))\n    lse2 = tl.where(fits, lse2, float("nan"))\n    if ROTARY_HALF:  # and so does a query whose rotary position is past cos/sin\'s rows\n        out = tl.where(rotary_ok[:, None], out, float("nan"))\n        lse2 = tl.where(rotary_ok, lse2, float("nan"))\n    o_mask = row_ok[:, None]'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_dv'), 'None, :'))
    yield '\n    if DIRECT:\n        o_ptrs = (Out + off_b * stride_ob + offs_h[:, None] * stride_oh\n                  + offs_t.to(tl.int64)[:, None] * stride_ot + offs_dv[None, :] * stride_od)\n        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)\n        if STORE_LSE:\n            lse_rows = (off_b * num_kv_heads * q_per_kv + offs_h) * num_q_tokens + offs_t\n            tl.store(Lse + lse_rows, lse2 / _LOG2E_C, mask=row_ok)\n    else:\n        # Partials [B, HQ, NQ, splits, DV] and [B, HQ, NQ, splits], fp32, log2-domain LSE.\n        rows = (off_b * num_kv_heads * q_per_kv + offs_h) * num_q_tokens + offs_t\n        part = rows * num_splits + split\n        tl.store(PartOut + part[:, None] * _BLOCK_DV + offs_dv[None, :], out, mask=o_mask)\n        tl.store(PartLse + part, lse2, mask=row_ok)\n\n\n'
    template = environment.get_template('_decode_combine.py.jinja', 'decode.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield '\n\n'
    template = environment.get_template('_decode_launch.py.jinja', 'decode.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    template = environment.get_template('_decode_flash_entry.py.jinja', 'decode.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'latent': l_0_latent, 'score_code': l_0_score_code, 'step': l_0_step}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield '\n\n'
    yield str((undefined(name='host_code') if l_0_host_code is missing else l_0_host_code))
    yield '\n'

blocks = {}
debug_info = '1=44&2=46&3=48&4=50&5=52&6=59&8=61&11=63&14=69&15=75&16=82&17=90&18=93&20=95&24=98&25=101&26=105&40=111&43=114&49=119&50=121&51=123&52=125&53=127&55=130&57=132&58=134&59=136&63=139&64=141&65=143&66=145&71=147&77=151&82=158&90=162&97=166&118=170&129=174&132=177&135=180&136=182&141=187&146=189&152=193&153=196&155=198&160=204&173=211&174=213&175=215&176=217&177=219&179=221&184=224&198=227&201=230&211=238&219=242&221=244&235=250&238=253&245=257&246=259&249=264&251=266&252=268&254=270&256=272&258=275&260=277&261=279&269=281&285=283&288=290&289=296&292=303'