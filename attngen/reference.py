"""The float64 oracle: attention with exactly a spec's semantics, written for clarity, not speed.

Also the "same math in low precision" reference that tolerances are measured against
(`shared/RELIABILITY.md`): the same steps with inputs in the kernel's dtype, scores and softmax
in fp32, P cast to the input dtype before P @ V, as FlashAttention kernels do.

This module imports torch; the build path never imports it.
"""

from __future__ import annotations

import math

import torch

from attngen.spec import AttnSpec, CausalAlign, Mask


def visible_mask(spec: AttnSpec, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """[Nq, Nk] bool: which key j query row i may see, via i' (the aligned position)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    shift = seqlen_k - seqlen_q if spec.causal_align is CausalAlign.bottom_right else 0
    i_aligned = i + shift
    if spec.mask is Mask.none:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if spec.mask is Mask.causal:
        return j <= i_aligned
    left, right = spec.window or (0, 0)
    return (j >= i_aligned - left) & (j <= i_aligned + right)


def alibi_distance(spec: AttnSpec, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """[Nq, Nk] |i' - j|, the distance ALiBi's bias is proportional to."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    shift = seqlen_k - seqlen_q if spec.causal_align is CausalAlign.bottom_right else 0
    return (i + shift - j).abs()


def attention_scores(
    spec: AttnSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    sm_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """[B, Hq, Nq, Nk] scores after scale, softcap, ALiBi and mask (-inf where masked)."""
    sequential = compute_dtype == torch.float32 and q.dtype == torch.float32
    q, k = q.to(compute_dtype), k.to(compute_dtype)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head h reads h // group
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    scores = _matmul(q, k.transpose(-1, -2), sequential) * scale
    if spec.softcap:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if spec.alibi:
        if alibi_slopes is None:
            raise ValueError("alibi_slopes: required by a spec with alibi: true")
        distance = alibi_distance(spec, seqlen_q, seqlen_k, q.device).to(compute_dtype)
        scores = scores - alibi_slopes.to(compute_dtype)[None, :, None, None] * distance
    visible = visible_mask(spec, seqlen_q, seqlen_k, q.device)
    return scores.masked_fill(~visible, float("-inf"))


def reference_attention(
    spec: AttnSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, Nq, Dv], lse [B, Hq, Nq]) in float64 by default.

    With compute_dtype=float32 and inputs in a 16-bit dtype, this is the low-precision
    reference: q.k and softmax in fp32 on the 16-bit inputs, P rounded to the input dtype.
    Fully masked rows give output 0 and LSE -inf.
    """
    scores = attention_scores(spec, q, k, sm_scale=sm_scale, alibi_slopes=alibi_slopes,
                              compute_dtype=compute_dtype)
    v_full = v.to(compute_dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    lse = torch.logsumexp(scores, dim=-1)
    # Rows with no visible key: lse is -inf; define their probabilities as 0 (output 0).
    finite = torch.isfinite(lse)
    shifted = scores - torch.where(finite, lse, 0.0)[..., None]
    probs = torch.where(finite[..., None], torch.exp(shifted), 0.0)
    if compute_dtype != torch.float64 and q.dtype != torch.float32:
        probs = probs.to(q.dtype).to(compute_dtype)
    sequential = compute_dtype == torch.float32 and q.dtype == torch.float32
    return _matmul(probs, v_full, sequential), lse


def _matmul(a: torch.Tensor, b: torch.Tensor, sequential: bool) -> torch.Tensor:
    """a @ b; `sequential` accumulates over the inner dimension one term at a time.

    Note: an fp32 kernel's IEEE dot is a chain of fp32 FMAs, one term after another; its
    rounding error grows with the inner dimension faster than a blocked BLAS matmul's. The
    low-precision reference for fp32 kernels accumulates the same way, so that it measures
    "the same math in the kernel's dtype" (for long key sequences it falls back to matmul).
    """
    if not sequential or a.shape[-1] > 4096:
        return torch.matmul(a, b)
    out = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
    for i in range(a.shape[-1]):
        out = torch.addcmul(out, a[..., :, i : i + 1], b[..., i : i + 1, :])
    return out


def lowp_reference(spec: AttnSpec, q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math in the kernel's precision; its error is the yardstick for the kernel's."""
    out, lse = reference_attention(spec, q, k, v, compute_dtype=torch.float32, **kwargs)
    return out.to(q.dtype), lse
