from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_checks.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_decode_validation = missing
    pass
    def macro():
        t_1 = []
        l_1_kv_layout = resolve('kv_layout')
        l_1_mask = resolve('mask')
        l_1_sink_tokens = resolve('sink_tokens')
        pass
        t_1.append(
            'def _validate_indices(cache_seqlens, block_table, num_new, num_q_tokens, capacity, num_pages):\n    """ATTNGEN_CHECKS=1: every sequence\'s keys fit its memory (a device sync)."""\n    lengths = cache_seqlens.tolist()\n    for b, cached in enumerate(lengths):\n        if not 0 <= cached <= capacity - num_new:\n            raise ValueError(f"cache_seqlens[{b}] = {cached}: expected 0..{capacity - num_new} "\n                             f"(the capacity {capacity} less {num_new} new keys)")\n',
        )
        if ((undefined(name='kv_layout') if l_1_kv_layout is missing else l_1_kv_layout) == 'paged'):
            pass
            t_1.append(
                '    table = block_table.tolist()\n    for b, cached in enumerate(lengths):\n        total = cached + num_new\n',
            )
            if ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'sliding_window'):
                pass
                t_1.append(
                    "        # Keys left of every query's window are never read: their pages are not checked.\n        first = min(max(total - num_q_tokens - WINDOW[0], 0), cached)\n",
                )
            elif ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'chunked'):
                pass
                t_1.append(
                    "        # Keys before the first query's chunk are never read: their pages are not checked.\n        first = min(max(total - num_q_tokens, 0) // CHUNK_SIZE * CHUNK_SIZE, cached)\n",
                )
            else:
                pass
                t_1.append(
                    '        first = 0\n',
                )
            if (undefined(name='sink_tokens') if l_1_sink_tokens is missing else l_1_sink_tokens):
                pass
                t_1.append(
                    "        # but the sink tokens' keys left of the window are\n        sink_pages = range(-(-min(SINK_TOKENS, first) // PAGE_SIZE))\n        for page in [*sink_pages, *range(first // PAGE_SIZE, -(-total // PAGE_SIZE))]:\n",
                )
            else:
                pass
                t_1.append(
                    '        for page in range(first // PAGE_SIZE, -(-total // PAGE_SIZE)):\n',
                )
            t_1.append(
                '            if not 0 <= table[b][page] < num_pages:\n                raise ValueError(f"block_table[{b}, {page}] = {table[b][page]}: expected a page "\n                                 f"in 0..{num_pages - 1} (sequence {b} reads or appends there)")\n',
            )
        return concat(t_1)
    context.exported_vars.add('decode_validation')
    context.vars['decode_validation'] = l_0_decode_validation = Macro(environment, macro, 'decode_validation', (), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '7=12&15=21&19=26&22=31&28=41'