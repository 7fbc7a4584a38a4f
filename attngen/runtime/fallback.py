"""The torch fallback: what runs when a caller asked for fallback="sdpa" and no generated kernel
serves the call. Same semantics as a generated kernel (masks by aligned position, softcap,
ALiBi, GQA, a row that sees no key gives 0 and LSE -inf), in [B, H, N, D] layout.

Plain SDPA when it can express the call (no softcap, no sinks, no LSE asked for), else the
explicit math in fp32. Only ever reached after a warning that names why.

A dense `attn_mask` (scaled_dot_product_attention's, run only here) follows torch SDPA: a
bool mask (True = attend) or a float mask added to the scores, of any shape that broadcasts
to [B, HQ, Nq, Nk] (2D [Nq, Nk], 3D [HQ or 1, Nq, Nk], 4D). A row whose keys are all masked
(False, or -inf) gives 0, like the generated kernels, where SDPA gives NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attngen.runtime.masks import visible


def torch_attention(q, k, v, *, mask="none", align=None, window=None, softcap=0.0,
                    alibi_slopes=None, scale=None, attn_mask=None, dropout_p=0.0,
                    return_lse=False, sinks=None, chunk_size=None, sink_tokens=None):
    """out [B, HQ, Nq, DV] (and lse [B, HQ, Nq] fp32) for q [B, HQ, Nq, D], k/v [B, HKV, Nk, D].
    sinks [HQ]: one more logit per head in each row's softmax (it takes no value)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    seen = visible(mask, align, window, seqlen_q, seqlen_k, q.device, chunk_size=chunk_size,
                   sink_tokens=sink_tokens)
    bias = None
    if attn_mask is not None:
        # A float mask's -inf hides a key like a bool mask's False; its other values are bias.
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")
        if attn_mask.dtype != torch.bool:
            bias = attn_mask.float()
        seen = allowed if seen is None else seen & allowed
    if alibi_slopes is not None:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        # ALiBi's i' is aligned bottom-right without a mask (flash-attn's convention)
        i = i + (seqlen_k - seqlen_q if align == "bottom_right" or mask == "none" else 0)
        distance = (i - torch.arange(seqlen_k, device=q.device)[None, :]).abs().float()
        alibi = -alibi_slopes.float()[:, None, None] * distance
        bias = alibi if bias is None else bias + alibi
    if not softcap and not return_lse and sinks is None:
        full = None if seen is None else torch.zeros(seen.shape, device=q.device).masked_fill(
            ~seen, float("-inf"))
        if bias is not None:
            full = bias if full is None else full + bias
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if full is None else full.to(q.dtype), dropout_p=dropout_p,
            scale=scale)
        return _zero_unseen(out, seen)
    if dropout_p:
        raise ValueError("dropout_p: the fallback supports dropout only without softcap and LSE")
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
    out = _zero_unseen(out, seen)
    return (out, lse) if return_lse else out


def _zero_unseen(out, seen):
    """A row that sees no key is 0 (SDPA gives NaN there), as in the generated kernels.
    `seen` is [..., Nq, Nk], broadcastable to [B, HQ, Nq, Nk]; out is [B, HQ, Nq, DV]."""
    if seen is None:
        return out
    return out.masked_fill(~seen.any(-1, keepdim=True), 0.0)
