"""How a spec's K/V rows can be read: the alignment rules the code paths and the tiling model
share.

A contiguous [B, H, N, D] tensor's row stride is D elements. Two things depend on it:
- TMA (Hopper's tensor descriptors) needs 16-byte aligned strides: D * itemsize (and
  DV * itemsize) a multiple of 16. Other head dims (59 or 111 in fp16) use pointer loads on
  every arch (code_paths.py), and the model counts no TMA barriers for them.
- Pointer loads are vectorized, and copied asynchronously into shared memory (pipelined over
  num_stages), only where Triton can prove the row stride 16-element aligned: it specializes
  integer arguments on divisibility by 16, so D and DV must be multiples of 16. Other head
  dims (59, 72, 200) are loaded element by element, with no buffering (the tiling model's
  `pipelined=False` branch, measured on sm90: tools/verify_specs/odd_head_dims.yaml).
"""

from __future__ import annotations

from attngen.spec import AttnSpec


def rows_aligned(spec: AttnSpec) -> bool:
    """Whether K/V rows are 16-element aligned (D and DV multiples of 16): what Triton can
    prove of a contiguous tensor's row stride (it specializes integers on divisibility by
    16), so that its pointer loads are vectorized and copied asynchronously (pipelined).
    Other head dims (59, 72, 200) are loaded element by element (pointer paths only)."""
    return spec.head_dim % 16 == 0 and spec.value_head_dim % 16 == 0


def tma_strides_aligned(spec: AttnSpec) -> bool:
    """Whether K/V of the spec's head dims can be TMA loads at all: a tensor descriptor needs
    16-byte aligned strides, and a contiguous [B, H, N, D] tensor's row stride is D elements,
    so D * itemsize (and DV * itemsize) must be a multiple of 16. Other head dims (59, 111 in
    fp16, any odd one) always use pointer loads, and the model counts no TMA barriers."""
    size = spec.dtype.itemsize
    return spec.head_dim * size % 16 == 0 and spec.value_head_dim * size % 16 == 0
