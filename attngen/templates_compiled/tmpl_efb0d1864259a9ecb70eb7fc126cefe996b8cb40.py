from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_gluon_launch.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_gluon_consumers = resolve('gluon_consumers')
    l_0_gluon_block_m = resolve('gluon_block_m')
    l_0_gluon_block_n = resolve('gluon_block_n')
    l_0_gluon_stages = resolve('gluon_stages')
    l_0_gluon_consumer_regs = resolve('gluon_consumer_regs')
    l_0_gluon_producer_regs = resolve('gluon_producer_regs')
    l_0_gluon_maxnreg = resolve('gluon_maxnreg')
    l_0_mask = resolve('mask')
    l_0_dtype_name = resolve('dtype_name')
    l_0_bottom_right = resolve('bottom_right')
    pass
    yield "# -- the warp-specialized forward (Gluon, Hopper) -------------------------------------------\n# attention() runs _gluon_attn_fwd_kernel when a call fits it and the tile-level\n# _attn_fwd_kernel otherwise: under Triton's interpreter (Gluon does not run there), or when\n# a tensor's layout is not one TMA can read or write (a unit head-dim stride, the other\n# strides and the base 16-byte aligned). Both write the same layouts and the same LSE\n# (natural log, -inf for a row that sees no key), so the backward takes either forward's.\n# forward_path() says which ran this thread's last call. Config (attngen/tiling/gluon.py):\n# "
    yield str((undefined(name='gluon_consumers') if l_0_gluon_consumers is missing else l_0_gluon_consumers))
    yield ' consumer warpgroups x '
    yield str((undefined(name='gluon_block_m') if l_0_gluon_block_m is missing else l_0_gluon_block_m))
    yield ' rows, BLOCK_N '
    yield str((undefined(name='gluon_block_n') if l_0_gluon_block_n is missing else l_0_gluon_block_n))
    yield ', '
    yield str((undefined(name='gluon_stages') if l_0_gluon_stages is missing else l_0_gluon_stages))
    yield ' stages, setmaxnreg '
    yield str((undefined(name='gluon_consumer_regs') if l_0_gluon_consumer_regs is missing else l_0_gluon_consumer_regs))
    yield '/'
    yield str((undefined(name='gluon_producer_regs') if l_0_gluon_producer_regs is missing else l_0_gluon_producer_regs))
    yield '.\nGLUON_CONFIG = {"NUM_CONSUMERS": '
    yield str((undefined(name='gluon_consumers') if l_0_gluon_consumers is missing else l_0_gluon_consumers))
    yield ', "BLOCK_M": '
    yield str((undefined(name='gluon_block_m') if l_0_gluon_block_m is missing else l_0_gluon_block_m))
    yield ', "BLOCK_N": '
    yield str((undefined(name='gluon_block_n') if l_0_gluon_block_n is missing else l_0_gluon_block_n))
    yield ', "STAGES": '
    yield str((undefined(name='gluon_stages') if l_0_gluon_stages is missing else l_0_gluon_stages))
    yield ',\n                "CONSUMER_REGS": '
    yield str((undefined(name='gluon_consumer_regs') if l_0_gluon_consumer_regs is missing else l_0_gluon_consumer_regs))
    yield ', "PRODUCER_REGS": '
    yield str((undefined(name='gluon_producer_regs') if l_0_gluon_producer_regs is missing else l_0_gluon_producer_regs))
    yield '}\nGLUON_PATH = "gluon warp-specialized"\n_GLUON_OPTIONS = {"num_warps": 4, "maxnreg": '
    yield str((undefined(name='gluon_maxnreg') if l_0_gluon_maxnreg is missing else l_0_gluon_maxnreg))
    yield '}\n_GLUON_CONSTEXPRS = ({"STORE_LSE": False, "CAUSAL": '
    yield str(((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'causal'))
    yield ', "STAGES": '
    yield str((undefined(name='gluon_stages') if l_0_gluon_stages is missing else l_0_gluon_stages))
    yield ', "NUM_CONSUMERS": '
    yield str((undefined(name='gluon_consumers') if l_0_gluon_consumers is missing else l_0_gluon_consumers))
    yield ',\n                      "CONSUMER_REGS": '
    yield str((undefined(name='gluon_consumer_regs') if l_0_gluon_consumer_regs is missing else l_0_gluon_consumer_regs))
    yield ', "PRODUCER_REGS": '
    yield str((undefined(name='gluon_producer_regs') if l_0_gluon_producer_regs is missing else l_0_gluon_producer_regs))
    yield '},)\n_GLUON_CONSTEXPRS += (dict(_GLUON_CONSTEXPRS[0], STORE_LSE=True),)  # [return_lse]\n_GLUON_DTYPE = gl.'
    yield str((undefined(name='dtype_name') if l_0_dtype_name is missing else l_0_dtype_name))
    yield '\n_GLUON_LAYOUTS = {}  # (block rows, head dim) -> the NVMMA shared layout of that block\n_GLUON_PLANS = {}  # (q, k, v, out shapes and strides, return_lse) -> (launch or None, why)\n_GLUON_CHECKED = set()  # descriptor (shape, strides, block) a real TensorDescriptor validated\n_FORWARD = threading.local()  # .path: this thread\'s last forward (forward_path)\n\n\n_INTERPRETED = "Triton\'s interpreter runs no Gluon kernel"\n\n\ndef forward_path():\n    """Which forward kernel ran this thread\'s last call of this module: GLUON_PATH, or\n    "tile-level: <why the Gluon kernel did not>"."""\n    return getattr(_FORWARD, "path", "tile-level: no call yet")\n\n\ndef expected_forward_path():\n    """What forward_path() says after a call whose layout fits the Gluon kernel."""\n    return "tile-level: " + _INTERPRETED if _INTERPRET else GLUON_PATH\n\n\ndef _gluon_layout(q, k, v, out, return_lse):\n    """(launch, None) when the Gluon kernel can run a call of this layout (q, k, v, out in\n    [B, H, N, D] order, any strides) at 16-byte aligned bases, else (None, why not); the\n    launch: (grid, ints, constexprs, each tensor\'s descriptor (shape, strides, block,\n    layout) as the kernel reads it, [B, N, H, D]). Remembered per layout."""\n    layout = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.shape,\n              out.stride(), return_lse)\n    known = _GLUON_PLANS.get(layout)\n    if known is not None:\n        return known\n    why = None\n    if _INTERPRET:\n        why = _INTERPRETED\n    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):\n        why = why or _tma_layout_problem(name, t.shape, t.stride())\n    batch, heads, seqlen_q, _ = q.shape\n    kv_heads, seqlen_k = k.shape[1], k.shape[2]\n    num_m_blocks = -(-seqlen_q // (GLUON_CONFIG["BLOCK_M"] * GLUON_CONFIG["NUM_CONSUMERS"]))\n    grid = num_m_blocks * batch * heads\n    if why is None and grid * -(-seqlen_k // GLUON_CONFIG["BLOCK_N"]) <= POINTER_LOADS_UP_TO:\n        why = (f"a launch of at most {POINTER_LOADS_UP_TO} (CTA, key block) pairs, whose four "\n               "TMA descriptors would cost more host time than the kernel saves")\n    known = (None, why)\n    if why is None:\n        _check_grid(grid)\n        diag = '
    yield str(('seqlen_k - seqlen_q' if (undefined(name='bottom_right') if l_0_bottom_right is missing else l_0_bottom_right) else '0'))
    yield '\n        ints = (seqlen_q, seqlen_k, heads, heads // kv_heads, diag, num_m_blocks)\n        descs = tuple([_gluon_meta(t, GLUON_CONFIG[rows])\n                       for t, rows in ((q, "BLOCK_M"), (k, "BLOCK_N"), (v, "BLOCK_N"),\n                                       (out, "BLOCK_M"))])\n        known = ((grid, ints, _GLUON_CONSTEXPRS[return_lse], descs), None)\n    if len(_GLUON_PLANS) >= _LAUNCH_CACHE_SIZE:\n        _GLUON_PLANS.clear()\n    _GLUON_PLANS[layout] = known\n    return known\n\n\ndef _gluon_meta(t, rows):\n    """The descriptor of t ([B, H, N, D] order) the kernel reads: [B, N, H, D], blocks of\n    [1, rows, 1, D] rows of one head."""\n    block = [1, rows, 1, t.shape[3]]\n    layout = _GLUON_LAYOUTS.get((rows, t.shape[3]))\n    if layout is None:\n        layout = gl.NVMMASharedLayout.get_default_for(block, _GLUON_DTYPE)\n        _GLUON_LAYOUTS[(rows, t.shape[3])] = layout\n    shape, strides = t.shape, t.stride()\n    return ([shape[0], shape[2], shape[1], shape[3]],\n            [strides[0], strides[2], strides[1], strides[3]], block, layout)\n\n\ndef _gluon_descriptor(t, meta):\n    """The TensorDescriptor of meta over t\'s memory; its constructor\'s checks (those of\n    _gluon_layout, and the block\'s) run the first time a meta is seen."""\n    shape, strides, block, layout = meta\n    seen = (tuple(shape), tuple(strides), tuple(block))\n    if seen not in _GLUON_CHECKED:\n        descriptor = _GluonDescriptor(t, shape, strides, block, layout)\n        if len(_GLUON_CHECKED) >= _LAUNCH_CACHE_SIZE:\n            _GLUON_CHECKED.clear()\n        _GLUON_CHECKED.add(seen)\n        return descriptor\n    descriptor = object.__new__(_GluonDescriptor)\n    descriptor.base, descriptor.shape, descriptor.strides = t, shape, strides\n    descriptor.block_shape, descriptor.layout, descriptor.padding = block, layout, "zero"\n    return descriptor\n\n\ndef _gluon_run(launch, q, k, v, out, lse_arg, qk_scale):\n    """The Gluon kernel\'s launch of a call _gluon_layout accepted, at aligned bases."""\n    grid, ints, constexprs, descs = launch\n    _FORWARD.path = GLUON_PATH\n    tail = (qk_scale, _gluon_descriptor(q, descs[0]), _gluon_descriptor(k, descs[1]),\n            _gluon_descriptor(v, descs[2]), _gluon_descriptor(out, descs[3]))\n    _launch(_gluon_attn_fwd_kernel, grid, q.get_device(), (lse_arg,), ints, tail, constexprs,\n            _GLUON_OPTIONS)\n\n\ndef _gluon_why(plan, q, k, v, out):\n    """None when the Gluon kernel runs a call with _gluon_layout\'s answer `plan`, else why\n    not (recorded for forward_path)."""\n    launch, why = plan\n    if why is None and (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & 15:\n        why = "a base address is not 16-byte aligned"\n    if why is not None:\n        _FORWARD.path = "tile-level: " + why\n    return why\n'

blocks = {}
debug_info = '11=22&12=34&13=42&15=46&16=48&17=54&19=58&65=60'