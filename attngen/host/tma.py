"""The host side of TMA K/V loads (prefill modules whose code paths take TMA): whether a
call's K and V can be read through tensor descriptors, and the descriptors."""

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from attngen.host.launch import _FAST_LAUNCH, _LAUNCH_CACHE_SIZE

DTYPE = torch.float16  # the module's own (its constants, above the host code)

# -- host code: attngen/host/tma.py, copied verbatim -------------------------------------------
_ELEMENT_SIZE = DTYPE.itemsize
_TMA_LAYOUTS: dict[tuple, bool] = {}  # (k shape, k strides, v shape, v strides) -> TMA fits
_CHECKED_BLOCKS: set[tuple[int, ...]] = set()  # block shapes a real TensorDescriptor checked


def kv_load_path(k: torch.Tensor, v: torch.Tensor) -> str:
    """How the kernel reads K/V blocks of a launch larger than POINTER_LOADS_UP_TO (program,
    key block) pairs: "tma" (tensor descriptors, Hopper's copy engine) or "pointers: <why
    not>"; smaller launches read by pointers. Both are exact; under TMA, keys of a block at
    the causal diagonal, a window edge or the sequence end that a row must not see are
    masked in registers. TMA needs a unit head-dim stride, the base and the other strides
    16-byte aligned (no broadcast stride 0), and at least one key."""
    for name, t in (("k", k), ("v", v)):
        why = _tma_layout_problem(name, t.shape, t.stride())
        if why is None and t.data_ptr() % 16:
            why = f"{name} base address is not 16-byte aligned"
        if why is not None:
            return "pointers: " + why
    return "tma"


def _tma_layout_problem(name: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> str | None:
    """Why a K or V tensor of this shape and these strides cannot be read through TMA (None:
    it can, given a 16-byte aligned base)."""
    if shape[2] == 0:
        return f"{name} has no keys"
    if strides[3] != 1:
        return f"{name} head-dim stride is {strides[3]}, not 1"
    for size, stride in zip(shape[:3], strides[:3], strict=True):
        if (stride * _ELEMENT_SIZE) % 16 or (stride == 0 and size > 1):
            return f"{name} strides {tuple(strides)} are not 16-byte multiples"
    return None


def _tma_layout_fits(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether K and V's layouts let TMA read them at 16-byte aligned bases (remembered)."""
    layout = (k.shape, k.stride(), v.shape, v.stride())
    fits = _TMA_LAYOUTS.get(layout)
    if fits is None:
        fits = (_tma_layout_problem("k", *layout[:2]) is None
                and _tma_layout_problem("v", *layout[2:]) is None)  # fmt: skip
        if len(_TMA_LAYOUTS) >= _LAUNCH_CACHE_SIZE:
            _TMA_LAYOUTS.clear()
        _TMA_LAYOUTS[layout] = fits
    return fits


def _uses_tma(k: torch.Tensor, v: torch.Tensor) -> bool:
    """kv_load_path(k, v) == "tma": the layout's answer remembered, the bases read per call."""
    return _tma_layout_fits(k, v) and (k.data_ptr() | v.data_ptr()) & 15 == 0


def _descriptor(t: torch.Tensor, block: tuple[int, ...]) -> TensorDescriptor:
    """TensorDescriptor(t, shape, strides, block) for a tensor _uses_tma accepted. Its
    constructor's checks (alignment and strides: those of _uses_tma; the block shape: fixed
    per module) run the first time a block shape is seen and under the interpreter; later
    descriptors are filled in directly."""
    if block not in _CHECKED_BLOCKS or not _FAST_LAUNCH:
        descriptor = TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))
        _CHECKED_BLOCKS.add(block)
        return descriptor
    descriptor = object.__new__(TensorDescriptor)
    descriptor.base, descriptor.shape, descriptor.strides = t, list(t.shape), list(t.stride())
    descriptor.block_shape, descriptor.padding = list(block), "zero"
    return descriptor
