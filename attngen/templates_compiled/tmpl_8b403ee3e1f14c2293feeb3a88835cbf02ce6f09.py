from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_decode_plan.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_kv_layout = resolve('kv_layout')
    l_0_mask = resolve('mask')
    l_0_sink_tokens = resolve('sink_tokens')
    l_0_call_plans = resolve('call_plans')
    l_0_rope_dim = resolve('rope_dim')
    pass
    template = environment.get_template('_steps.py.jinja', '_decode_plan.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield "\n\n# -- what follows the caches' size -----------------------------------------------------------\n# A cache that grows by a key a step (transformers' DynamicCache hands decode() new tensors\n# [B, HKV, L + 1, D] each step) changes the capacity, the caches' strides, the split count and\n# the partials' size, and nothing else a launch derives. The full path and the call plans\n# derive those from the caches with the functions below, so that a plan launches what the full\n# path would for caches of any length.\n_LENGTH_DIM = "
    yield str((0 if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged') else 2))
    yield "  # the caches' dimension that varies: "
    yield str(('pages' if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged') else 'positions'))
    yield '\n\n\ndef _cache_size(k_cache, block_table, length_dim=_LENGTH_DIM):\n'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '    """(capacity, num_pages): the positions a sequence may hold and the cache\'s pages."""\n    return block_table.shape[1] * PAGE_SIZE, k_cache.shape[0]\n'
    else:
        pass
        yield '    """(capacity, 0): the positions a sequence may hold, the cache\'s dimension length_dim\n    (decode()\'s 2, decode_flash\'s 1), and no pages."""\n    return k_cache.shape[length_dim], 0\n'
    yield '\n\ndef _cache_strides(t):\n    """(outer, head, row, dim) strides of a cache: batch or page, KV head, position or slot."""\n'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '    return t.stride(0), t.stride(2), t.stride(1), t.stride(3)\n'
    else:
        pass
        yield '    return t.stride()  # [B, HKV, Lmax, D]: in that order already\n'
    yield '\n\ndef _split_count(programs, capacity, block_n, num_q_tokens, sm_count, requested):\n    """(splits, keys per split) for caches of `capacity` positions: the split rule over the\n    keys a query may see (the span), and the SM count; never cache_seqlens\' values."""\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield '    # No query sees further back than the window: splits cover only what can be seen.\n    span = min(capacity, WINDOW[0] + num_q_tokens + block_n)\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield "    # No query sees further back than its chunk's start.\n    span = min(capacity, CHUNK_SIZE + num_q_tokens + block_n)\n"
    else:
        pass
        yield '    span = capacity\n'
    if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
        pass
        yield "    span += -(-min(SINK_TOKENS, capacity) // block_n) * block_n  # the sink tokens' blocks\n"
    yield '    return _splits_for(programs, span, block_n, sm_count, requested)\n\n\ndef _ints_around(parts, strides, sizes):\n    """A kernel\'s ints: parts = (before, between, after), the ints the call\'s layout fixes,\n    around the caches\' strides (k\'s then v\'s) and `sizes`, the ints that follow their size."""\n    before, between, after = parts\n    return (*before, *strides, *between, *sizes, *after)\n\n\ndef _partials(q, rows, splits):\n    """The split kernel\'s partial outputs [rows, splits, DV] then their LSEs [rows, splits],\n    fp32, in one allocation (the kernels take pointers; the LSEs start 64-byte aligned)."""\n    size = rows * splits * _BLOCK_DV.value\n    part_out = q.new_empty(size * (_BLOCK_DV.value + 1) // _BLOCK_DV.value, dtype=torch.float32)\n    return part_out, part_out[size:]\n'
    if (undefined(name='call_plans') if l_0_call_plans is missing else l_0_call_plans):
        pass
        yield '\n\n# -- call plans ------------------------------------------------------------------------------\n# What decode() checks and derives depends on the call\'s layout (the shapes, strides, dtypes\n# and devices of q, cache_seqlens, block_table, k_new, v_new and out=, the caches\' shapes less\n# their varying dimension, their dtypes and devices, sm_scale, return_lse, num_splits,\n# FORCE_NUM_SPLITS and the rotary arguments) and on the caches\' size: the split rule reads\n# shapes and the device\'s SM count, never cache_seqlens\' values. So after a call has passed the\n# checks and launched, a call of the same layout skips the checks that the layout settles and\n# the derivations, and runs the steps (append, split, combine) the full path built for its\n# split count and its size ints\' classes (the kernels Triton compiled for them), with ints\n# derived from its own caches. Read at every call: the caches\' size and strides and the checks\n# that depend on them (k and v of one size, the new keys within the capacity, cos/sin\'s rows),\n# whether out= shares memory with the inputs, the base addresses\' alignment, ATTNGEN_CHECKS\n# (the host validation of the index tensors\' contents), and CONFIG (a changed config leaves\n# the plan).\n_CALL_PLANS = {}  # _call_key(...) -> _CallPlan\n\n\nclass _CallPlan:\n    """One call layout\'s decode: its config, output shapes, what the split rule and the\n    kernels\' ints take besides the caches\' size, and the steps built so far:\n    launches[_launch_class(...)] = (append or None, split, combine or None); the caches\'\n    varying dimension (length_dim: decode_flash\'s caller\'s caches have theirs elsewhere); and\n    `last`, the latest size\'s derivation (_size_run), so that a repeated size costs one tuple\n    compare."""\n\n    __slots__ = ("config", "out_shape", "lse_shape", "num_new", "num_q_tokens", "programs",\n                 "block_n", "sm_count", "requested", "rows", "append_parts", "split_parts",\n                 "launches", "length_dim", "last")\n\n    def __init__(self, length_dim=_LENGTH_DIM, **fields):\n        self.length_dim, self.last = length_dim, None\n        for name, value in fields.items():\n            setattr(self, name, value)\n\n    def heads_last(self, length_dim, out_shape):\n        """This plan (its launches shared: steps a later full path adds serve both) for the\n        caller\'s tensors whose [B, H, N, D] views it was made for (decode_flash), their caches\'\n        varying dimension length_dim, with its own output [B, NQ, HQ, DV]."""\n        fields = {name: getattr(self, name) for name in self.__slots__[:-2]}\n        return _CallPlan(length_dim, **dict(fields, out_shape=out_shape))\n\n\ndef _cache_layout(t, length_dim):\n    """A cache\'s layout in a plan\'s key: its shape without the varying dimension (length_dim),\n    dtype, device. Its strides are read at each call: the kernels take them as ints."""\n    if type(t) is not _TENSOR:\n        raise TypeError  # not a plain tensor: the full path decides\n    shape = t.shape\n    return shape[:length_dim] + shape[length_dim + 1:], t.dtype, t.is_cuda, t.get_device()\n\n\ndef _call_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sm_scale,\n              alibi_slopes, return_lse, out, num_splits, rotary_cos, rotary_sin,\n              rotary_interleaved, rotary_q_per_token, length_dim=_LENGTH_DIM):\n    """The layout of a call a plan may serve (None: the full path decides): plain tensors,\n    no slopes, sm_scale None or a float, return_lse and the rotary flags bools, num_splits an\n    int, the cached launcher on; the caches vary along length_dim."""\n    if not (_FAST_LAUNCH and alibi_slopes is None and type(q) is _TENSOR\n            and (sm_scale is None or type(sm_scale) is float) and type(return_lse) is bool\n            and type(num_splits) is int and type(rotary_interleaved) is bool\n            and type(rotary_q_per_token) is bool):\n        return None\n    try:\n        return (q.shape, q.stride(), q.dtype, q.is_cuda, q.get_device(),\n                _cache_layout(k_cache, length_dim), _cache_layout(v_cache, length_dim),\n                _layout(cache_seqlens), None if block_table is None else _layout(block_table),\n                None if k_new is None else _layout(k_new),\n                None if v_new is None else _layout(v_new), None if out is None else _layout(out),\n                sm_scale, return_lse, num_splits, FORCE_NUM_SPLITS,\n                None if rotary_cos is None else _layout(rotary_cos),\n                None if rotary_sin is None else _layout(rotary_sin), rotary_interleaved,\n                rotary_q_per_token'
        if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
            pass
            yield ', _values_are_latent_keys(k_cache, v_cache)'
        yield ')\n    except TypeError:\n        return None\n\n\ndef _launch_class(splits, strides, sizes):\n    """What picks a plan\'s steps for caches of some size: the split count (the grid, DIRECT,\n    the combine\'s BLOCK_SPLITS) and the classes of the ints that follow the size (what Triton\n    specializes the compiled kernels on)."""\n    return splits, _int_classes((*strides, *sizes))\n\n\ndef _remember_launches(key, launch_class, launches, **fields):\n    """Keeps a call\'s steps in its layout\'s plan (a new plan where none is, or its config\n    changed)."""\n    plan = _CALL_PLANS.get(key)\n    if plan is None or plan.config != fields["config"]:\n        if len(_CALL_PLANS) >= _LAUNCH_CACHE_SIZE:\n            _CALL_PLANS.clear()\n        plan = _CALL_PLANS[key] = _CallPlan(launches={}, **fields)\n    if len(plan.launches) >= _LAUNCH_CACHE_SIZE:\n        plan.launches.clear()\n    plan.launches[launch_class] = launches\n\n\ndef _size_run(plan, capacity, num_pages, k_strides, v_strides):\n    """(splits, launches, the append\'s ints or None, the split\'s ints) for caches of this\n    size and these strides, or None while no steps are kept for its launch class. The\n    latest answer stays on the plan: a decode loop over one cache asks the same question at\n    every step, and the split rule, the ints, their classes and the lookup then cost one\n    tuple compare."""\n    size = (capacity, num_pages, k_strides, v_strides)\n    last = plan.last\n    if last is not None and last[0] == size:\n        return last[1]\n    splits, split_len = _split_count(plan.programs, capacity, plan.block_n, plan.num_q_tokens,\n                                     plan.sm_count, plan.requested)\n'
        if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
            pass
            yield '    strides = (k_strides[0], k_strides[2], k_strides[1], k_strides[3],\n               v_strides[0], v_strides[2], v_strides[1], v_strides[3])  # as _cache_strides\n'
        else:
            pass
            yield "    if plan.length_dim == _LENGTH_DIM:\n        strides = (*k_strides, *v_strides)\n    else:  # decode_flash's [B, Lmax, HKV, D] caches: (batch, head, position, dim) as decode's\n        strides = (k_strides[0], k_strides[2], k_strides[1], k_strides[3],\n                   v_strides[0], v_strides[2], v_strides[1], v_strides[3])\n"
        yield '    sizes = (split_len, capacity - plan.num_new, num_pages)\n    launches = plan.launches.get(_launch_class(splits, strides, sizes))\n    if launches is None:\n        return None\n    append_ints = None\n    if launches[0] is not None:\n        append_ints = _ints_around(plan.append_parts, strides, sizes[1:])\n    run = (splits, launches, append_ints,\n           _ints_around(plan.split_parts, strides, (splits, *sizes)))\n    plan.last = (size, run)\n    return run\n\n\ndef _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out,\n              rotary_cos, rotary_sin):\n    """decode()\'s launches from the plan of its layout, for caches of this call\'s size: (out,\n    lse or None), or None when the full path must run (the config changed, a check of the\n    size fails and the full path raises, or no steps are kept for this size\'s launch class\n    yet: the full path launches and keeps them)."""\n    if '
        if (undefined(name='rope_dim') if l_0_rope_dim is missing else l_0_rope_dim):
            pass
            yield '(CONFIG, SEPARATE_V_CONFIG)'
        else:
            pass
            yield 'CONFIG'
        yield ' != plan.config:\n        return None\n    length_dim = plan.length_dim\n    capacity, num_pages = _cache_size(k_cache, block_table, length_dim)\n    num_new = plan.num_new\n    if (v_cache.shape[length_dim] != k_cache.shape[length_dim] or num_new > capacity\n            or (rotary_cos is not None and rotary_cos.shape[0] < capacity)):\n        return None\n    run = _size_run(plan, capacity, num_pages, k_cache.stride(), v_cache.stride())\n    if run is None:\n        return None\n    splits, steps, append_ints, split_ints = run\n    append, split, combine = steps\n    if out is None:\n        out = q.new_empty(plan.out_shape)\n    else:\n        inputs = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),\n                  ("v_new", v_new), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin))\n        storage = out.untyped_storage().data_ptr()\n        if any(t is not None and t.untyped_storage().data_ptr() == storage for _, t in inputs):\n            _check_out(out, plan.out_shape, q, inputs)  # raises when out has elements\n    if _checked():\n        _validate_indices(cache_seqlens, block_table, num_new, plan.num_q_tokens, capacity,\n                          num_pages)\n    lse = None if plan.lse_shape is None else q.new_empty(plan.lse_shape, dtype=torch.float32)\n'
        if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
            pass
            yield '    table = block_table\n'
        else:
            pass
            yield '    table = cache_seqlens\n'
        yield '    device = q.get_device()\n    direct = _direct_on(device, [step.kernel for step in steps if step is not None])\n    cos, sin = (q, q) if rotary_cos is None else (rotary_cos, rotary_sin)\n    if append is not None:\n        _run_step(append, device, (k_new, v_new, k_cache, v_cache, cache_seqlens, table, cos,\n                                   sin), append_ints, direct)\n    global LAST_NUM_SPLITS\n    LAST_NUM_SPLITS = splits\n    lse_arg = out if lse is None else lse\n    part_out = part_lse = out\n    if combine is not None:\n        part_out, part_lse = _partials(q, plan.rows, splits)\n    _run_step(split, device, (q, k_cache, v_cache, out, lse_arg, part_out, part_lse,\n                              cache_seqlens, table, cos, sin, out),\n              split_ints, direct)\n    if combine is not None:\n        _run_step(combine, device, (part_out, part_lse, out, lse_arg), None, direct)\n    return out, lse\n'

blocks = {}
debug_info = '5=16&14=23&18=27&30=34&40=41&43=44&49=50&68=54&142=57&179=61&208=68&233=75'