"""The Gluon forward's host side for varlen modules (after gluon.py): which calls it serves and
their launch (_gluon_varlen_layout); the module keeps _gluon_varlen_run (its spec's arguments)."""

import torch

from attngen.host.gluon import (
    _GLUON_CONSTEXPRS,
    _GLUON_PLANS,
    _INTERPRETED,
    GLUON_CONFIG,
    POINTER_LOADS_UP_TO,
    _gluon_meta,
)
from attngen.host.launch import _INTERPRET, _LAUNCH_CACHE_SIZE, _check_grid

DTYPE = torch.float16  # the module's own (its constants, above the host code)

# -- host code: attngen/host/gluon_varlen.py, copied verbatim ----------------------------------
GLUON_VARLEN_D64_MEAN_QUERIES = 512  # fewer at D 64: the tile-level kernel is faster (measured)


def _gluon_packed_problem(name: str, t: torch.Tensor) -> str | None:
    """Why TMA cannot read or write the packed [total, H, D] tensor t (None: it can, given a
    16-byte aligned base)."""
    if t.shape[0] == 0:
        return f"{name} has no rows"
    if t.stride(2) != 1:
        return f"{name} head-dim stride is {t.stride(2)}, not 1"
    pairs = zip(t.shape[:2], t.stride()[:2], strict=True)
    if any((s * DTYPE.itemsize) % 16 or (s == 0 and n > 1) for n, s in pairs):
        return f"{name} strides {tuple(t.stride())} are not 16-byte multiples"
    return None


def _gluon_varlen_layout(q, k, v, out, return_lse, max_seqlen_q, max_seqlen_k, batch,
                         use_seqused_k):  # fmt: skip
    """_gluon_layout's answer for attention_varlen (q, k, v, out [total, H, D], any strides
    TMA can read; the grid from max_seqlen_q): (launch, None) or (None, why not)."""
    layout = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.shape,
              out.stride(), return_lse, max_seqlen_q, max_seqlen_k, batch,
              use_seqused_k)  # fmt: skip
    known = _GLUON_PLANS.get(layout)
    if known is not None:
        return known
    why = _INTERPRETED if _INTERPRET else None
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        why = why or _gluon_packed_problem(name, t)
    heads, kv_heads = q.shape[1], k.shape[1]
    num_m_blocks = -(-max_seqlen_q // (GLUON_CONFIG["BLOCK_M"] * GLUON_CONFIG["NUM_CONSUMERS"]))
    grid = num_m_blocks * batch * heads
    if why is None and grid * -(-max_seqlen_k // GLUON_CONFIG["BLOCK_N"]) <= POINTER_LOADS_UP_TO:
        why = (f"a launch of at most {POINTER_LOADS_UP_TO} (CTA, key block) pairs, whose four "
               "TMA descriptors would cost more host time than the kernel saves")  # fmt: skip
    if why is None and q.shape[2] <= 64 and q.shape[0] < GLUON_VARLEN_D64_MEAN_QUERIES * batch:
        why = f"head_dim 64, under {GLUON_VARLEN_D64_MEAN_QUERIES} queries a sequence on average"
    known = (None, why)
    if why is None:
        _check_grid(grid)
        ints = (heads, heads // kv_heads, num_m_blocks, q.shape[0], k.shape[0], out.stride(0),
                out.stride(1))  # fmt: skip
        constexprs = [dict(c, USE_SEQUSED_K=use_seqused_k) for c in _GLUON_CONSTEXPRS]
        descs = tuple([_gluon_meta(t.unsqueeze(0).transpose(1, 2), GLUON_CONFIG[rows])
                       for t, rows in ((q, "BLOCK_M"), (k, "BLOCK_N"), (v, "BLOCK_N"),
                                       (out, "BLOCK_M"))])  # fmt: skip
        known = ((grid, ints, constexprs[return_lse], descs), None)
    if len(_GLUON_PLANS) >= _LAUNCH_CACHE_SIZE:
        _GLUON_PLANS.clear()
    _GLUON_PLANS[layout] = known
    return known
