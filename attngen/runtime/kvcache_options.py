"""flash_attn_with_kvcache's options: their meaning and checks, route 2's key layout, the
rotary embedding, and what the call's plans need beyond the signature key. Their meaning,
as flash-attn defines it, is docs/integration.md's ("SDPA-shaped and flash-attn functions").

- cache_batch_idx / cache_leftpad: the varlen route reads sequence b's keys in place from
  cache_batch_idx[b] * L + cache_leftpad[b] (its cu_seqlens_k start), cache_seqlens[b] + Nnew
  - cache_leftpad[b] of them (seqused_k), and appends at cache_seqlens[b] of that row: device
  arithmetic only. Decode modules take neither, so such calls take the varlen route.
- num_splits: s >= 1 splits per call on decode modules; a hint on the varlen route.
- tree_mask (speculative decoding's draft trees): decode modules only, not with rotary or
  ALiBi (docs/generated_modules.md, "Tree drafts").
- rotary: fused where the decode module's kernels take it (ACCEPTS_ROTARY: `fused_rotary`
  gives their arguments), else `rotate` in torch, on a new q and k (never a copy of the
  cache), the positions kept on the device; a query token past cos/sin's rows gets NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attngen.runtime.registry import current_registry
from attngen.runtime.selection import Dispatch


@dataclass(frozen=True)
class CacheOptions:
    rotary: tuple[torch.Tensor, torch.Tensor, bool] | None  # (cos, sin, interleaved)
    batch_idx: torch.Tensor | None  # int32 [B]
    leftpad: torch.Tensor | None  # int32 [B]
    num_splits: int

    @property
    def decode_route(self) -> bool:
        """Whether a decode-kind module may serve the call (it has none of these options)."""
        return self.batch_idx is None and self.leftpad is None


def cache_options(
    q, k, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
    rotary_interleaved, num_splits, capacity,
) -> CacheOptions:  # fmt: skip
    """The options, checked; a ValueError names the argument and what is allowed."""
    batch = q.shape[0]
    if not (type(num_splits) is int and num_splits >= 0):
        raise ValueError(f"num_splits: got {num_splits!r}; allowed: an int >= 0")
    for name, index in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if index is None:
            continue
        if block_table is not None:
            raise ValueError(
                f"{name}: not supported with block_table (a paged cache), as in flash-attn"
            )
        if (
            not isinstance(index, torch.Tensor)
            or index.shape != (batch,)
            or index.dtype != torch.int32
            or index.device != q.device
        ):
            raise ValueError(
                f"{name}: expected an int32 tensor [{batch}] on {q.device}, got {_describe(index)}"
            )
    rotary = None
    if rotary_cos is not None or rotary_sin is not None:
        _check_rotary(q, k, rotary_cos, rotary_sin, capacity)
        rotary = (rotary_cos, rotary_sin, bool(rotary_interleaved))
    return CacheOptions(rotary, cache_batch_idx, cache_leftpad, num_splits)


def _check_rotary(q, k, cos, sin, capacity) -> None:
    if cos is None or sin is None:
        missing = "rotary_sin" if sin is None else "rotary_cos"
        raise ValueError(f"{missing}: pass rotary_cos and rotary_sin together, or neither")
    if k is None:
        raise ValueError(
            "rotary_cos: rotary embedding is applied to the appended k and q, so "
            "k and v must be passed with it (as in flash-attn)"
        )
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if (
            not isinstance(t, torch.Tensor)
            or t.dim() != 2
            or t.shape != cos.shape
            or 2 * t.shape[1] > q.shape[-1]
            or t.shape[1] == 0
            or t.shape[0] < capacity
            or t.dtype != q.dtype
            or t.device != q.device
        ):
            raise ValueError(
                f"{name}: expected a {q.dtype} tensor [seqlen_ro >= {capacity} (the cache's "
                f"positions), rotary_dim / 2 <= {q.shape[-1] // 2}] on {q.device}, as "
                f"rotary_cos, got {_describe(t)}"
            )


def key_layout(options: CacheOptions, steps, capacity: int, used):
    """(cu_seqlens_k, seqused_k) of the varlen route over cache rows in batch order (the
    route gathers cache_batch_idx's rows first): sequence b's keys start in row b at
    cache_leftpad[b] (else 0); `used` counts keys from 0."""
    starts = steps * capacity
    if options.leftpad is not None:
        starts = torch.cat((starts[:-1] + options.leftpad, starts[-1:]))
        used = used - options.leftpad
    return starts.to(torch.int32), used.to(torch.int32)


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{list(t.shape)} {t.dtype} on {t.device}"
    return type(t).__name__


def fused_rotary(options: CacheOptions, decode: Dispatch | None, per_token: bool) -> dict | None:
    """The decode module's rotary keywords when its kernels apply the call's rotary, else None
    (no rotary, no decode module, or one built before its kernels took rotary: `rotate` then).
    per_token: the call is causal or local."""
    if options.rotary is None or decode is None or decode.key is None:
        return None
    if not current_registry().module(decode.key).ACCEPTS_ROTARY:
        return None
    cos, sin, interleaved = options.rotary
    return rotary_keywords(cos, sin, interleaved, per_token)


def rotary_keywords(cos, sin, interleaved: bool, per_token: bool) -> dict:
    """A decode module's rotary keywords (passed only with rotary: older modules do not take
    them)."""
    keywords = {"rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": interleaved}
    return keywords | {"rotary_q_per_token": per_token}


def rotate(q, k, options: CacheOptions, cache_seqlens, per_token: bool):
    """(q, k) [B, N, H, D] with the rotary embedding applied in torch (unchanged without
    rotary). per_token: the call is causal or local."""
    if options.rotary is None:
        return q, k
    cos, sin, interleaved = options.rotary
    starts = cache_seqlens.long()[:, None]
    positions_k = starts + torch.arange(k.shape[1], device=k.device)
    positions_q = starts.expand(-1, q.shape[1])  # every query at the first new position
    if per_token:
        positions_q = starts + torch.arange(q.shape[1], device=q.device)
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


def plain_step(k, v, block_table, num_splits, rotary_cos, rotary_sin, batch_idx, leftpad) -> bool:
    """Whether a step may run from a plan: new keys none or plain tensors that need no
    gradient, block_table None or a plain tensor, num_splits an int >= 0 (the key holds it),
    rotary none or both plain tensors, and none of the options that only route 2 serves
    (cache_batch_idx, cache_leftpad)."""
    if not (
        type(num_splits) is int
        and num_splits >= 0
        and batch_idx is None
        and leftpad is None
        and (block_table is None or type(block_table) is Tensor)
        and (
            (rotary_cos is None and rotary_sin is None)
            or (type(rotary_cos) is Tensor and type(rotary_sin) is Tensor)
        )
    ):
        return False
    if k is None and v is None:
        return True
    return (
        type(k) is Tensor
        and type(v) is Tensor
        and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
    )


def rotary_key(rotary_cos, rotary_sin, rotary_interleaved) -> tuple | None:
    """Rotary's part of a signature key: the shapes cache_options checks, and the flag as the
    full path reads it (bool())."""
    if rotary_cos is None:
        return None
    return rotary_cos.shape, rotary_sin.shape, bool(rotary_interleaved)


def planned_keywords(
    rotary_cos, rotary_sin, rotary_interleaved, causal, window_size, k_descale, v_descale
) -> dict | None:
    """The decode module's keywords for a planned call: rotary's (fused_rotary's, from the
    call's own options: query tokens at their own positions when causal or local), and an fp8
    cache's descales where given (the module checks them, as on its full path)."""
    keywords = None
    if rotary_cos is not None:
        per_token = causal or window_size != (-1, -1)
        keywords = rotary_keywords(rotary_cos, rotary_sin, bool(rotary_interleaved), per_token)
    if k_descale is not None or v_descale is not None:
        keywords = {**(keywords or {}), **given_keywords(k_descale, v_descale, None)}
    return keywords


def same_kinds(q, k_cache, v_cache, k, v, cache_seqlens, block_table, keywords) -> bool:
    """The checks of check_kvcache_shapes, cache_seqlens_tensor and cache_options that a
    signature key leaves open: v_cache has k_cache's dtype (which the key holds: q's, or fp8)
    and the caches, the new keys and cos/sin (in keywords, planned_keywords') q's device, the
    new keys and cos/sin q's dtype, the index tensors are int32."""
    dtype, device = q.dtype, q.device
    if not (
        v_cache.dtype is k_cache.dtype
        and k_cache.device == device
        and v_cache.device == device
        and cache_seqlens.dtype is torch.int32
    ):
        return False
    if block_table is not None and block_table.dtype is not torch.int32:
        return False
    cos = None if keywords is None else keywords.get("rotary_cos")
    if cos is not None and not all(
        t.dtype is dtype and t.device == device for t in (cos, keywords["rotary_sin"])
    ):
        return False
    return k is None or (
        k.dtype is dtype and v.dtype is dtype and k.device == device and v.device == device
    )


def fp8_cache(k_cache, k_descale, v_descale) -> bool:
    """Whether the call's caches are fp8 (torch.float8_e4m3fn: a decode module with kv_dtype
    fp8_e4m3 dequantizes them with k_descale / v_descale, checked there); descales with any
    other cache are refused, naming the argument."""
    fp8 = getattr(k_cache, "dtype", None) is torch.float8_e4m3fn
    for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
        if descale is not None and not fp8:
            raise ValueError(
                f"{name}: dequantizes an fp8 cache (torch.float8_e4m3fn), got one with a "
                f"{getattr(k_cache, 'dtype', type(k_cache).__name__)} k_cache; pass None"
            )
    return fp8


def given_keywords(k_descale, v_descale, tree_mask) -> dict:
    """The decode module's descale and tree_mask keywords, only those given (other modules
    take none)."""
    pairs = (("k_descale", k_descale), ("v_descale", v_descale), ("tree_mask", tree_mask))
    return {name: t for name, t in pairs if t is not None}


def check_tree(tree_mask, decode: Dispatch | None, rotary, alibi_slopes) -> None:
    """tree_mask is the decode module's (its decode() checks the tensor; the varlen route has
    no tree): refused without one, and with rotary or ALiBi, which would place the draft
    tokens at their cache slots where the model means their tree depths."""
    if tree_mask is None:
        return
    if rotary is not None or alibi_slopes is not None:
        raise ValueError(
            f"tree_mask: not with {'rotary_cos' if rotary else 'alibi_slopes'}: a draft token's "
            "position is its tree depth, not its cache slot; rotate q and k at it before the call"
        )
    module = None if decode is None or decode.key is None else current_registry().module(decode.key)
    if not hasattr(module, "_tree_args"):
        raise ValueError(
            "tree_mask: needs a decode module that takes it (kind decode, max_query_tokens >= "
            "the draft tokens, built by this attngen), without cache_batch_idx / cache_leftpad; "
            "none serves the call"
        )


def refuse_fp8_without_module(decode: Dispatch | None, q, k_cache, block_table) -> None:
    """An fp8 cache has only route 1 (a decode module with kv_dtype: fp8_e4m3 reads it in
    place; the varlen route would need a dequantized copy): the error when none serves."""
    if decode is not None:
        return
    layout = "contiguous" if block_table is None else f"paged{k_cache.shape[1]}"
    raise ValueError(
        f"k_cache: an fp8 cache ({k_cache.dtype}) needs a decode module built with kv_dtype: "
        f"fp8_e4m3 for {q.dtype} q, head_dim {q.shape[-1]}, {layout}, {q.shape[1]} query "
        "tokens (max_query_tokens), without cache_batch_idx / cache_leftpad; none serves the call"
    )
