"""The host side of the warp-specialized forward (sm90 prefill modules with `gluon`, after
tma.py): which calls it serves, its TMA descriptors, and forward_path(); the module keeps
its config, constants and _gluon_run (whose arguments follow the spec)."""

import threading

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor

from attngen.host.launch import _INTERPRET, _LAUNCH_CACHE_SIZE, _check_grid
from attngen.host.tma import _tma_layout_problem

# The module's own (above the host code; stand-ins here): _launch.py.jinja's Gluon constants.
GLUON_CONFIG = {"NUM_CONSUMERS": 2, "BLOCK_M": 64, "BLOCK_N": 128}
_GLUON_CONSTEXPRS: tuple[dict, dict] = ({}, {})
_GLUON_DTYPE = gl.float16
_GLUON_DIAG = True
POINTER_LOADS_UP_TO = 0

# -- host code: attngen/host/gluon.py, copied verbatim -----------------------------------------
# attention() runs _gluon_attn_fwd_kernel when a call fits it, else _attn_fwd_kernel: under
# Triton's interpreter (no Gluon there), or a layout TMA cannot read or write (a unit head-dim
# stride, the other strides and the base 16-byte aligned). Both write the same outputs and LSE
# (so the backward takes either's); forward_path() says which ran this thread's last call.
GLUON_PATH = "gluon warp-specialized"
_GLUON_LAYOUTS: dict = {}  # (block rows, head dim) -> the NVMMA shared layout of that block
_GLUON_PLANS: dict = {}  # (q, k, v, out shapes and strides, return_lse) -> (launch or None, why)
_GLUON_CHECKED: set = set()  # descriptor (shape, strides, block) a TensorDescriptor validated
_FORWARD = threading.local()  # .path: this thread's last forward (forward_path)
_INTERPRETED = "Triton's interpreter runs no Gluon kernel"


def forward_path() -> str:
    """Which forward kernel ran this thread's last call of this module: GLUON_PATH, or
    "tile-level: <why the Gluon kernel did not>"."""
    return getattr(_FORWARD, "path", "tile-level: no call yet")


def expected_forward_path() -> str:
    """What forward_path() says after a call whose layout fits the Gluon kernel."""
    return "tile-level: " + _INTERPRETED if _INTERPRET else GLUON_PATH


def _gluon_layout(q, k, v, out, return_lse):
    """(launch, None) when the Gluon kernel can run a call of this layout (q, k, v, out in
    [B, H, N, D] order, any strides) at 16-byte aligned bases, else (None, why not); the
    launch: (grid, ints, constexprs, each tensor's descriptor (shape, strides, block,
    layout) as the kernel reads it, [B, N, H, D]). Remembered per layout."""
    layout = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.shape,
              out.stride(), return_lse)  # fmt: skip
    known = _GLUON_PLANS.get(layout)
    if known is not None:
        return known
    why = _INTERPRETED if _INTERPRET else None
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        why = why or _tma_layout_problem(name, t.shape, t.stride())
    batch, heads, seqlen_q, _ = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    num_m_blocks = -(-seqlen_q // (GLUON_CONFIG["BLOCK_M"] * GLUON_CONFIG["NUM_CONSUMERS"]))
    grid = num_m_blocks * batch * heads
    if why is None and grid * -(-seqlen_k // GLUON_CONFIG["BLOCK_N"]) <= POINTER_LOADS_UP_TO:
        why = (f"a launch of at most {POINTER_LOADS_UP_TO} (CTA, key block) pairs, whose four "
               "TMA descriptors would cost more host time than the kernel saves")  # fmt: skip
    known = (None, why)
    if why is None:
        _check_grid(grid)
        diag = seqlen_k - seqlen_q if _GLUON_DIAG else 0
        ints = (seqlen_q, seqlen_k, heads, heads // kv_heads, diag, num_m_blocks)
        descs = tuple([_gluon_meta(t, GLUON_CONFIG[rows])
                       for t, rows in ((q, "BLOCK_M"), (k, "BLOCK_N"), (v, "BLOCK_N"),
                                       (out, "BLOCK_M"))])  # fmt: skip
        known = ((grid, ints, _GLUON_CONSTEXPRS[return_lse], descs), None)
    if len(_GLUON_PLANS) >= _LAUNCH_CACHE_SIZE:
        _GLUON_PLANS.clear()
    _GLUON_PLANS[layout] = known
    return known


def _gluon_meta(t: torch.Tensor, rows: int) -> tuple:
    """The descriptor of t ([B, H, N, D] order) the kernel reads: [B, N, H, D], blocks of
    [1, rows, 1, D] rows of one head."""
    block = [1, rows, 1, t.shape[3]]
    layout = _GLUON_LAYOUTS.get((rows, t.shape[3]))
    if layout is None:
        layout = gl.NVMMASharedLayout.get_default_for(block, _GLUON_DTYPE)
        _GLUON_LAYOUTS[(rows, t.shape[3])] = layout
    shape, strides = t.shape, t.stride()
    return ([shape[0], shape[2], shape[1], shape[3]],
            [strides[0], strides[2], strides[1], strides[3]], block, layout)  # fmt: skip


def _gluon_descriptor(t: torch.Tensor, meta: tuple) -> _GluonDescriptor:
    """The TensorDescriptor of meta over t's memory; its constructor's checks (those of
    _gluon_layout, and the block's) run the first time a meta is seen."""
    shape, strides, block, layout = meta
    seen = (tuple(shape), tuple(strides), tuple(block))
    if seen not in _GLUON_CHECKED:
        descriptor = _GluonDescriptor(t, shape, strides, block, layout)
        if len(_GLUON_CHECKED) >= _LAUNCH_CACHE_SIZE:
            _GLUON_CHECKED.clear()
        _GLUON_CHECKED.add(seen)
        return descriptor
    descriptor = object.__new__(_GluonDescriptor)
    descriptor.base, descriptor.shape, descriptor.strides = t, shape, strides
    descriptor.block_shape, descriptor.layout, descriptor.padding = block, layout, "zero"
    return descriptor


def _gluon_why(plan: tuple, q, k, v, out) -> str | None:
    """None when the Gluon kernel runs a call with _gluon_layout's answer `plan`, else why
    not (recorded for forward_path)."""
    launch, why = plan
    if why is None and (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & 15:
        why = "a base address is not 16-byte aligned"
    if why is not None:
        _FORWARD.path = "tile-level: " + why
    return why
