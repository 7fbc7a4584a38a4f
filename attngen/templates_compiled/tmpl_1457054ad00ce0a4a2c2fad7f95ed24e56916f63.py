from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_backward_macros.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_pad_d = l_0_pad_dv = l_0_dot_precision = l_0_accumulate_dot = l_0_diagonal = l_0_rng_state = l_0_dq_phase = l_0_dkdv_phase = l_0_sequence = missing
    pass
    def macro(l_1_axes):
        t_1 = []
        l_1_block_d = resolve('block_d')
        l_1_head_dim = resolve('head_dim')
        if l_1_axes is missing:
            l_1_axes = undefined("parameter 'axes' was not provided", name='axes')
        pass
        if ((undefined(name='block_d') if l_1_block_d is missing else l_1_block_d) != (undefined(name='head_dim') if l_1_head_dim is missing else l_1_head_dim)):
            pass
            t_1.extend((
                ' & (offs_d < _HEAD_DIM)[',
                str(l_1_axes),
                ']',
            ))
        return concat(t_1)
    context.exported_vars.add('pad_d')
    context.vars['pad_d'] = l_0_pad_d = Macro(environment, macro, 'pad_d', ('axes',), False, False, False, context.eval_ctx.autoescape)
    def macro(l_1_axes):
        t_2 = []
        l_1_block_dv = resolve('block_dv')
        l_1_head_dim_v = resolve('head_dim_v')
        if l_1_axes is missing:
            l_1_axes = undefined("parameter 'axes' was not provided", name='axes')
        pass
        if ((undefined(name='block_dv') if l_1_block_dv is missing else l_1_block_dv) != (undefined(name='head_dim_v') if l_1_head_dim_v is missing else l_1_head_dim_v)):
            pass
            t_2.extend((
                ' & (offs_dv < _HEAD_DIM_V)[',
                str(l_1_axes),
                ']',
            ))
        return concat(t_2)
    context.exported_vars.add('pad_dv')
    context.vars['pad_dv'] = l_0_pad_dv = Macro(environment, macro, 'pad_dv', ('axes',), False, False, False, context.eval_ctx.autoescape)
    def macro():
        t_3 = []
        l_1_dtype = resolve('dtype')
        pass
        if ((undefined(name='dtype') if l_1_dtype is missing else l_1_dtype) == 'fp32'):
            pass
            t_3.append(
                ', input_precision="ieee"',
            )
        return concat(t_3)
    context.exported_vars.add('dot_precision')
    context.vars['dot_precision'] = l_0_dot_precision = Macro(environment, macro, 'dot_precision', (), False, False, False, context.eval_ctx.autoescape)
    def macro(l_1_acc, l_1_a, l_1_b):
        t_4 = []
        l_1_dtype = resolve('dtype')
        if l_1_acc is missing:
            l_1_acc = undefined("parameter 'acc' was not provided", name='acc')
        if l_1_a is missing:
            l_1_a = undefined("parameter 'a' was not provided", name='a')
        if l_1_b is missing:
            l_1_b = undefined("parameter 'b' was not provided", name='b')
        pass
        if ((undefined(name='dtype') if l_1_dtype is missing else l_1_dtype) == 'fp32'):
            pass
            t_4.extend((
                str(l_1_acc),
                ' = _bwd_add_dot(',
                str(l_1_acc),
                ', ',
                str(l_1_a),
                ', ',
                str(l_1_b),
                ')',
            ))
        else:
            pass
            t_4.extend((
                str(l_1_acc),
                ' = tl.dot(',
                str(l_1_a),
                ', ',
                str(l_1_b),
                ', ',
                str(l_1_acc),
                ')',
            ))
        return concat(t_4)
    context.exported_vars.add('accumulate_dot')
    context.vars['accumulate_dot'] = l_0_accumulate_dot = Macro(environment, macro, 'accumulate_dot', ('acc', 'a', 'b'), False, False, False, context.eval_ctx.autoescape)
    def macro():
        t_5 = []
        l_1_bottom_right = resolve('bottom_right')
        l_1_alibi = resolve('alibi')
        l_1_mask = resolve('mask')
        pass
        if ((undefined(name='bottom_right') if l_1_bottom_right is missing else l_1_bottom_right) or ((undefined(name='alibi') if l_1_alibi is missing else l_1_alibi) and ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'none'))):
            pass
            t_5.append(
                '    diagonal = seqlen_k - seqlen_q\n',
            )
        else:
            pass
            t_5.append(
                '    diagonal = seqlen_k * 0\n',
            )
        return concat(t_5)
    context.exported_vars.add('diagonal')
    context.vars['diagonal'] = l_0_diagonal = Macro(environment, macro, 'diagonal', (), False, False, False, context.eval_ctx.autoescape)
    def macro():
        t_6 = []
        l_1_dropout = resolve('dropout')
        pass
        if (undefined(name='dropout') if l_1_dropout is missing else l_1_dropout):
            pass
            t_6.append(
                '    if DROPOUT_ON:\n        seed = tl.load(RngState)\n        philox_offset = tl.load(RngState + 1)\n    else:\n        seed = 0\n        philox_offset = 0\n',
            )
        return concat(t_6)
    context.exported_vars.add('rng_state')
    context.vars['rng_state'] = l_0_rng_state = Macro(environment, macro, 'rng_state', (), False, False, False, context.eval_ctx.autoescape)
    def macro(l_1_comment, l_1_bounds, l_1_masked):
        t_7 = []
        l_1_dropout = resolve('dropout')
        if l_1_comment is missing:
            l_1_comment = undefined("parameter 'comment' was not provided", name='comment')
        if l_1_bounds is missing:
            l_1_bounds = undefined("parameter 'bounds' was not provided", name='bounds')
        if l_1_masked is missing:
            l_1_masked = undefined("parameter 'masked' was not provided", name='masked')
        pass
        t_7.extend((
            '    # ',
            str(l_1_comment),
            '\n    dq = _attn_bwd_dq_inner(\n        dq, q, do, lse2, delta, q_pos, offs_m, first_q_pos, last_q_pos, batch_head,\n        k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,\n        ',
            str(l_1_bounds),
            ', seqlen_k, qk_scale, slope_log2,\n',
        ))
        if (undefined(name='dropout') if l_1_dropout is missing else l_1_dropout):
            pass
            t_7.append(
                '        seed, philox_offset, drop_threshold, keep_scale,\n',
            )
        t_7.extend((
            '        MASKED=',
            str(l_1_masked),
            ', BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,',
        ))
        if (undefined(name='dropout') if l_1_dropout is missing else l_1_dropout):
            pass
            t_7.append(
                ' DROPOUT_ON=DROPOUT_ON,',
            )
        t_7.append(
            '\n    )',
        )
        return concat(t_7)
    context.exported_vars.add('dq_phase')
    context.vars['dq_phase'] = l_0_dq_phase = Macro(environment, macro, 'dq_phase', ('comment', 'bounds', 'masked'), False, False, False, context.eval_ctx.autoescape)
    def macro(l_1_comment, l_1_bounds, l_1_masked):
        t_8 = []
        l_1_dropout = resolve('dropout')
        l_1_alibi = resolve('alibi')
        if l_1_comment is missing:
            l_1_comment = undefined("parameter 'comment' was not provided", name='comment')
        if l_1_bounds is missing:
            l_1_bounds = undefined("parameter 'bounds' was not provided", name='bounds')
        if l_1_masked is missing:
            l_1_masked = undefined("parameter 'masked' was not provided", name='masked')
        pass
        t_8.extend((
            '    # ',
            str(l_1_comment),
            '\n    dk, dv = _attn_bwd_dkdv_inner(\n        dk, dv, k, v, Q, DOut, Lse, Delta, DQ, group_slopes_log2,\n        q_base0, do_base0, row_base0, dq_base0, batch_head0, stride_qh, stride_doh, stride_lse_h,\n        stride_qm, stride_qd, stride_dom, stride_dod, stride_dqh, stride_dqm, stride_dqd, q_per_kv,\n        key_pos, first_k_pos, last_k_pos, diagonal,\n        ',
            str(l_1_bounds),
            ', seqlen_q, seqlen_k, qk_scale, sm_scale,\n',
        ))
        if (undefined(name='dropout') if l_1_dropout is missing else l_1_dropout):
            pass
            t_8.append(
                '        seed, philox_offset, drop_threshold, keep_scale,\n',
            )
        t_8.extend((
            '        MASKED=',
            str(l_1_masked),
            ', BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GRADS=GRADS, ATOMIC_DQ=ATOMIC_DQ,',
        ))
        if (undefined(name='alibi') if l_1_alibi is missing else l_1_alibi):
            pass
            t_8.append(
                ' GROUP_MAX=GROUP_MAX,',
            )
        if (undefined(name='dropout') if l_1_dropout is missing else l_1_dropout):
            pass
            t_8.append(
                ' DROPOUT_ON=DROPOUT_ON,',
            )
        t_8.append(
            '\n    )',
        )
        return concat(t_8)
    context.exported_vars.add('dkdv_phase')
    context.vars['dkdv_phase'] = l_0_dkdv_phase = Macro(environment, macro, 'dkdv_phase', ('comment', 'bounds', 'masked'), False, False, False, context.eval_ctx.autoescape)
    def macro():
        t_9 = []
        pass
        t_9.append(
            '    q_first = tl.load(CuSeqlensQ + off_b)\n    q_end = tl.load(CuSeqlensQ + off_b + 1)\n    k_first = tl.load(CuSeqlensK + off_b)\n    k_end = tl.load(CuSeqlensK + off_b + 1)\n    seqlen_q = q_end - q_first\n    seqlen_k = k_end - k_first\n    seq_ok = ((q_first >= 0) & (q_first <= q_end) & (q_end <= total_q)\n              & (k_first >= 0) & (k_first <= k_end) & (k_end <= total_k)\n              & (seqlen_q <= max_rows_q) & (seqlen_k <= max_rows_k))\n    q_offset = q_first.to(tl.int64)\n    k_offset = k_first.to(tl.int64)',
        )
        return concat(t_9)
    context.exported_vars.add('sequence')
    context.vars['sequence'] = l_0_sequence = Macro(environment, macro, 'sequence', (), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '4=12&5=29&6=46&12=58&13=95&14=101&20=114&21=118&30=126&31=138&35=140&36=143&39=150&43=164&44=177&50=179&51=182&54=189&58=208'