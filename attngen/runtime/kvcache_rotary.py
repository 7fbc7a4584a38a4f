"""flash_attn_with_kvcache's rotary embedding (rotary_cos/rotary_sin), as flash-attn defines it.

The new keys are rotated at positions cache_seqlens[b] + t; the query tokens at
cache_seqlens[b] + t when the call is causal or local (a window other than (-1, -1)), else all
at cache_seqlens[b] (flash-attn's kernels add the row only under causal or local); cache_leftpad
does not move a position (flash-attn adds it back to the cache's length). Dims
[0, 2 * rotary_cos.shape[1]) rotate: interleaved pairs (2i, 2i + 1) (GPT-J), or the halves
(i, i + rotary_dim / 2) (GPT-NeoX); the rest are kept. Computed in float32 and rounded to the
dtype, as flash-attn's kernels do before they use the result.

Two ways, chosen per call (kvcache.py):
- fused: a decode module whose kernels take rotary (ACCEPTS_ROTARY) rotates the keys as its
  append kernel writes them into the cache and q as its split kernel loads it: no pass in
  torch, no extra tensor; fused_rotary gives its arguments.
- in torch (route 2, and decode modules built before the kernels took rotary): `rotate` makes
  a new q and k (small), never a copy of the cache; the positions stay on the device.

A query token whose position has no row of cos/sin (more query tokens than new keys, near the
end of the cache: flash-attn reads past the table there) gets NaN, both ways. The keys of a
sequence that fits its cache always have one (cache_options asks for seqlen_ro >= capacity).
"""

from __future__ import annotations

import torch

from attngen.runtime.kvcache_options import CacheOptions
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import Dispatch


def fused_rotary(options: CacheOptions, decode: Dispatch | None, per_token: bool) -> dict | None:
    """The decode module's rotary keywords when its kernels apply the call's rotary, else None
    (no rotary, no decode module, or one built before its kernels took rotary: `rotate` then).
    per_token: the call is causal or local."""
    if options.rotary is None or decode is None or decode.key is None:
        return None
    if not getattr(current_registry().module(decode.key), "ACCEPTS_ROTARY", False):
        return None
    cos, sin, interleaved = options.rotary
    return rotary_keywords(cos, sin, interleaved, per_token)


def rotary_keywords(cos, sin, interleaved: bool, per_token: bool) -> dict:
    """A decode module's rotary keywords (passed only with rotary: older modules do not take
    them)."""
    return {
        "rotary_cos": cos,
        "rotary_sin": sin,
        "rotary_interleaved": interleaved,
        "rotary_q_per_token": per_token,
    }


def rotate(q, k, options: CacheOptions, cache_seqlens, per_token: bool):
    """(q, k) [B, N, H, D] with the rotary embedding applied in torch (unchanged without
    rotary). per_token: the call is causal or local."""
    if options.rotary is None:
        return q, k
    cos, sin, interleaved = options.rotary
    starts = cache_seqlens.long()[:, None]
    positions_k = starts + torch.arange(k.shape[1], device=k.device)
    positions_q = (
        starts + torch.arange(q.shape[1], device=q.device)
        if per_token
        else starts.expand(-1, q.shape[1])
    )
    # Clamped for the gather: a cache_seqlens entry out of range must not index outside
    # cos/sin (that sequence gets NaN from the kernels and nothing appended,
    # kvcache_append._fits); a query past the table gets NaN (the module docstring).
    last = cos.shape[0] - 1
    q_past = (positions_q > last)[:, :, None, None]
    positions_q, positions_k = positions_q.clamp(0, last), positions_k.clamp(0, last)
    q = _apply_rotary(q, cos, sin, positions_q, interleaved)
    return q.masked_fill(q_past, float("nan")), _apply_rotary(k, cos, sin, positions_k, interleaved)


def _apply_rotary(x, cos, sin, positions, interleaved: bool):
    """x [B, N, H, D] rotated at positions [B, N] on its first 2 * cos.shape[1] dims."""
    half = cos.shape[1]
    c = cos[positions].unsqueeze(2).float()  # [B, N, 1, half]
    s = sin[positions].unsqueeze(2).float()
    part = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = part[..., :half], part[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), dim=-1)
