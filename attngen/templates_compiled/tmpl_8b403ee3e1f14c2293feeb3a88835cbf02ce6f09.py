from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_decode_plan.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_call_plans = resolve('call_plans')
    l_0_rope_dim = resolve('rope_dim')
    l_0_kv_layout = resolve('kv_layout')
    pass
    template = environment.get_template('_steps.py.jinja', '_decode_plan.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '\n\n# -- call plans ------------------------------------------------------------------------------\n# What decode() checks and derives depends on the call\'s layout alone (the shapes, strides,\n# dtypes and devices of q, the caches, cache_seqlens, block_table, k_new, v_new and out=,\n# sm_scale, return_lse, num_splits and FORCE_NUM_SPLITS): the split rule reads shapes and the\n# device\'s SM count, never cache_seqlens\' values. Read at every call: whether out= shares\n# memory with the inputs, the base addresses\' alignment, ATTNGEN_CHECKS (the host validation\n# of the index tensors\' contents), and CONFIG (a changed config leaves the plan). So after a\n# call has passed the checks and launched, a call of the same layout skips the checks and the\n# derivations and runs the steps (append, split, combine) the first one ran.\n_CALL_PLANS = {}  # _call_key(...) -> _CallPlan\n\n\nclass _CallPlan:\n    """One call layout\'s decode: its config, output shapes, split count, the numbers the host\n    validation needs, and its steps (append and combine None where it has none)."""\n\n    __slots__ = ("config", "out_shape", "lse_shape", "splits", "part_size", "indices",\n                 "append", "split", "combine")\n\n    def __init__(self, **fields):\n        for name, value in fields.items():\n            setattr(self, name, value)\n\n\ndef _call_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sm_scale,\n              alibi_slopes, return_lse, out, num_splits, rotary_cos, rotary_sin,\n              rotary_interleaved, rotary_q_per_token):\n    """The layout of a call a plan may serve (None: the full path decides): plain tensors,\n    no slopes, sm_scale None or a float, return_lse and the rotary flags bools, num_splits an\n    int, the cached launcher on."""\n    if not (_FAST_LAUNCH and alibi_slopes is None and type(q) is _TENSOR\n            and (sm_scale is None or type(sm_scale) is float) and type(return_lse) is bool\n            and type(num_splits) is int and type(rotary_interleaved) is bool\n            and type(rotary_q_per_token) is bool):\n        return None\n    try:\n        return (q.shape, q.stride(), q.dtype, q.is_cuda, q.get_device(), _layout(k_cache),\n                _layout(v_cache), _layout(cache_seqlens), _layout(block_table), _layout(k_new),\n                _layout(v_new), _layout(out), sm_scale, return_lse, num_splits,\n                FORCE_NUM_SPLITS, _layout(rotary_cos), _layout(rotary_sin), rotary_interleaved,\n                rotary_q_per_token'
        if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
            pass
            yield ', _values_are_latent_keys(k_cache, v_cache)'
        yield ')\n    except TypeError:\n        return None\n\n\ndef _remember_plan(key, **fields):\n    if len(_CALL_PLANS) >= _LAUNCH_CACHE_SIZE:\n        _CALL_PLANS.clear()\n    _CALL_PLANS[key] = _CallPlan(**fields)\n\n\ndef _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out,\n              rotary_cos, rotary_sin):\n    """decode()\'s launches from the plan of its layout: (out, lse or None), or None when the\n    full path must run (the config changed)."""\n    if '
        if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
            pass
            yield '(CONFIG, SEPARATE_V_CONFIG)'
        else:
            pass
            yield 'CONFIG'
        yield ' != plan.config:\n        return None\n    inputs = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),\n              ("v_new", v_new), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin))\n    if out is None:\n        out = q.new_empty(plan.out_shape)\n    else:\n        storage = out.untyped_storage().data_ptr()\n        if any(t is not None and t.untyped_storage().data_ptr() == storage for _, t in inputs):\n            _check_out(out, plan.out_shape, q, inputs)  # raises when out has elements\n    if os.environ.get("ATTNGEN_CHECKS") == "1":\n        _validate_indices(cache_seqlens, block_table, *plan.indices)\n    lse = None if plan.lse_shape is None else q.new_empty(plan.lse_shape, dtype=torch.float32)\n'
        if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
            pass
            yield '    table = block_table\n'
        else:
            pass
            yield '    table = cache_seqlens\n'
        yield '    device = q.get_device()\n    cos, sin = (q, q) if rotary_cos is None else (rotary_cos, rotary_sin)\n    if plan.append is not None:\n        _run_step(plan.append, device, (k_new, v_new, k_cache, v_cache, cache_seqlens, table,\n                                        cos, sin))\n    global LAST_NUM_SPLITS\n    LAST_NUM_SPLITS = plan.splits\n    lse_arg = out if lse is None else lse\n    part_out = part_lse = out\n    if plan.combine is not None:\n        part_out = q.new_empty(plan.part_size * (_BLOCK_DV.value + 1) // _BLOCK_DV.value,\n                               dtype=torch.float32)\n        part_lse = part_out[plan.part_size:]\n    _run_step(plan.split, device, (q, k_cache, v_cache, out, lse_arg, part_out, part_lse,\n                                   cache_seqlens, table, cos, sin, out))\n    if plan.combine is not None:\n        _run_step(plan.combine, device, (part_out, part_lse, out, lse_arg))\n    return out, lse\n'

blocks = {}
debug_info = '4=14&5=20&48=23&63=27&76=34'