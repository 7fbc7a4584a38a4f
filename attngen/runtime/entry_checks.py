"""The generated modules' entry-point checks, for the calls that run without a module (the
torch fallback, fallback.py): an invalid call is refused with the same ValueError whichever
path serves it, never answered by torch with a result for the wrong call or a torch error.

Each check mirrors the launcher's in attngen/templates/_launch.py.jinja and _common.py.jinja
(a generated module imports no attngen code, so the checks cannot be shared): the same
conditions, in the same order, with the same messages, where the module's own constants
(DTYPE, HEAD_DIM) are q's here. tests/test_api_fallback_checks.py holds the two to the same
messages. What a module refuses because of what it was built for (its head dim, a slope
tensor without ALiBi) has no counterpart: the fallback serves any.
"""

from __future__ import annotations

import torch


def check_tensors(q, k, v, layout: str) -> None:
    """_check_tensors of the launchers: q, k, v laid out as `layout` ("[B, H, N, D]" or
    "[T, H, D]"), one dtype and device, q and k of one head dim, k and v of the same heads and
    length, query heads a multiple of key heads."""
    rank = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name}: expected rank {rank} {layout}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"head dim: expected q and k with D={q.shape[-1]}, got {q.shape[-1]} and {k.shape[-1]}"
        )
    length = 0 if rank == 3 else 2
    if k.shape[1] != v.shape[1] or k.shape[length] != v.shape[length]:
        raise ValueError(
            f"k and v: expected the same heads and length, got {k.shape[1]}, "
            f"{k.shape[length]} and {v.shape[1]}, {v.shape[length]}"
        )
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"heads: expected q heads a multiple of k/v heads, got {num_q_heads} and {num_kv_heads}"
        )


def check_dense(q, k, v, alibi_slopes) -> None:
    """What a prefill module's attention() checks of a [B, H, N, D] call."""
    check_tensors(q, k, v, "[B, H, N, D]")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"batch: expected equal sizes, got q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}"
        )
    check_alibi(alibi_slopes, q, batch=q.shape[0])


def check_alibi(alibi_slopes, q, batch: int | None = None) -> None:
    """A module built with ALiBi's slope checks (_common.py.jinja's check_alibi), for slopes
    given: [HQ] float32 on q's device, its last dim contiguous; `batch` also allows
    flash-attn's [batch, HQ], which the kernels take (sequence b reads row b)."""
    if alibi_slopes is None:
        return
    num_q_heads = q.shape[1]
    if not isinstance(alibi_slopes, torch.Tensor):
        raise ValueError(
            f"alibi_slopes: expected a float32 tensor [{num_q_heads}], got "
            f"{type(alibi_slopes).__name__}"
        )
    shapes: list[tuple[int, ...]] = [(num_q_heads,)]
    if batch is not None:
        shapes.append((batch, num_q_heads))
    if alibi_slopes.shape not in shapes or alibi_slopes.dtype != torch.float32:
        allowed = " or ".join(str(s) for s in shapes)
        raise ValueError(
            f"alibi_slopes: expected shape {allowed} float32, "
            f"got {tuple(alibi_slopes.shape)} {alibi_slopes.dtype}"
        )
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes: expected device {q.device}, got {alibi_slopes.device}")
    if alibi_slopes.shape[-1] > 1 and alibi_slopes.stride(-1) != 1:
        raise ValueError(
            "alibi_slopes: expected a contiguous tensor (its last dim read with stride 1), got "
            f"strides {alibi_slopes.stride()}"
        )


def check_sinks(sinks, q) -> None:
    """A module built with sinks' check (_common.py.jinja's check_sinks), for sinks given:
    [HQ] float32 on q's device, contiguous."""
    if sinks is None:
        return
    num_q_heads = q.shape[1]
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(
            f"sinks: expected a float32 tensor [{num_q_heads}], got {type(sinks).__name__}"
        )
    if sinks.shape != (num_q_heads,) or sinks.dtype != torch.float32:
        raise ValueError(
            f"sinks: expected shape ({num_q_heads},) float32, "
            f"got {tuple(sinks.shape)} {sinks.dtype}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks: expected device {q.device}, got {sinks.device}")
    if not sinks.is_contiguous():
        raise ValueError(
            "sinks: expected a contiguous tensor (read with stride 1), got "
            f"strides {sinks.stride()}"
        )


def check_attn_mask(attn_mask, q, k) -> None:
    """SDPA's attn_mask (the fallback's only): bool, or q's float dtype, on q's device, of a
    shape that broadcasts to [B, HQ, Nq, Nk]."""
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"attn_mask: expected a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, q.dtype) or attn_mask.device != q.device:
        raise ValueError(
            f"attn_mask: expected torch.bool or {q.dtype} on {q.device}, got "
            f"{attn_mask.dtype} on {attn_mask.device}"
        )
    try:
        fits = attn_mask.dim() <= 4 and torch.broadcast_shapes(attn_mask.shape, target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"attn_mask: expected a shape that broadcasts to [B, HQ, Nq, Nk] = "
            f"{list(target)}, got {list(attn_mask.shape)}"
        )


def check_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, alibi_slopes
) -> None:
    """What a varlen module's attention_varlen() checks on the host (no device value read)."""
    check_tensors(q, k, v, "[T, H, D]")
    for name, t in (
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k", cu_seqlens_k),
        ("seqused_k", seqused_k),
    ):
        if t is None and name == "seqused_k":
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name}: expected a 1-D int32 tensor, got {got}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
        if not t.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous tensor (read with stride 1), got "
                f"strides {t.stride()}"
            )
    if cu_seqlens_q.numel() < 1 or cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(
            "cu_seqlens_q, cu_seqlens_k: expected the same shape [B + 1], got "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    if seqused_k is not None and seqused_k.numel() != cu_seqlens_q.numel() - 1:
        raise ValueError(
            f"seqused_k: expected shape ({cu_seqlens_q.numel() - 1},) [B], "
            f"got {tuple(seqused_k.shape)}"
        )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name}: expected a Python int >= 0, got {n!r}")
    check_alibi(alibi_slopes, q, batch=cu_seqlens_q.numel() - 1)


def validate_varlen(
    total_q: int,
    total_k: int,
    cu_q: list[int],
    cu_k: list[int],
    max_seqlen_q: int,
    used: list[int] | None,
) -> None:
    """ATTNGEN_CHECKS=1: the module's _validate_varlen, on host lists of the index tensors."""
    for name, values, rows, what in (
        ("cu_seqlens_q", cu_q, total_q, "q"),
        ("cu_seqlens_k", cu_k, total_k, "k"),
    ):
        for i, value in enumerate(values if len(values) > 1 else []):
            if not 0 <= value <= rows:
                raise ValueError(f"{name}[{i}] = {value}: expected 0..{rows}, the rows of {what}")
            if i and value < values[i - 1]:
                raise ValueError(
                    f"{name}[{i}] = {value}: expected >= {name}[{i - 1}] = "
                    f"{values[i - 1]} (nondecreasing)"
                )
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] - cu_q[b] > max_seqlen_q:
            raise ValueError(
                f"cu_seqlens_q: sequence {b} has {cu_q[b + 1] - cu_q[b]} queries, "
                f"more than max_seqlen_q = {max_seqlen_q}"
            )
    for b, n in enumerate(used or []):
        if not 0 <= n <= cu_k[b + 1] - cu_k[b]:
            raise ValueError(
                f"seqused_k[{b}] = {n}: expected 0..{cu_k[b + 1] - cu_k[b]}, "
                f"the keys cu_seqlens_k gives sequence {b}"
            )


def sequence_fits(
    b: int,
    total_q: int,
    total_k: int,
    cu_q: list[int],
    cu_k: list[int],
    max_seqlen_q: int,
    used: list[int] | None,
) -> bool:
    """Whether sequence b lies inside the packed tensors, as the varlen kernel decides it (it
    gives the others NaN). A sequence longer than max_seqlen_q is refused outright here: the
    kernel serves it only when its grid, sized by max_seqlen_q in whole query blocks, happens
    to cover it; below that it gives NaN too."""
    q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
    fits = 0 <= q0 <= q1 <= total_q and 0 <= k0 <= k1 <= total_k and q1 - q0 <= max_seqlen_q
    return fits and (used is None or 0 <= used[b] <= k1 - k0)
