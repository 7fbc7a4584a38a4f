from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_dropout.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    pass
    yield '# Dropout: one Philox4x32-10 call gives 128 bits, eight 16-bit uniforms, for eight keys.\n_DROP_BITS = 16\n_KEYS_PER_PHILOX = tl.constexpr(8)\n\n\n@triton.jit\ndef _dropout_keep(seed, philox_offset, batch_head, rows, key_start, drop_threshold,\n                  BLOCK_N: tl.constexpr):\n    """[len(rows), BLOCK_N] bool: which of keys key_start + [0, BLOCK_N) each query row keeps.\n\n    The counter is (key // 8, row, batch * HQ + head, philox_offset), each below 2**32, the\n    key the 64-bit seed: no linear offset that could wrap, any B * H * N * N. One\n    Philox4x32-10 call gives eight 16-bit uniforms u: key 8g + c gets bits 16 (c % 2) of word\n    c // 2, and is kept when u >= drop_threshold (= round(p * 2**16)). The mask depends on\n    (seed, offset, batch, head, row, key) only, not on the tile: the forward and backward\n    kernels draw the same one with different blocks (key_start is a multiple of 8)."""\n    groups = key_start // _KEYS_PER_PHILOX + tl.arange(0, BLOCK_N // _KEYS_PER_PHILOX)\n    zeros = tl.zeros([rows.shape[0], BLOCK_N // _KEYS_PER_PHILOX], dtype=tl.uint32)\n    c0 = zeros + groups.to(tl.uint32)[None, :]\n    c1 = zeros + rows.to(tl.uint32)[:, None]\n    c2 = zeros + batch_head.to(tl.uint32)\n    c3 = zeros + philox_offset.to(tl.uint32)\n    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)\n    low = 0xFFFF\n    # Leaves in bit-reversed order, so that the flattened join puts half c at column c.\n    u = tl.join(tl.join(tl.join(r0 & low, r2 & low), tl.join(r1 & low, r3 & low)),\n                tl.join(tl.join(r0 >> 16, r2 >> 16), tl.join(r1 >> 16, r3 >> 16)))\n    u = tl.reshape(u, (rows.shape[0], BLOCK_N))\n    # (an int32 compare: Triton turns an int argument equal to 1 into a constexpr)\n    return u.to(tl.int32) >= drop_threshold\n\n\n'

blocks = {}
debug_info = ''