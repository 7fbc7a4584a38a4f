"""The `tensors=` check of modules whose spec declares tensors for score_mod / mask_mod: the
caller's mapping against the declarations, and the kernel arguments it gives.

Copied verbatim into the prefill and varlen modules of specs with score_mod or mask_mod,
after checks.py (attngen/host/__init__.py); the declarations come from the module (_TENSORS).
"""

import torch

# -- host code: attngen/host/expressions.py, copied verbatim -----------------------------------
_EXPRESSION_DTYPES = {"int32": torch.int32, "int64": torch.int64, "float32": torch.float32}
_EXPRESSION_DTYPES |= {"bf16": torch.bfloat16, "fp16": torch.float16, "bool": torch.bool}


def _expression_tensors(tensors, declared, device):
    """(tensors in declaration order, ints): each declared tensor of `tensors` checked against
    its declaration (name, dtype, shape: ints and dim names) and `device`, and as ints each
    one's strides, then each named dim's size in order of first appearance. A named dim takes
    the size of the tensors it appears in, which must agree."""
    names = [name for name, _, _ in declared]
    if tensors is None and not names:
        return (), ()
    allowed = f"a mapping of exactly {names} to tensors (the spec declares them)"
    if not names:
        allowed = "None (the spec declares no tensors)"
    if not hasattr(tensors, "keys") or not hasattr(tensors, "__getitem__"):
        raise ValueError(f"tensors: got {type(tensors).__name__}; allowed: {allowed}")
    if set(tensors.keys()) != set(names):
        raise ValueError(
            f"tensors: got the names {sorted(map(str, tensors.keys()))}; allowed: {allowed}"
        )
    dims: dict[str, tuple[int, str]] = {}
    found, strides = [], []
    for name, dtype, shape in declared:
        t = tensors[name]
        _check_declared(name, t, _EXPRESSION_DTYPES[dtype], shape, device)
        for axis, (want, size) in enumerate(zip(shape, t.shape, strict=True)):
            if isinstance(want, int) and size != want:
                raise ValueError(
                    f"tensors[{name!r}]: size {size} on axis {axis}; allowed: {want} (declared "
                    f"shape {list(shape)})"
                )
            seen = dims.setdefault(str(want), (size, name)) if isinstance(want, str) else None
            if seen is not None and seen[0] != size:
                raise ValueError(
                    f"tensors[{name!r}]: dim {want} is {size} on axis {axis}; allowed: "
                    f"{seen[0]}, its size in tensors[{seen[1]!r}]"
                )
        found.append(t)
        strides.extend(t.stride())
    return tuple(found), (*strides, *(size for size, _ in dims.values()))


def _check_declared(name, t, dtype, shape, device):
    """One tensor's type, dtype, rank and device against its declaration."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"tensors[{name!r}]: got {type(t).__name__}; allowed: a torch.Tensor")
    if t.dtype != dtype:
        raise ValueError(f"tensors[{name!r}]: dtype {t.dtype}; allowed: {dtype} (declared)")
    if t.dim() != len(shape):
        raise ValueError(
            f"tensors[{name!r}]: rank {t.dim()} (shape {tuple(t.shape)}); allowed: rank "
            f"{len(shape)}, shape {list(shape)} (declared)"
        )
    if t.device != device:
        raise ValueError(f"tensors[{name!r}]: device {t.device}; allowed: {device} (q's)")
