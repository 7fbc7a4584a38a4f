from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_decode_latent.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_step = l_0_constants = l_0_separate_v_constants = l_0_load_q = l_0_load_kv = missing
    pass
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', '_decode_latent.py.jinja').make_module(context.get_all(), True, {'constants': l_0_constants, 'load_kv': l_0_load_kv, 'load_q': l_0_load_q, 'separate_v_constants': l_0_separate_v_constants, 'step': l_0_step})
    context.exported_vars.discard('step')
    def macro():
        t_1 = []
        l_1_rope_dim = resolve('rope_dim')
        pass
        t_1.extend((
            'ROPE_DIM = ',
            str((undefined(name='rope_dim') if l_1_rope_dim is missing else l_1_rope_dim)),
            '  # q.k = latent (the first HEAD_DIM_V dims) + rope (the last ROPE_DIM)\n_ROPE_DIM = tl.constexpr(ROPE_DIM)',
        ))
        return concat(t_1)
    context.exported_vars.add('constants')
    context.vars['constants'] = l_0_constants = Macro(environment, macro, 'constants', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_2 = []
        l_1_separate_v_config = resolve('separate_v_config')
        pass
        t_2.extend((
            '# A v_cache that is not k_cache[..., :HEAD_DIM_V] is read as a tensor of its own, DV more\n# elements of shared memory a key: its own tile (attngen/tiling/decode_latent.py).\nSEPARATE_V_CONFIG = ',
            str((undefined(name='separate_v_config') if l_1_separate_v_config is missing else l_1_separate_v_config)),
        ))
        return concat(t_2)
    context.exported_vars.add('separate_v_constants')
    context.vars['separate_v_constants'] = l_0_separate_v_constants = Macro(environment, macro, 'separate_v_constants', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_3 = []
        pass
        t_3.append(
            '# Multi-head latent attention (absorbed): q.k = q[:DV].k[:DV] + q[DV:].k[DV:], the latent\n    # and the rope parts as two dots over one key tile, no padding of D to a power of two.\n    offs_dl = tl.arange(0, _HEAD_DIM_V)\n    offs_dr = _HEAD_DIM_V + tl.arange(0, _ROPE_DIM)\n    q_rows = (Q + off_b * stride_qb + offs_h[:, None] * stride_qh\n              + offs_t.to(tl.int64)[:, None] * stride_qt)\n    q_lat = tl.load(q_rows + offs_dl[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)\n    q_rope = tl.load(q_rows + offs_dr[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)',
        )
        return concat(t_3)
    context.exported_vars.add('load_q')
    context.vars['load_q'] = l_0_load_q = Macro(environment, macro, 'load_q', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_4 = []
        pass
        t_4.extend((
            '# The latent tile [BLOCK_N, DV] (a key per row, as V is laid out) and the rope tile\n        # [ROPE, BLOCK_N] of the same keys.\n        k_lat = tl.load(k_base + k_rows[:, None] + offs_dl[None, :] * stride_kd,\n                        mask=key_live[:, None], other=0.0)\n        k_rope = tl.load(k_base + k_rows[None, :] + offs_dr[:, None] * stride_kd,\n                         mask=key_live[None, :], other=0.0)\n        if V_FROM_K:\n            # v_cache is k_cache[..., :DV] (the launcher checked): the latent tile is V,\n            # read from HBM once for q.k and P @ V.\n            v = k_lat\n        else:\n            v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd,\n                        mask=key_live[:, None], other=0.0)\n',
            str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'score_tile'), qk='latent_rope')),
        ))
        return concat(t_4)
    context.exported_vars.add('load_kv')
    context.vars['load_kv'] = l_0_load_kv = Macro(environment, macro, 'load_kv', (), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '4=12&5=14&6=20&10=27&13=33&16=39&27=49&41=54'