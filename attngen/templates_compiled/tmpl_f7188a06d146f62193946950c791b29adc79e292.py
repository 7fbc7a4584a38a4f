from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_checks.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_varlen_validation = l_0_decode_validation = missing
    pass
    def macro():
        t_1 = []
        pass
        t_1.append(
            'def _validate_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k):\n    """ATTNGEN_CHECKS=1: every sequence lies inside the packed tensors (a device sync)."""\n    bounds = {}\n    for name, cu, rows, what in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q"),\n                                 ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")):\n        values = bounds[name] = cu.tolist()\n        for i, value in enumerate(values if len(values) > 1 else []):\n            if not 0 <= value <= rows:\n                raise ValueError(f"{name}[{i}] = {value}: expected 0..{rows}, the rows of {what}")\n            if i and value < values[i - 1]:\n                raise ValueError(f"{name}[{i}] = {value}: expected >= {name}[{i - 1}] = "\n                                 f"{values[i - 1]} (nondecreasing)")\n    cu_q, cu_k = bounds["cu_seqlens_q"], bounds["cu_seqlens_k"]\n    for b in range(len(cu_q) - 1):\n        if cu_q[b + 1] - cu_q[b] > max_seqlen_q:\n            raise ValueError(f"cu_seqlens_q: sequence {b} has {cu_q[b + 1] - cu_q[b]} queries, "\n                             f"more than max_seqlen_q = {max_seqlen_q}")\n    for b, used in enumerate([] if seqused_k is None else seqused_k.tolist()):\n        if not 0 <= used <= cu_k[b + 1] - cu_k[b]:\n            raise ValueError(f"seqused_k[{b}] = {used}: expected 0..{cu_k[b + 1] - cu_k[b]}, "\n                             f"the keys cu_seqlens_k gives sequence {b}")',
        )
        return concat(t_1)
    context.exported_vars.add('varlen_validation')
    context.vars['varlen_validation'] = l_0_varlen_validation = Macro(environment, macro, 'varlen_validation', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_2 = []
        l_1_kv_layout = resolve('kv_layout')
        l_1_mask = resolve('mask')
        l_1_sink_tokens = resolve('sink_tokens')
        pass
        t_2.append(
            'def _validate_indices(cache_seqlens, block_table, num_new, num_q_tokens, capacity, num_pages):\n    """ATTNGEN_CHECKS=1: every sequence\'s keys fit its memory (a device sync)."""\n    lengths = cache_seqlens.tolist()\n    for b, cached in enumerate(lengths):\n        if not 0 <= cached <= capacity - num_new:\n            raise ValueError(f"cache_seqlens[{b}] = {cached}: expected 0..{capacity - num_new} "\n                             f"(the capacity {capacity} less {num_new} new keys)")\n',
        )
        if ((undefined(name='kv_layout') if l_1_kv_layout is missing else l_1_kv_layout) == 'paged'):
            pass
            t_2.append(
                '    table = block_table.tolist()\n    for b, cached in enumerate(lengths):\n        total = cached + num_new\n',
            )
            if ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'sliding_window'):
                pass
                t_2.append(
                    "        # Keys left of every query's window are never read: their pages are not checked.\n        first = min(max(total - num_q_tokens - WINDOW[0], 0), cached)\n",
                )
            elif ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'chunked'):
                pass
                t_2.append(
                    "        # Keys before the first query's chunk are never read: their pages are not checked.\n        first = min(max(total - num_q_tokens, 0) // CHUNK_SIZE * CHUNK_SIZE, cached)\n",
                )
            else:
                pass
                t_2.append(
                    '        first = 0\n',
                )
            if (undefined(name='sink_tokens') if l_1_sink_tokens is missing else l_1_sink_tokens):
                pass
                t_2.append(
                    "        # but the sink tokens' keys left of the window are\n        sink_pages = range(-(-min(SINK_TOKENS, first) // PAGE_SIZE))\n        for page in [*sink_pages, *range(first // PAGE_SIZE, -(-total // PAGE_SIZE))]:\n",
                )
            else:
                pass
                t_2.append(
                    '        for page in range(first // PAGE_SIZE, -(-total // PAGE_SIZE)):\n',
                )
            t_2.append(
                '            if not 0 <= table[b][page] < num_pages:\n                raise ValueError(f"block_table[{b}, {page}] = {table[b][page]}: expected a page "\n                                 f"in 0..{num_pages - 1} (sequence {b} reads or appends there)")\n',
            )
        return concat(t_2)
    context.exported_vars.add('decode_validation')
    context.vars['decode_validation'] = l_0_decode_validation = Macro(environment, macro, 'decode_validation', (), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '7=12&31=22&39=31&43=36&46=41&52=51'