from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_call_plan.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_gluon = resolve('gluon')
    l_0_shorter_configs = resolve('shorter_configs')
    l_0_tma = resolve('tma')
    l_0_block_d = resolve('block_d')
    l_0_block_dv = resolve('block_dv')
    pass
    yield '# -- call plans ------------------------------------------------------------------------------\n# Everything attention() checks and derives depends on the call\'s layout alone (the shapes,\n# strides, dtypes and devices of q, k, v and out=, sm_scale, return_lse), except where out=\n# shares memory with the inputs and the base addresses (TMA and the kernel\'s specialization\n# read their alignment): those are read at every call. So after a call has passed the checks\n# on the GPU (the cached launcher on) and launched, a call of the same layout skips the checks\n# and the launch\'s derivations, and launches the compiled kernel its alignment, load path and\n# Triton\'s knobs select. The plan is left when the config it used has changed (autotune\n# updates CONFIG) or the launch cannot run directly (a hook, another current device).\n_CALL_PLANS = {}  # _call_key(...) -> _CallPlan\n\n\nclass _CallPlan:\n    """One call layout\'s launch: its config, grid, ints, constexprs, options and output\n    shapes; the launch-count pairs POINTER_LOADS_UP_TO compares; whether the layout allows\n    TMA; the compiled kernels\' _runner found for it, per (kernel, alignment, TMA, Triton\'s\n    knobs)."""\n\n    __slots__ = ("config", "longest", "grid", "ints", "qk_scale", "out_shape", "lse_shape",\n                 "constexprs", "options", "pairs", "tma_layout",'
    if (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon):
        pass
        yield ' "gluon",'
    yield ' "flash", "compiled")\n\n    def __init__(self, flash=False, **fields):\n        for name, value in fields.items():\n            setattr(self, name, value)\n        self.flash = flash  # q, k, v come in [B, N, H, D] (attention_flash)\n        self.compiled = {}\n\n    def heads_last(self, flash, out_shape):\n        """This plan with its own output shape ([B, M, HQ, DV]), for q, k, v as it was made for\n        them or (flash) for the [B, N, H, D] tensors whose [B, H, N, D] views they were: the\n        same pointers and ints, and TMA descriptors of the views."""\n        fields = {name: getattr(self, name) for name in self.__slots__[:-2]}\n        return _CallPlan(flash=flash, **dict(fields, out_shape=out_shape))\n\n\ndef _call_key(q, k, v, sm_scale, alibi_slopes, return_lse, out):\n    """The layout of a call a plan may serve (None: the full path decides): plain tensors,\n    no slopes, sm_scale None or a float, return_lse a bool, the cached launcher on."""\n    if not (_FAST_LAUNCH and alibi_slopes is None and type(q) is _TENSOR and type(k) is _TENSOR\n            and type(v) is _TENSOR and (sm_scale is None or type(sm_scale) is float)\n            and type(return_lse) is bool):\n        return None\n    if out is None:\n        out_layout = None\n    elif type(out) is _TENSOR:\n        out_layout = (out.shape, out.stride(), out.dtype, out.is_cuda, out.get_device())\n    else:\n        return None\n    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,\n            v.dtype, q.is_cuda, k.is_cuda, v.is_cuda, q.get_device(), k.get_device(),\n            v.get_device(), sm_scale, return_lse, out_layout)\n\n\ndef _remember_plan(key, **fields):\n    if len(_CALL_PLANS) >= _LAUNCH_CACHE_SIZE:\n        _CALL_PLANS.clear()\n    _CALL_PLANS[key] = _CallPlan(**fields)\n\n\ndef _run_plan(plan, q, k, v, out):\n    """attention()\'s launch from the plan of its layout (attention_flash\'s: its tensors in\n    [B, N, H, D]): (out, lse or None), or None when the full path must run (the config\n    changed, or the launch cannot run directly)."""\n'
    if (undefined(name='shorter_configs') if l_0_shorter_configs is missing else l_0_shorter_configs):
        pass
        yield '    if config_for(plan.longest) != plan.config:\n'
    else:
        pass
        yield '    if CONFIG != plan.config:\n'
    yield '        return None\n    if out is None:\n        out = q.new_empty(plan.out_shape)\n    else:\n        storage = out.untyped_storage().data_ptr()\n        if storage in (q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr(),\n                       v.untyped_storage().data_ptr()):\n            _check_out(out, plan.out_shape, q, (("q", q), ("k", k), ("v", v)))  # raises\n    lse = None if plan.lse_shape is None else q.new_empty(plan.lse_shape, dtype=torch.float32)\n    lse_arg = out if lse is None else lse\n'
    if (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon):
        pass
        yield "    if _gluon_why(plan.gluon, q, k, v, out) is None:  # the layout's descriptors, these bases\n        _gluon_run(plan.gluon[0], q, k, v, out, lse_arg, plan.qk_scale)\n        return out, lse\n"
    if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
        pass
        yield '    use_tma = (plan.pairs > POINTER_LOADS_UP_TO and plan.tma_layout\n               and (k.data_ptr() | v.data_ptr()) & 15 == 0)\n    if use_tma:\n        block_n = plan.config["BLOCK_N"]\n        k_heads, v_heads = (k.transpose(1, 2), v.transpose(1, 2)) if plan.flash else (k, v)\n        tail = (plan.qk_scale, _descriptor(k_heads, (1, 1, block_n, '
        yield str((undefined(name='block_d') if l_0_block_d is missing else l_0_block_d))
        yield ')),\n                _descriptor(v_heads, (1, 1, block_n, '
        yield str((undefined(name='block_dv') if l_0_block_dv is missing else l_0_block_dv))
        yield ')))\n    else:\n        tail = (plan.qk_scale, None, None)\n    constexprs = plan.constexprs[use_tma]\n'
    else:
        pass
        yield '    use_tma = False\n    tail = (plan.qk_scale,)\n    constexprs = plan.constexprs[False]\n'
    yield '    tensors = (q, k, v, out, lse_arg, out)\n    device = q.get_device()\n    addresses = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse_arg.data_ptr()]\n    slot = (_attn_fwd_kernel, addresses[0] & 15 == 0, addresses[1] & 15 == 0,\n            addresses[2] & 15 == 0, addresses[3] & 15 == 0, addresses[4] & 15 == 0,\n            use_tma, _KNOBS.runtime.debug, _KNOBS.compilation.instrumentation_mode)\n    runner = plan.compiled.get(slot)\n    if (runner is None or not _runs_directly(_attn_fwd_kernel)\n            or _DRIVER[0]() != device):\n        runner = _launch(_attn_fwd_kernel, plan.grid, device, tensors, plan.ints, tail,\n                         constexprs, plan.options)\n        if runner is not None and _DRIVER[0]() == device:\n            plan.compiled[slot] = runner\n        return out, lse\n    launch, prefix = runner\n    launch(plan.grid, 1, 1, _DRIVER[1](device), *prefix, *addresses, addresses[3], *plan.ints,\n           *tail, *constexprs.values())\n    return out, lse\n'

blocks = {}
debug_info = '23=17&67=21&82=28&87=31&93=34&94=36'