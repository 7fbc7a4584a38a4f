from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_launch_helpers.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_sinks = resolve('sinks')
    l_0_dtype = resolve('dtype')
    l_0_shorter_configs = resolve('shorter_configs')
    l_0_gluon = resolve('gluon')
    l_0_gluon_gap = resolve('gluon_gap')
    l_0_common = l_0_step = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_common = context.vars['common'] = environment.get_template('_common.py.jinja', '_launch_helpers.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'step': l_0_step})
    context.exported_vars.discard('common')
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', '_launch_helpers.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'step': l_0_step})
    context.exported_vars.discard('step')
    yield 'def _check_alibi(alibi_slopes, num_q_heads, q, batch=None):\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'check_alibi')), '\n'))
    yield '\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield '\n\ndef _check_sinks(sinks, num_q_heads, q):\n'
        yield str(t_1(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'check_sinks')), '\n'))
        yield '\n'
    yield '\n\ndef _kernel_scale(sm_scale):\n    """The scale the kernel multiplies q.k by: log2 e folded in, or 1/softcap before tanh."""\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'check_sm_scale')), '\n'))
    yield '\n    return '
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'kernel_scale')))
    yield '\n\n\ndef _options(config):\n    """The compile options of a launch with `config`."""\n'
    if ((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype) == 'fp32'):
        pass
        yield '    return {"num_warps": config["num_warps"], "num_stages": config["num_stages"],\n            "enable_fp_fusion": False}  # see the Note on fp32 scores\n'
    else:
        pass
        yield '    return {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}\n'
    if (undefined(name='shorter_configs') if l_0_shorter_configs is missing else l_0_shorter_configs):
        pass
        yield '\n\ndef config_for(seqlen):\n    """The launch config for sequences of `seqlen` (queries or keys, the longer): the first\n    entry of CONFIGS_BY_SEQLEN that reaches it, else CONFIG."""\n    for up_to, config in CONFIGS_BY_SEQLEN:\n        if seqlen <= up_to:\n            return config\n    return CONFIG\n'
    if (not (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon)):
        pass
        yield '\n\ndef forward_path():\n    """Which forward kernel runs this module\'s calls: the tile-level one, since the module has\n    no warp-specialized (Gluon) forward."""\n    return "tile-level: '
        yield str((undefined(name='gluon_gap') if l_0_gluon_gap is missing else l_0_gluon_gap))
        yield '"\n'

blocks = {}
debug_info = '4=23&5=25&7=28&8=30&12=33&18=36&19=38&24=40&30=46&41=49&47=52'