from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_scores.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_scores = l_0_row_max = l_0_exponent = l_0_visible = l_0_key_live = l_0_window_live_bounds = l_0_chunk_bounds = l_0_window_lo = l_0_key_ranges = missing
    pass
    def macro():
        t_1 = []
        l_1_dtype = resolve('dtype')
        l_1_softcap = resolve('softcap')
        l_1_alibi = resolve('alibi')
        pass
        if ((undefined(name='dtype') if l_1_dtype is missing else l_1_dtype) == 'fp32'):
            pass
            t_1.append(
                "        # Note: fp32 modules launch with enable_fp_fusion=False. Contracted into an FMA, the\n        # exponent qk x scale - m of the row's largest score is m's own rounding error (up\n        # to half its ulp), and exp2 overflows once scaled scores pass 2**31, which fp32\n        # inputs reach (1e10); unfused it is round(qk x scale) - m, the scale applied first.\n        # (Scaling first in the source does not stop NVPTX from fusing.) 16-bit modules keep\n        # the fused fast path: scores that large need q and k entries beyond 1e4.\n",
            )
        if (undefined(name='softcap') if l_1_softcap is missing else l_1_softcap):
            pass
            t_1.append(
                '        # Note: softcap is applied in the natural-log domain, then moved to log2 for exp2.\n        scores = _tanh(qk * qk_scale) * _SOFTCAP_LOG2\n',
            )
        elif (undefined(name='alibi') if l_1_alibi is missing else l_1_alibi):
            pass
            t_1.append(
                '        scores = qk * qk_scale\n',
            )
        else:
            pass
            t_1.append(
                '        # Note: plain scores stay unscaled; the scale is applied in the row max and in the\n        # exponent\'s FMA (sm_scale > 0, so max(s x qk) = s x max(qk)): one multiply per\n        # score fewer, 3-6% faster at D = 64 on the H200 (tools/exp_prefill.py, then "fma").\n        scores = qk\n',
            )
        if (undefined(name='alibi') if l_1_alibi is missing else l_1_alibi):
            pass
            t_1.append(
                '        distance = tl.abs(q_pos[:, None] - key_pos[None, :]).to(tl.float32)\n        scores = scores - slope_log2 * distance\n',
            )
        return concat(t_1)
    context.exported_vars.add('scores')
    context.vars['scores'] = l_0_scores = Macro(environment, macro, 'scores', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_2 = []
        l_1_softcap = resolve('softcap')
        l_1_alibi = resolve('alibi')
        pass
        if ((undefined(name='softcap') if l_1_softcap is missing else l_1_softcap) or (undefined(name='alibi') if l_1_alibi is missing else l_1_alibi)):
            pass
            t_2.append(
                'tl.max(scores, 1)',
            )
        else:
            pass
            t_2.append(
                'tl.max(scores, 1) * qk_scale',
            )
        return concat(t_2)
    context.exported_vars.add('row_max')
    context.vars['row_max'] = l_0_row_max = Macro(environment, macro, 'row_max', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_ref):
        t_3 = []
        l_1_softcap = resolve('softcap')
        l_1_alibi = resolve('alibi')
        if l_1_ref is missing:
            l_1_ref = 'm_ref[:, None]'
        pass
        if ((undefined(name='softcap') if l_1_softcap is missing else l_1_softcap) or (undefined(name='alibi') if l_1_alibi is missing else l_1_alibi)):
            pass
            t_3.extend((
                'scores - ',
                str(l_1_ref),
            ))
        else:
            pass
            t_3.extend((
                'scores * qk_scale - ',
                str(l_1_ref),
            ))
        return concat(t_3)
    context.exported_vars.add('exponent')
    context.vars['exponent'] = l_0_exponent = Macro(environment, macro, 'exponent', ('ref',), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_pad):
        t_4 = []
        l_1_mask = resolve('mask')
        l_1_sink_tokens = resolve('sink_tokens')
        if l_1_pad is missing:
            l_1_pad = '            '
        pass
        if ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'none'):
            pass
            t_4.extend((
                str(l_1_pad),
                'visible = (key_pos < seqlen_k)[None, :]\n',
            ))
        elif ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'causal'):
            pass
            t_4.extend((
                str(l_1_pad),
                'visible = key_pos[None, :] <= q_pos[:, None]\n',
                str(l_1_pad),
                'visible = visible & (key_pos < seqlen_k)[None, :]\n',
            ))
        elif ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'chunked'):
            pass
            t_4.extend((
                str(l_1_pad),
                "# causal inside the row's chunk: q_chunk_first <= j <= i' (chunk_bounds)\n",
                str(l_1_pad),
                'visible = key_pos[None, :] >= q_chunk_first[:, None]\n',
                str(l_1_pad),
                'visible = visible & (key_pos[None, :] <= q_pos[:, None]) & (key_pos < seqlen_k)[None, :]\n',
            ))
        else:
            pass
            t_4.extend((
                str(l_1_pad),
                "# i' - j (bounded by the lengths) against the sides; i' -/+ a side may overflow.\n",
                str(l_1_pad),
                'offset = q_pos[:, None] - key_pos[None, :]\n',
                str(l_1_pad),
                'visible = (\n',
            ))
            if (undefined(name='sink_tokens') if l_1_sink_tokens is missing else l_1_sink_tokens):
                pass
                t_4.extend((
                    str(l_1_pad),
                    "    # the first _SINK_TOKENS keys ignore the window's left side\n",
                    str(l_1_pad),
                    '    ((offset <= _WINDOW_LEFT) | (key_pos < _SINK_TOKENS)[None, :])\n',
                ))
            else:
                pass
                t_4.extend((
                    str(l_1_pad),
                    '    (offset <= _WINDOW_LEFT)\n',
                ))
            t_4.extend((
                str(l_1_pad),
                '    & (offset >= -_WINDOW_RIGHT)\n',
                str(l_1_pad),
                '    & (key_pos < seqlen_k)[None, :]\n',
                str(l_1_pad),
                ')\n',
            ))
        return concat(t_4)
    context.exported_vars.add('visible')
    context.vars['visible'] = l_0_visible = Macro(environment, macro, 'visible', ('pad',), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_pad):
        t_5 = []
        l_1_mask = resolve('mask')
        l_1_sink_tokens = resolve('sink_tokens')
        if l_1_pad is missing:
            l_1_pad = '            '
        pass
        if ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'none'):
            pass
            t_5.extend((
                str(l_1_pad),
                'key_live = key_pos < seqlen_k\n',
            ))
        elif ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'causal'):
            pass
            t_5.extend((
                str(l_1_pad),
                'key_live = (key_pos <= last_q_pos) & (key_pos < seqlen_k)\n',
            ))
        elif ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'chunked'):
            pass
            t_5.extend((
                str(l_1_pad),
                'key_live = (key_pos >= live_first) & (key_pos <= last_q_pos) & (key_pos < seqlen_k)\n',
            ))
        elif (undefined(name='sink_tokens') if l_1_sink_tokens is missing else l_1_sink_tokens):
            pass
            t_5.extend((
                str(l_1_pad),
                'key_live = ((key_pos >= live_first) | (key_pos < _SINK_TOKENS)) & (key_pos <= live_last)\n',
            ))
        else:
            pass
            t_5.extend((
                str(l_1_pad),
                'key_live = (key_pos >= live_first) & (key_pos <= live_last)\n',
            ))
        return concat(t_5)
    context.exported_vars.add('key_live')
    context.vars['key_live'] = l_0_key_live = Macro(environment, macro, 'key_live', ('pad',), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_pad):
        t_6 = []
        if l_1_pad is missing:
            l_1_pad = '    '
        pass
        t_6.extend((
            str(l_1_pad),
            '# The first and last key a query of the tile sees, in int64 (a side may be 2**31 - 1)\n',
            str(l_1_pad),
            "# and clamped to the keys, so int32 again: two scalars per loop, no i' -/+ side per key.\n",
            str(l_1_pad),
            'live_first = tl.maximum(first_q_pos.to(tl.int64) - _WINDOW_LEFT, 0).to(tl.int32)\n',
            str(l_1_pad),
            'live_last = tl.minimum(last_q_pos.to(tl.int64) + _WINDOW_RIGHT, seqlen_k - 1).to(tl.int32)',
        ))
        return concat(t_6)
    context.exported_vars.add('window_live_bounds')
    context.vars['window_live_bounds'] = l_0_window_live_bounds = Macro(environment, macro, 'window_live_bounds', ('pad',), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_pad):
        t_7 = []
        if l_1_pad is missing:
            l_1_pad = '    '
        pass
        t_7.extend((
            str(l_1_pad),
            '# Chunks start at multiples of the chunk size in aligned positions: one division per\n',
            str(l_1_pad),
            '# row, none per key.\n',
            str(l_1_pad),
            'q_chunk_first = (tl.maximum(q_pos, 0) // _CHUNK_SIZE) * _CHUNK_SIZE\n',
            str(l_1_pad),
            'live_first = (tl.maximum(first_q_pos, 0) // _CHUNK_SIZE) * _CHUNK_SIZE',
        ))
        return concat(t_7)
    context.exported_vars.add('chunk_bounds')
    context.vars['chunk_bounds'] = l_0_chunk_bounds = Macro(environment, macro, 'chunk_bounds', ('pad',), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_8 = []
        pass
        t_8.append(
            '(tl.maximum(first_q_pos.to(tl.int64) - _WINDOW_LEFT, 0) // BLOCK_N) * BLOCK_N',
        )
        return concat(t_8)
    context.exported_vars.add('window_lo')
    context.vars['window_lo'] = l_0_window_lo = Macro(environment, macro, 'window_lo', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_9 = []
        l_1_mask = resolve('mask')
        l_1_sink_tokens = resolve('sink_tokens')
        pass
        if ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'none'):
            pass
            t_9.append(
                '    full_lo = 0\n    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N\n    hi = seqlen_k\n',
            )
        elif ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'causal'):
            pass
            t_9.append(
                '    full_lo = 0\n    hi = tl.minimum(tl.maximum(last_q_pos + 1, 0), seqlen_k)\n    full_hi = (tl.minimum(tl.maximum(first_q_pos + 1, 0), seqlen_k) // BLOCK_N) * BLOCK_N\n',
            )
        elif ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'chunked'):
            pass
            t_9.append(
                "    # Note: a tile's rows see keys from the chunk start of its first row to its last row;\n    # every row sees those from the chunk start of its last row to its first row (none when\n    # the tile spans a chunk boundary). Key blocks outside are skipped: each query block\n    # visits at most chunk_size + BLOCK_M keys, O(N x chunk) work in all.\n    lo = (((tl.maximum(first_q_pos, 0) // _CHUNK_SIZE) * _CHUNK_SIZE) // BLOCK_N) * BLOCK_N\n    hi = tl.minimum(tl.maximum(last_q_pos + 1, 0), seqlen_k)\n    last_chunk_first = (tl.maximum(last_q_pos, 0) // _CHUNK_SIZE) * _CHUNK_SIZE\n    full_lo = tl.minimum(tl.maximum(tl.cdiv(last_chunk_first, BLOCK_N) * BLOCK_N, lo), hi)\n    full_hi = (tl.minimum(tl.maximum(first_q_pos + 1, 0), seqlen_k) // BLOCK_N) * BLOCK_N\n    full_hi = tl.maximum(full_hi, full_lo)\n",
            )
        else:
            pass
            t_9.extend((
                '    # Note: a window side may be 2**31 - 1 (flash-attn\'s "infinite", which the spec accepts),\n    # so i\' -/+ a side overflows int32. These few per-program bounds are computed in int64\n    # and clamped to [0, seqlen_k]; per key, the kernels compare the offset i\' - j (bounded\n    # by the lengths, so always an int32) with the sides instead: no int64 in the key loop.\n    lo = ',
                str(context.call((undefined(name='window_lo') if l_0_window_lo is missing else l_0_window_lo))),
                '\n    hi = tl.minimum(tl.maximum(last_q_pos.to(tl.int64) + _WINDOW_RIGHT + 1, 0), seqlen_k)\n    full_lo = tl.cdiv(tl.maximum(last_q_pos.to(tl.int64) - _WINDOW_LEFT, lo), BLOCK_N) * BLOCK_N\n    full_lo = tl.minimum(full_lo, hi)\n    full_hi = tl.minimum(tl.maximum(first_q_pos.to(tl.int64) + _WINDOW_RIGHT + 1, 0), seqlen_k)\n    full_hi = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, full_lo)\n    lo, full_lo = lo.to(tl.int32), full_lo.to(tl.int32)\n    full_hi, hi = full_hi.to(tl.int32), hi.to(tl.int32)\n',
            ))
            if (undefined(name='sink_tokens') if l_1_sink_tokens is missing else l_1_sink_tokens):
                pass
                t_9.append(
                    "    # The sink tokens' blocks left of the window's first block (masked: key_live, visible).\n    sink_hi = tl.minimum(tl.cdiv(tl.minimum(seqlen_k, _SINK_TOKENS), BLOCK_N) * BLOCK_N, lo)\n",
                )
        return concat(t_9)
    context.exported_vars.add('key_ranges')
    context.vars['key_ranges'] = l_0_key_ranges = Macro(environment, macro, 'key_ranges', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'

blocks = {}
debug_info = '5=12&6=18&14=23&17=28&25=38&31=47&32=52&35=66&38=73&41=89&42=96&43=99&44=102&45=105&46=107&47=110&48=113&49=115&50=117&52=123&53=125&54=127&55=130&56=133&57=135&59=141&61=145&62=147&63=149&67=156&68=163&69=166&70=169&71=172&72=175&73=178&74=181&75=184&77=190&81=197&84=203&85=205&86=207&87=209&90=216&94=222&95=224&96=226&97=228&100=235&106=245&110=250&114=255&118=260&134=269&142=272'