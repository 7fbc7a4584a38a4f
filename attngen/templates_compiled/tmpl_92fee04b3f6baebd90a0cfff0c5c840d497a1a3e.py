from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_steps.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_call_plans = resolve('call_plans')
    pass
    yield 'class _Step:\n    """One launch: its kernel, grid, ints, tail, constexprs and compile options,\n    and the compiled kernels\' _runner found for it, per (the tensors\' 16-byte alignment,\n    Triton\'s knobs)."""\n\n    __slots__ = ("kernel", "grid", "ints", "tail", "constexprs", "options", "compiled")\n\n    def __init__(self, kernel, grid, ints, tail, constexprs, options):\n        self.kernel, self.grid, self.ints, self.tail = kernel, grid, ints, tail\n        self.constexprs, self.options, self.compiled = constexprs, options, {}\n\n\ndef _run_step(step, device, tensors, ints=None, direct=None):\n    """_launch(step\'s kernel, ...) with these tensors, or, once a compiled kernel is known for\n    their alignment and the launch may run directly, its launcher with their addresses and no\n    key to derive. ints: the call\'s, in place of the step\'s (a decode plan\'s caches of another\n    size); the caller keeps a step for ints of its ints\' classes only (_int_classes), so that\n    the compiled kernel is theirs. direct: _direct_on(device, the step\'s kernel), when the\n    caller has asked it once for all its steps (None: asked here)."""\n    if ints is None:\n        ints = step.ints\n    addresses = [t.data_ptr() for t in tensors]\n    slot = (tuple([a & 15 == 0 for a in addresses]), _KNOBS.runtime.debug,\n            _KNOBS.compilation.instrumentation_mode)\n    runner = step.compiled.get(slot)\n    if direct is None:\n        direct = _direct_on(device, (step.kernel,))\n    if runner is None or not direct:\n        runner = _launch(step.kernel, step.grid, device, tensors, ints, step.tail,\n                         step.constexprs, step.options)\n        if runner is not None and _DRIVER[0]() == device:\n            step.compiled[slot] = runner\n        return\n    launch, prefix = runner\n    launch(step.grid, 1, 1, _DRIVER[1](device), *prefix, *addresses, *ints, *step.tail,\n           *step.constexprs.values())\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '\n\n_TENSOR = torch.Tensor\n\n\ndef _layout(t):\n    """A tensor\'s layout in a plan\'s key: shape, strides, dtype, device; None stays None."""\n    if t is None:\n        return None\n    if type(t) is not _TENSOR:\n        raise TypeError  # not a plain tensor: the full path decides\n    return t.shape, t.stride(), t.dtype, t.is_cuda, t.get_device()\n'

blocks = {}
debug_info = '40=13'