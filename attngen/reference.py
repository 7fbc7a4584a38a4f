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
    low_precision = compute_dtype != torch.float64
    input_dtype = q.dtype
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if spec.softcap:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if spec.alibi:
        if alibi_slopes is None:
            raise ValueError("alibi_slopes: required by a spec with alibi: true")
        distance = alibi_distance(spec, seqlen_q, seqlen_k, q.device).to(compute_dtype)
        scores = scores - alibi_slopes.to(compute_dtype)[None, :, None, None] * distance
    visible = visible_mask(spec, seqlen_q, seqlen_k, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows with no visible key: lse is -inf; define their probabilities as 0 (output 0).
    finite = torch.isfinite(lse)
    probs = torch.where(finite[..., None], torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]),
                        0.0)
    if low_precision and input_dtype != torch.float32:
        probs = probs.to(input_dtype).to(compute_dtype)
    out = torch.matmul(probs, v)
    return out, lse


def lowp_reference(spec: AttnSpec, q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math in the kernel's precision; its error is the yardstick for the kernel's."""
    out, lse = reference_attention(spec, q, k, v, compute_dtype=torch.float32, **kwargs)
    return out.to(q.dtype), lse
