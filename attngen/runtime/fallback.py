"""The torch fallback: what runs when a caller asked for fallback="sdpa" and no generated kernel
serves the call. Same semantics as a generated kernel (masks by aligned position, softcap,
ALiBi, GQA, a row that sees no key gives 0 and LSE -inf), in [B, H, N, D] layout.

Plain SDPA when it can express the call (no softcap, no sinks, no LSE asked for), else the
explicit math in fp32. Only ever reached after a warning that names why.

`fallback_dense` and `fallback_varlen` check a call as a generated module's entry point does
(entry_checks.py: the same errors), so an invalid call is refused whichever path serves it.
Packed sequences follow the varlen kernel's contract: a sequence whose indices leave the packed
tensors (or that is longer than max_seqlen_q) gets NaN output and LSE; ATTNGEN_CHECKS=1 raises
instead, with the module's messages. The fallback reads the index tensors on the host.

A dense `attn_mask` (scaled_dot_product_attention's, run only here) follows torch SDPA: a
bool mask (True = attend) or a float mask added to the scores, of any shape that broadcasts
to [B, HQ, Nq, Nk] (2D [Nq, Nk], 3D [HQ or 1, Nq, Nk], 4D). A row whose keys are all masked
(False, or -inf) gives 0, like the generated kernels, where SDPA gives NaN.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from attngen.masks import alibi_distance, visible
from attngen.runtime import entry_checks


def fallback_dense(q, k, v, *, alibi_slopes, attn_mask=None, sinks=None, **kwargs):
    """torch_attention after a prefill module's checks (and SDPA's attn_mask's)."""
    entry_checks.check_dense(q, k, v, alibi_slopes)
    entry_checks.check_sinks(sinks, q)
    if attn_mask is not None:
        entry_checks.check_attn_mask(attn_mask, q, k)
    return torch_attention(
        q, k, v, alibi_slopes=alibi_slopes, attn_mask=attn_mask, sinks=sinks, **kwargs
    )


def fallback_varlen(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_k,
    *,
    return_lse: bool,
    alibi_slopes,
    **kwargs,
):
    """Packed [T, H, D] attention, one sequence at a time after a varlen module's checks;
    (out [Tq, HQ, DV], lse [HQ, Tq] or None). Rows no sequence covers: 0 and LSE -inf."""
    entry_checks.check_varlen(
        q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, seqused_k, alibi_slopes
    )
    entry_checks.check_sinks(kwargs.get("sinks"), q)
    total_q, total_k = q.shape[0], k.shape[0]
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    if os.environ.get("ATTNGEN_CHECKS") == "1":
        entry_checks.validate_varlen(total_q, total_k, starts_q, starts_k, max_seqlen_q, used)
    out = q.new_zeros((total_q, q.shape[1], v.shape[-1]))
    lse = torch.full((q.shape[1], total_q), float("-inf"), device=q.device)
    for b in range(len(starts_q) - 1):
        q0, q1 = starts_q[b], starts_q[b + 1]
        if not entry_checks.sequence_fits(
            b, total_q, total_k, starts_q, starts_k, max_seqlen_q, used
        ):
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


def torch_attention(
    q,
    k,
    v,
    *,
    mask="none",
    align=None,
    window=None,
    softcap=0.0,
    alibi_slopes=None,
    scale=None,
    attn_mask=None,
    dropout_p=0.0,
    return_lse=False,
    sinks=None,
    chunk_size=None,
    sink_tokens=None,
):
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
    seen = visible(
        mask,
        align,
        window,
        seqlen_q,
        seqlen_k,
        q.device,
        chunk_size=chunk_size,
        sink_tokens=sink_tokens,
    )
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
    full = (
        None
        if seen is None
        else torch.zeros(seen.shape, device=q.device).masked_fill(~seen, float("-inf"))
    )
    if bias is not None:
        full = bias if full is None else full + bias
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if full is None else full.to(q.dtype),
        dropout_p=dropout_p,
        scale=scale,
    )
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
