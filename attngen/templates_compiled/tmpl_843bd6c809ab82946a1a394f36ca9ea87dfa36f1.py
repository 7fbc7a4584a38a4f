from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_cache.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_kv_layout = resolve('kv_layout')
    l_0_mask = resolve('mask')
    l_0_sink_tokens = resolve('sink_tokens')
    l_0_step = missing
    pass
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', '_cache.py.jinja').make_module(context.get_all(), True, {'step': l_0_step})
    context.exported_vars.discard('step')
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '@triton.jit\ndef _cache_rows(BlockTable, off_b, stride_btb, stride_btp, pos, live, num_pages, stride_c0,\n                stride_cn):\n    """(offsets, in_cache) of key rows `pos` (int64) of sequence off_b: page * stride + slot *\n    stride, and whether the page is one of the cache\'s [0, num_pages). Only `live` entries of\n    the block table are read."""\n    page = tl.load(BlockTable + off_b * stride_btb + (pos // _PAGE_SIZE) * stride_btp,\n                   mask=live, other=0)\n    in_cache = (page >= 0) & (page < num_pages)\n    return page.to(tl.int64) * stride_c0 + (pos % _PAGE_SIZE) * stride_cn, in_cache\n\n\n@triton.jit\ndef _pages_ok(BlockTable, off_b, stride_btb, stride_btp, first_key, end_key, fits, num_pages):\n    """Whether the block-table entries of the pages holding keys [first_key, end_key) of\n    sequence off_b are all pages of the cache, [0, num_pages); read only when `fits` (then the\n    keys lie inside the table\'s row)."""\n    first_page = first_key // _PAGE_SIZE\n    end_page = tl.where(fits, tl.cdiv(end_key, _PAGE_SIZE), first_page)\n    missing = tl.zeros([_PAGE_CHUNK], dtype=tl.int32)\n    for start in tl.range(first_page, end_page, _PAGE_CHUNK):\n        offs_p = start + tl.arange(0, _PAGE_CHUNK)\n        live = offs_p < end_page\n        page = tl.load(BlockTable + off_b * stride_btb + offs_p * stride_btp, mask=live, other=0)\n        missing = tl.maximum(missing, (live & ((page < 0) | (page >= num_pages))).to(tl.int32))\n    return tl.max(missing, 0) == 0\n'
    else:
        pass
        yield '@triton.jit\ndef _cache_rows(BlockTable, off_b, stride_btb, stride_btp, pos, live, num_pages, stride_c0,\n                stride_cn):\n    """(offsets, in_cache) of key rows `pos` (int64) of sequence off_b: batch * stride + pos *\n    stride; every live row (one below the capacity) is in the cache."""\n    return off_b * stride_c0 + pos * stride_cn, live\n'
    yield '\n\n@triton.jit\ndef _request_fits(SeqLens, BlockTable, off_b, stride_btb, stride_btp, num_new, num_q_tokens,\n                  max_cached, num_pages, CHECK_READS: tl.constexpr):\n    """(keys cached, whether sequence off_b\'s request fits its memory): 0 <= cache_seqlens[b]\n    <= capacity - num_new'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield ', and every block-table entry of a page that the step appends to\n    (and with CHECK_READS, that it reads) is a page of the cache'
    yield '."""\n    cached = tl.load(SeqLens + off_b)\n    fits = (cached >= 0) & (cached <= max_cached)\n'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '    total = cached + num_new\n    first_key = cached\n    if CHECK_READS:\n'
        if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
            pass
            yield "        # keys left of every query's window are never read (in int64: the side may be 2**31 - 1)\n        first_read = tl.maximum(total.to(tl.int64) - num_q_tokens - _WINDOW_LEFT, 0)\n        first_key = tl.minimum(first_read, cached).to(tl.int32)\n"
            if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
                pass
                yield "        # but the sink tokens' keys left of it are\n        fits = fits & _pages_ok(BlockTable, off_b, stride_btb, stride_btp, 0,\n                                tl.minimum(first_key, _SINK_TOKENS), fits, num_pages)\n"
        elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
            pass
            yield "        # keys before the first query's chunk are never read\n        first_read = (tl.maximum(total - num_q_tokens, 0) // _CHUNK_SIZE) * _CHUNK_SIZE\n        first_key = tl.minimum(first_read, cached)\n"
        else:
            pass
            yield '        first_key = 0\n'
        yield '    fits = fits & _pages_ok(BlockTable, off_b, stride_btb, stride_btp, first_key, total, fits,\n                            num_pages)\n'
    yield '    return cached, fits\n\n\n@triton.jit\ndef _append_kernel(\n    KNew, VNew, K, V, SeqLens, BlockTable, Cos, Sin,\n    stride_knb, stride_knh, stride_knn, stride_knd,\n    stride_vnb, stride_vnh, stride_vnn, stride_vnd,\n    stride_k0, stride_kh, stride_kn, stride_kd,\n    stride_v0, stride_vh, stride_vn, stride_vd,\n    stride_btb, stride_btp,\n    num_kv_heads, num_new, num_row_blocks, num_q_tokens, max_cached, num_pages,\n    stride_cos_r, stride_cos_c, stride_sin_r, stride_sin_c,\n    ROWS: tl.constexpr,\n    ROTARY_HALF: tl.constexpr,\n    ROTARY_INTERLEAVED: tl.constexpr,\n):\n    # -- which rows: new tokens [ROWS * block, + ROWS) of one (sequence, KV head) -----------\n    pid = tl.program_id(0)\n    row_block = pid % num_row_blocks\n    off_bh = pid // num_row_blocks\n    off_b = (off_bh // num_kv_heads).to(tl.int64)\n    off_h = (off_bh % num_kv_heads).to(tl.int64)\n    offs_t = row_block * ROWS + tl.arange(0, ROWS)\n    offs_d = tl.arange(0, _BLOCK_D)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n    # A sequence whose request does not fit writes nothing (its decode output is NaN).\n'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield "    # Note: nothing may be written for a sequence that will get NaN, so the append checks\n    # every page the step will read, ahead of the reads (the decode kernel checks each page\n    # as it reads it): a scan of the block-table row, 4 B per page per KV head, against the\n    # page's K and V that the decode kernel reads (16 keys x 512 B at D = 128, 16-bit).\n"
    yield '    cached, fits = _request_fits(SeqLens, BlockTable, off_b, stride_btb, stride_btp, num_new,\n                                 num_q_tokens, max_cached, num_pages, CHECK_READS=True)\n    live = (offs_t < num_new) & fits\n    pos = cached.to(tl.int64) + offs_t\n    t_rows = offs_t.to(tl.int64)\n    # -- copy K and V rows into the cache at positions cache_seqlens[b] + t -----------------\n    k_rows, _ = _cache_rows(BlockTable, off_b, stride_btb, stride_btp, pos, live, num_pages,\n                            stride_k0, stride_kn)\n    k_src = KNew + off_b * stride_knb + off_h * stride_knh + t_rows[:, None] * stride_knn\n    k_mask = live[:, None]'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_d'), 'None, :'))
    yield "\n    k = tl.load(k_src + offs_d[None, :] * stride_knd, mask=k_mask)\n    # Rotary: live rows lie below the capacity, which cos/sin's rows cover (checked on the host).\n    if ROTARY_HALF:\n        k = _rotate(k, k_src + offs_d[None, :] * stride_knd, stride_knd, pos, live, Cos, Sin,\n                    stride_cos_r, stride_cos_c, stride_sin_r, stride_sin_c, ROTARY_HALF,\n                    ROTARY_INTERLEAVED)\n    k_dst = K + off_h * stride_kh + k_rows[:, None] + offs_d[None, :] * stride_kd\n    tl.store(k_dst, k, mask=k_mask)\n    v_rows, _ = _cache_rows(BlockTable, off_b, stride_btb, stride_btp, pos, live, num_pages,\n                            stride_v0, stride_vn)\n    v_src = VNew + off_b * stride_vnb + off_h * stride_vnh + t_rows[:, None] * stride_vnn\n    v_mask = live[:, None]"
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_dv'), 'None, :'))
    yield '\n    v = tl.load(v_src + offs_dv[None, :] * stride_vnd, mask=v_mask)\n    v_dst = V + off_h * stride_vh + v_rows[:, None] + offs_dv[None, :] * stride_vd\n    tl.store(v_dst, v, mask=v_mask)\n\n\n'
    template = environment.get_template('_rotary.py.jinja', '_cache.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'step': l_0_step}))
    try:
        for event in gen:
            yield event
    finally: gen.close()

blocks = {}
debug_info = '4=15&5=17&46=24&50=28&54=31&58=34&63=37&100=45&115=49&127=51&133=53'