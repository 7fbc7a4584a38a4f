"""The q, k, v checks of the prefill and varlen launchers: _tensors_ok, the success path by
comparisons only, and _check_tensors, which names what fails.

Copied verbatim into prefill and varlen modules after launch.py (attngen/host/__init__.py).
"""

import torch

from attngen.host.launch import _INTERPRET  # defined above this part in a generated module


# -- host code: attngen/host/checks.py, copied verbatim ----------------------------------------
# _tensors_ok is the launchers' success path, by comparisons only: no loop, no message. False
# sends the call to _check_tensors, which names what is wrong (or passes). The module's dtype
# and head dims come as arguments (DTYPE, HEAD_DIM, HEAD_DIM_V of the module).
def _check_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str,
    dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int,
) -> None:
    """Type, rank, dtype, device, head dims and head counts of q, k, v laid out as `layout`
    ("[B, H, N, D]" or "[T, H, D]": heads on axis 1, head dim last, length on axis -2 / 0)."""
    rank = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name}: expected rank {rank} {layout}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
    if q.device.type != "cuda" and not (_INTERPRET and q.device.type == "cpu"):
        raise ValueError(
            f"q: expected CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {q.device}"
        )
    if q.shape[-1] != head_dim or k.shape[-1] != head_dim:
        raise ValueError(
            f"head dim: expected q and k with D={head_dim}, got {q.shape[-1]} and {k.shape[-1]}"
        )
    if v.shape[-1] != head_dim_v:
        raise ValueError(f"v: expected head dim {head_dim_v}, got {v.shape[-1]}")
    length = 0 if rank == 3 else 2
    if k.shape[1] != v.shape[1] or k.shape[length] != v.shape[length]:
        raise ValueError(
            f"k and v: expected the same heads and length, got {k.shape[1]}, {k.shape[length]} "
            f"and {v.shape[1]}, {v.shape[length]}"
        )
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"heads: expected q heads a multiple of k/v heads, got {num_q_heads} and {num_kv_heads}"
        )


def _tensors_ok(
    q: object,
    k: object,
    v: object,
    rank: int,
    length: int,
    dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int,
) -> bool:
    """The success path of _check_tensors (axis `length` of k and v their length)."""
    tensor = torch.Tensor
    if not (type(q) is tensor and type(k) is tensor and type(v) is tensor):
        return False
    cuda = q.is_cuda
    if not (cuda or (_INTERPRET and q.is_cpu)):
        return False
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    return (
        len(q_shape) == rank
        and len(k_shape) == rank
        and len(v_shape) == rank
        and q.dtype == dtype
        and k.dtype == dtype
        and v.dtype == dtype
        and (k.is_cuda if cuda else k.is_cpu)
        and (v.is_cuda if cuda else v.is_cpu)
        and k.get_device() == q.get_device() == v.get_device()
        and q_shape[-1] == head_dim
        and k_shape[-1] == head_dim
        and v_shape[-1] == head_dim_v
        and k_shape[1] == v_shape[1]
        and k_shape[length] == v_shape[length]
        and k_shape[1] != 0
        and q_shape[1] % k_shape[1] == 0
    )
