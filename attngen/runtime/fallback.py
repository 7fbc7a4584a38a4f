"""The torch fallback: what runs when a caller asked for fallback="sdpa" and no generated kernel
serves the call. Same semantics as a generated kernel (masks by aligned position, softcap,
ALiBi, GQA, a row that sees no key gives 0 and LSE -inf), in [B, H, N, D] layout.

Plain SDPA when it can express the call (no softcap, no sinks, no LSE asked for), else the
explicit math in fp32. Only ever reached after a warning that names why.

`fallback_dense` and `fallback_varlen` check a call as a generated module's entry point does
(the same errors: the checks below), so an invalid call is refused whichever path serves it.
Packed sequences follow the varlen kernel's contract: a sequence whose indices leave the packed
tensors (or that is longer than max_seqlen_q) gets NaN output and LSE; ATTNGEN_CHECKS=1 raises
instead, with the module's messages. The fallback reads the index tensors on the host.

A dense `attn_mask` (scaled_dot_product_attention's, run only here) follows torch SDPA: a
bool mask (True = attend) or a float mask added to the scores, of any shape that broadcasts
to [B, HQ, Nq, Nk] (2D [Nq, Nk], 3D [HQ or 1, Nq, Nk], 4D). A row whose keys are all masked
(False, or -inf) gives 0, like the generated kernels, where SDPA gives NaN.

The entry-point checks mirror the launcher's in attngen/templates/_launch.py.jinja and
_common.py.jinja (a generated module imports no attngen code, so they cannot be shared): the
same conditions, in the same order, with the same messages, where the module's own constants
(DTYPE, HEAD_DIM) are q's here. tests/test_api_fallback_checks.py holds the two to the same
messages. What a module refuses because of what it was built for (its head dim, a slope
tensor without ALiBi) has no counterpart: the fallback serves any.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from attngen.host.varlen import _check_varlen
from attngen.spec.masks import alibi_distance, visible


def fallback_dense(q, k, v, *, alibi_slopes, attn_mask=None, sinks=None, **kwargs):
    """torch_attention after a prefill module's checks (and SDPA's attn_mask's)."""
    check_dense(q, k, v, alibi_slopes)
    check_sinks(sinks, q)
    if attn_mask is not None:
        check_attn_mask(attn_mask, q, k)
    return torch_attention(
        q, k, v, alibi_slopes=alibi_slopes, attn_mask=attn_mask, sinks=sinks, **kwargs
    )


def fallback_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, seqused_k, *,
                    return_lse: bool, alibi_slopes, **kwargs):  # fmt: skip
    """Packed [T, H, D] attention, one sequence at a time after a varlen module's checks;
    (out [Tq, HQ, DV], lse [HQ, Tq] or None). Rows no sequence covers: 0 and LSE -inf."""
    check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, seqused_k, alibi_slopes)
    check_sinks(kwargs.get("sinks"), q)
    total_q, total_k = q.shape[0], k.shape[0]
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    packed = (total_q, total_k, starts_q, starts_k, max_seqlen_q, used)
    if os.environ.get("ATTNGEN_CHECKS") == "1":
        validate_varlen(packed)
    out = q.new_zeros((total_q, q.shape[1], v.shape[-1]))
    lse = torch.full((q.shape[1], total_q), float("-inf"), device=q.device)
    for b in range(len(starts_q) - 1):
        q0, q1 = starts_q[b], starts_q[b + 1]
        if not sequence_fits(b, packed):
            lo = min(max(q0, 0), total_q)  # the rows of the sequence inside q, as the kernel
            out[lo : min(max(q1, lo), total_q)] = float("nan")
            lse[:, lo : min(max(q1, lo), total_q)] = float("nan")
            continue
        k0 = starts_k[b]
        k1 = k0 + used[b] if used is not None else starts_k[b + 1]
        seq = [t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1])]
        slopes = (
            alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else (alibi_slopes[b])
        )
        result = torch_attention(*seq, return_lse=return_lse, alibi_slopes=slopes, **kwargs)
        o = result[0] if return_lse else result
        out[q0:q1] = o[0].transpose(0, 1)
        if return_lse:
            lse[:, q0:q1] = result[1][0]
    return out, (lse if return_lse else None)


def torch_attention(q, k, v, *, mask="none", align=None, window=None, softcap=0.0,
                    alibi_slopes=None, scale=None, attn_mask=None, dropout_p=0.0,
                    return_lse=False, sinks=None, chunk_size=None, sink_tokens=None):  # fmt: skip
    """out [B, HQ, Nq, DV] (and lse [B, HQ, Nq] fp32) for q [B, HQ, Nq, D], k/v [B, HKV, Nk, D].
    sinks [HQ]: one more logit per head in each row's softmax (it takes no value)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seen, bias = _seen_and_bias(
        q, k, mask, align, window, attn_mask, alibi_slopes, chunk_size, sink_tokens
    )
    if not softcap and not return_lse and sinks is None:
        return _through_sdpa(q, k, v, seen, bias, scale, dropout_p)
    if dropout_p:
        raise ValueError(
            "dropout_p: the torch fallback supports dropout only without softcap and LSE "
            "(return_attn_probs asks for the LSE, and for S_dmask, which only a module built "
            "with dropout: true can give)"
        )
    out, lse = _explicit_softmax(q, k, v, seen, bias, scale, softcap, sinks)
    return (out, lse) if return_lse else out


def _seen_and_bias(q, k, mask, align, window, attn_mask, alibi_slopes, chunk_size, sink_tokens):
    """(which keys each query sees, bool or None for all; the scores' additive bias or None):
    the mask kind's visibility and attn_mask's, attn_mask's float values and the ALiBi bias."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    extra = {"chunk_size": chunk_size, "sink_tokens": sink_tokens}
    seen = visible(mask, align, window, seqlen_q, seqlen_k, q.device, **extra)
    bias = None
    if attn_mask is not None:
        # A float mask's -inf hides a key like a bool mask's False; its other values are bias.
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")
        if attn_mask.dtype != torch.bool:
            bias = attn_mask.float()
        seen = allowed if seen is None else seen & allowed
    if alibi_slopes is not None:
        distance = alibi_distance(mask, align, seqlen_q, seqlen_k, q.device).float()
        slopes = alibi_slopes.float()  # [HQ], or flash-attn's [B, HQ]
        slopes = slopes[:, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        alibi = -slopes * distance
        bias = alibi if bias is None else bias + alibi
    return seen, bias


def _through_sdpa(q, k, v, seen, bias, scale, dropout_p):
    """torch's SDPA with visibility and bias as one float mask (no softcap, sinks or LSE)."""
    full = None
    if seen is not None:
        full = torch.zeros(seen.shape, device=q.device).masked_fill(~seen, float("-inf"))
    if bias is not None:
        full = bias if full is None else full + bias
    attn_mask = None if full is None else full.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, scale=scale)
    return _zero_unseen(out, seen)


def _explicit_softmax(q, k, v, seen, bias, scale, softcap, sinks):
    """(out, lse) with the scores formed in fp32: softcap, bias, visibility, sink logits."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:  # logaddexp(-inf, sink) = sink: a row that sees no key
        lse = torch.logaddexp(lse, sinks.float()[None, :, None].expand_as(lse))
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = (probs.to(v.dtype) @ v).to(q.dtype)
    return _zero_unseen(out, seen), lse


def _zero_unseen(out, seen):
    """A row that sees no key is 0 (SDPA gives NaN there), as in the generated kernels.
    `seen` is [..., Nq, Nk], broadcastable to [B, HQ, Nq, Nk]; out is [B, HQ, Nq, DV]."""
    if seen is None:
        return out
    return out.masked_fill(~seen.any(-1, keepdim=True), 0.0)


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
    _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    check_alibi(alibi_slopes, q, batch=cu_seqlens_q.numel() - 1)


# A packed call's lengths on the host: (total_q, total_k, cu_q, cu_k, max_seqlen_q, used), the
# index tensors as lists (used: seqused_k's, or None).
Packed = tuple[int, int, list[int], list[int], int, list[int] | None]


def validate_varlen(packed: Packed) -> None:
    """ATTNGEN_CHECKS=1: the module's _validate_varlen, on host lists of the index tensors."""
    total_q, total_k, cu_q, cu_k, max_seqlen_q, used = packed
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


def sequence_fits(b: int, packed: Packed) -> bool:
    """Whether sequence b lies inside the packed tensors, as the varlen kernel decides it (it
    gives the others NaN). A sequence longer than max_seqlen_q is refused outright here: the
    kernel serves it only when its grid, sized by max_seqlen_q in whole query blocks, happens
    to cover it; below that it gives NaN too."""
    total_q, total_k, cu_q, cu_k, max_seqlen_q, used = packed
    q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
    fits = 0 <= q0 <= q1 <= total_q and 0 <= k0 <= k1 <= total_k and q1 - q0 <= max_seqlen_q
    return fits and (used is None or 0 <= used[b] <= k1 - k0)
