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
    yield 'class _Step:\n    """One launch: its kernel, grid, ints, tail, constexprs and compile options,\n    and the compiled kernels found for it, per (the tensors\' 16-byte alignment, Triton\'s\n    knobs)."""\n\n    __slots__ = ("kernel", "grid", "ints", "tail", "constexprs", "options", "compiled")\n\n    def __init__(self, kernel, grid, ints, tail, constexprs, options):\n        self.kernel, self.grid, self.ints, self.tail = kernel, grid, ints, tail\n        self.constexprs, self.options, self.compiled = constexprs, options, {}\n\n\ndef _run_step(step, device, tensors, ints=None):\n    """_launch(step\'s kernel, ...) with these tensors, or, once a compiled kernel is known for\n    their alignment and the launch may run directly, its launcher without a key to derive.\n    ints: the call\'s, in place of the step\'s (a decode plan\'s caches of another size); the\n    caller keeps a step for ints of its ints\' classes only (_int_classes), so that the\n    compiled kernel is theirs."""\n    kernel = step.kernel\n    if ints is None:\n        ints = step.ints\n    slot = (tuple([t.data_ptr() & 15 == 0 for t in tensors]), _KNOBS.runtime.debug,\n            _KNOBS.compilation.instrumentation_mode)\n    compiled = step.compiled.get(slot)\n    if compiled is None or not _runs_directly(kernel) or _DRIVER[0]() != device:\n        compiled = _launch(kernel, step.grid, device, tensors, ints, step.tail,\n                           step.constexprs, step.options)\n        if compiled is not None and _DRIVER[0]() == device:\n            step.compiled[slot] = compiled\n        return\n    compiled.run(step.grid, 1, 1, _DRIVER[1](device), compiled.function,\n                 compiled.packed_metadata, None, None, None, *tensors, *ints, *step.tail,\n                 *step.constexprs.values())\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '\n\n_TENSOR = torch.Tensor\n\n\ndef _layout(t):\n    """A tensor\'s layout in a plan\'s key: shape, strides, dtype, device; None stays None."""\n    if t is None:\n        return None\n    if type(t) is not _TENSOR:\n        raise TypeError  # not a plain tensor: the full path decides\n    return t.shape, t.stride(), t.dtype, t.is_cuda, t.get_device()\n'

blocks = {}
debug_info = '37=13'