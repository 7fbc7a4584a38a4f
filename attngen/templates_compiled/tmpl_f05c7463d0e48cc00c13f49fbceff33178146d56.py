from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_step.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_score_code = l_0_pad_d = l_0_pad_dv = l_0_dot_precision = l_0_kernel_scale = l_0_init_state = l_0_score_tile = l_0_online_update = l_0_fold_sink = l_0_normalise = l_0_row_lse = l_0_tma_load_kv = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_score_code = context.vars['score_code'] = environment.get_template('_scores.py.jinja', '_step.py.jinja').make_module(context.get_all(), True, {'dot_precision': l_0_dot_precision, 'fold_sink': l_0_fold_sink, 'init_state': l_0_init_state, 'kernel_scale': l_0_kernel_scale, 'normalise': l_0_normalise, 'online_update': l_0_online_update, 'pad_d': l_0_pad_d, 'pad_dv': l_0_pad_dv, 'row_lse': l_0_row_lse, 'score_code': l_0_score_code, 'score_tile': l_0_score_tile, 'tma_load_kv': l_0_tma_load_kv})
    context.exported_vars.discard('score_code')
    def macro(l_1_axes):
        t_2 = []
        l_1_block_d = resolve('block_d')
        l_1_head_dim = resolve('head_dim')
        if l_1_axes is missing:
            l_1_axes = undefined("parameter 'axes' was not provided", name='axes')
        pass
        if ((undefined(name='block_d') if l_1_block_d is missing else l_1_block_d) != (undefined(name='head_dim') if l_1_head_dim is missing else l_1_head_dim)):
            pass
            t_2.extend((
                ' & (offs_d < _HEAD_DIM)[',
                str(l_1_axes),
                ']',
            ))
        return concat(t_2)
    context.exported_vars.add('pad_d')
    context.vars['pad_d'] = l_0_pad_d = Macro(environment, macro, 'pad_d', ('axes',), False, False, False, context.eval_ctx.autoescape)
    def macro(l_1_axes):
        t_3 = []
        l_1_block_dv = resolve('block_dv')
        l_1_head_dim_v = resolve('head_dim_v')
        if l_1_axes is missing:
            l_1_axes = undefined("parameter 'axes' was not provided", name='axes')
        pass
        if ((undefined(name='block_dv') if l_1_block_dv is missing else l_1_block_dv) != (undefined(name='head_dim_v') if l_1_head_dim_v is missing else l_1_head_dim_v)):
            pass
            t_3.extend((
                ' & (offs_dv < _HEAD_DIM_V)[',
                str(l_1_axes),
                ']',
            ))
        return concat(t_3)
    context.exported_vars.add('pad_dv')
    context.vars['pad_dv'] = l_0_pad_dv = Macro(environment, macro, 'pad_dv', ('axes',), False, False, False, context.eval_ctx.autoescape)
    def macro():
        t_4 = []
        l_1_dtype = resolve('dtype')
        pass
        if ((undefined(name='dtype') if l_1_dtype is missing else l_1_dtype) == 'fp32'):
            pass
            t_4.append(
                ', input_precision="ieee"',
            )
        return concat(t_4)
    context.exported_vars.add('dot_precision')
    context.vars['dot_precision'] = l_0_dot_precision = Macro(environment, macro, 'dot_precision', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_5 = []
        l_1_softcap = resolve('softcap')
        pass
        if (undefined(name='softcap') if l_1_softcap is missing else l_1_softcap):
            pass
            t_5.append(
                'sm_scale / SOFTCAP',
            )
        else:
            pass
            t_5.append(
                'sm_scale * _LOG2E',
            )
        return concat(t_5)
    context.exported_vars.add('kernel_scale')
    context.vars['kernel_scale'] = l_0_kernel_scale = Macro(environment, macro, 'kernel_scale', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_rows):
        t_6 = []
        if l_1_rows is missing:
            l_1_rows = undefined("parameter 'rows' was not provided", name='rows')
        pass
        t_6.extend((
            '    m_i = tl.full([',
            str(l_1_rows),
            '], float("-inf"), dtype=tl.float32)\n    l_i = tl.zeros([',
            str(l_1_rows),
            '], dtype=tl.float32)\n    acc = tl.zeros([',
            str(l_1_rows),
            ', _BLOCK_DV], dtype=tl.float32)',
        ))
        return concat(t_6)
    context.exported_vars.add('init_state')
    context.vars['init_state'] = l_0_init_state = Macro(environment, macro, 'init_state', ('rows',), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_mask_if, l_1_qk):
        t_7 = []
        if l_1_mask_if is missing:
            l_1_mask_if = ''
        if l_1_qk is missing:
            l_1_qk = ''
        pass
        t_7.append(
            '        # -- scores in the log2 domain (plain ones scaled in the exponent) ----------\n',
        )
        if (l_1_qk == 'latent_rope'):
            pass
            t_7.extend((
                '        qk = tl.dot(q_rope, k_rope',
                str(context.call((undefined(name='dot_precision') if l_0_dot_precision is missing else l_0_dot_precision))),
                ')\n        qk = tl.dot(q_lat, tl.trans(k_lat), qk',
                str(context.call((undefined(name='dot_precision') if l_0_dot_precision is missing else l_0_dot_precision))),
                ')\n',
            ))
        else:
            pass
            t_7.extend((
                '        qk = tl.dot(q, k',
                str(context.call((undefined(name='dot_precision') if l_0_dot_precision is missing else l_0_dot_precision))),
                ')\n',
            ))
        t_7.extend((
            str(t_1(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'scores')), '\n')),
            '\n',
        ))
        if l_1_mask_if:
            pass
            t_7.extend((
                '        if ',
                str(l_1_mask_if),
                ':\n',
                str(t_1(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'visible')), '\n')),
                '\n            scores = tl.where(visible, scores, float("-inf"))',
            ))
        else:
            pass
            t_7.extend((
                str(t_1(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'visible'), pad='        '), '\n')),
                '\n        scores = tl.where(visible, scores, float("-inf"))',
            ))
        return concat(t_7)
    context.exported_vars.add('score_tile')
    context.vars['score_tile'] = l_0_score_tile = Macro(environment, macro, 'score_tile', ('mask_if', 'qk'), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_l_term):
        t_8 = []
        l_1_dropout = resolve('dropout')
        l_1_dtype_name = resolve('dtype_name')
        if l_1_l_term is missing:
            l_1_l_term = ''
        pass
        t_8.extend((
            '        # -- online softmax -------------------------------------------------------------\n        m_new = tl.maximum(m_i, ',
            str(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'row_max'))),
            ')\n        # Note: a row with no finite score so far has m_new == -inf; subtracting 0 instead\n        # keeps p = exp2(-inf) = 0 and alpha = 0 rather than NaN (-inf + inf). Unmasked\n        # blocks need it too: a key block can be all -inf for a row (a -inf in k, an ALiBi\n        # bias that overflows), and the guard costs one select per row and block.\n        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)\n        p = tl.math.exp2(',
            str(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'exponent'))),
            ')\n        alpha = tl.math.exp2(m_i - m_ref)\n        l_i = l_i * alpha + tl.sum(p, 1)',
            str(l_1_l_term),
            '\n        acc = acc * alpha[:, None]\n',
        ))
        if (undefined(name='dropout') if l_1_dropout is missing else l_1_dropout):
            pass
            t_8.append(
                '        if DROPOUT_ON:\n            # l_i already sums every probability: softmax first, then dropout, so only P @ V\n            # loses the dropped ones (normalise scales by 1 / (1 - p)).\n            keep = _dropout_keep(seed, philox_offset, batch_head, q_rows32, start,\n                                 drop_threshold, BLOCK_N)\n            p = tl.where(keep, p, 0.0)\n',
            )
        t_8.extend((
            '        acc = tl.dot(p.to(tl.',
            str((undefined(name='dtype_name') if l_1_dtype_name is missing else l_1_dtype_name)),
            '), v, acc',
            str(context.call((undefined(name='dot_precision') if l_0_dot_precision is missing else l_0_dot_precision))),
            ')\n        m_i = m_new',
        ))
        return concat(t_8)
    context.exported_vars.add('online_update')
    context.vars['online_update'] = l_0_online_update = Macro(environment, macro, 'online_update', ('l_term',), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_sink):
        t_9 = []
        if l_1_sink is missing:
            l_1_sink = 'tl.load(Sinks + off_h)'
        pass
        t_9.extend((
            '    sink_log2 = ',
            str(l_1_sink),
            ' * _LOG2E_C\n    m_sink = tl.maximum(m_i, sink_log2)\n    m_sink = tl.where(m_sink == float("-inf"), 0.0, m_sink)\n    sink_alpha = tl.math.exp2(m_i - m_sink)\n    l_i = l_i * sink_alpha + tl.math.exp2(sink_log2 - m_sink)\n    acc = acc * sink_alpha[:, None]\n    m_i = m_sink',
        ))
        return concat(t_9)
    context.exported_vars.add('fold_sink')
    context.vars['fold_sink'] = l_0_fold_sink = Macro(environment, macro, 'fold_sink', ('sink',), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_10 = []
        l_1_dropout = resolve('dropout')
        pass
        t_10.append(
            "    # Note: a fully masked row (no visible key) has l_i == 0 and m_i == -inf: it stores\n    # output 0 and LSE -inf, never NaN.\n    l_safe = tl.where(l_i == 0.0, 1.0, l_i)\n    # Note: one reciprocal per row, then a multiply per element: an IEEE division per\n    # element is a dozen instructions, a visible share of a short (N = 1024) tile's work.\n",
        )
        if (undefined(name='dropout') if l_1_dropout is missing else l_1_dropout):
            pass
            t_10.append(
                '    inv_l = 1.0 / l_safe\n    if DROPOUT_ON:\n        inv_l = inv_l * keep_scale\n    out = acc * inv_l[:, None]\n',
            )
        else:
            pass
            t_10.append(
                '    out = acc * (1.0 / l_safe)[:, None]\n',
            )
        return concat(t_10)
    context.exported_vars.add('normalise')
    context.vars['normalise'] = l_0_normalise = Macro(environment, macro, 'normalise', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_name, l_1_log2, l_1_pad):
        t_11 = []
        if l_1_name is missing:
            l_1_name = undefined("parameter 'name' was not provided", name='name')
        if l_1_log2 is missing:
            l_1_log2 = False
        if l_1_pad is missing:
            l_1_pad = '    '
        pass
        if l_1_log2:
            pass
            t_11.extend((
                str(l_1_pad),
                str(l_1_name),
                ' = m_i + tl.math.log2(l_safe)\n',
            ))
        else:
            pass
            t_11.extend((
                str(l_1_pad),
                str(l_1_name),
                ' = (m_i + tl.math.log2(l_safe)) / _LOG2E_C\n',
            ))
        t_11.extend((
            str(l_1_pad),
            str(l_1_name),
            ' = tl.where(l_i == 0.0, float("-inf"), ',
            str(l_1_name),
            ')',
        ))
        return concat(t_11)
    context.exported_vars.add('row_lse')
    context.vars['row_lse'] = l_0_row_lse = Macro(environment, macro, 'row_lse', ('name', 'log2', 'pad'), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro(l_1_pad):
        t_12 = []
        if l_1_pad is missing:
            l_1_pad = undefined("parameter 'pad' was not provided", name='pad')
        pass
        t_12.extend((
            str(l_1_pad),
            'k = tl.trans(k_desc.load([desc_b, desc_h, start, 0]).reshape(BLOCK_N, _BLOCK_D))\n',
            str(l_1_pad),
            'v = v_desc.load([desc_b, desc_h, start, 0]).reshape(BLOCK_N, _BLOCK_DV)',
        ))
        return concat(t_12)
    context.exported_vars.add('tma_load_kv')
    context.vars['tma_load_kv'] = l_0_tma_load_kv = Macro(environment, macro, 'tma_load_kv', ('pad',), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '23=18&26=20&27=37&28=54&30=67&34=71&37=85&38=92&39=94&40=96&43=103&50=113&51=117&52=119&54=126&56=130&57=133&58=137&59=139&62=145&67=152&71=161&77=163&79=165&81=168&89=175&93=184&98=191&107=198&114=205&124=219&127=228&128=231&130=238&132=243&135=253&138=259&139=261'