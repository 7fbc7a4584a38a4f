from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_gluon_masks.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    pass
    yield '@gluon.jit\ndef _gluon_key_range(n_q, n_keys, m0, diag, CTA_M: gl.constexpr, BLOCK_N: gl.constexpr,\n                     CAUSAL: gl.constexpr):\n    """Key blocks the CTA reads ([0, n_blocks)) and the first one that needs a mask (the\n    end of the keys, or the first block some row of the CTA may not see)."""\n    n_blocks = gl.cdiv(n_keys, BLOCK_N)\n    mask_from = n_keys // BLOCK_N\n    if CAUSAL:\n        last_key = gl.minimum(m0 + CTA_M, n_q) - 1 + diag  # the last key a row of the CTA sees\n        n_blocks = gl.minimum(n_blocks, gl.maximum(last_key + BLOCK_N, 0) // BLOCK_N)\n        mask_from = gl.minimum(mask_from, gl.maximum(m0 + diag + 1, 0) // BLOCK_N)\n    return n_blocks, gl.minimum(mask_from, n_blocks)\n\n\n@gluon.jit\ndef _gluon_zero_unseen(j, ring, key_end):\n    """Zeroes the rows of V_j for keys from key_end on, which no row of the CTA sees (the causal\n    tail of its last block): their P is 0, but 0 * inf or NaN stored there is not. Every\n    consumer writes the same values (zeros, or what the row holds) before its PV reads them."""\n    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn = ring\n    STAGES: gl.constexpr = v_bufs.type.shape[0]\n    BLOCK_N: gl.constexpr = v_bufs.type.shape[2]\n    HEAD_D: gl.constexpr = v_bufs.type.shape[4]\n    CHUNK: gl.constexpr = 16\n    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])\n    first = key_end - j * BLOCK_N  # the block\'s first row no row of the CTA sees\n    if first < BLOCK_N:\n        s = j % STAGES\n        mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)\n        tile = v_bufs.index(s).reshape([BLOCK_N, HEAD_D])\n        for c in gl.static_range(BLOCK_N // CHUNK):\n            chunk = tile.slice(c * CHUNK, CHUNK)\n            rows = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))\n            v = chunk.load(layout)\n            chunk.store(gl.where((rows < first)[:, None], v, 0.0).to(v.dtype))\n        fence_async_shared()\n        gl.thread_barrier()\n'

blocks = {}
debug_info = ''