"""What flash_attn_with_kvcache's plans (plans.py) need beyond the signature key: whether a
step may run from one, the checks its key leaves open, and rotary's part of the key and of
the planned call (kvcache.py's docstring says when a plan is kept)."""

from __future__ import annotations

import torch
from torch import Tensor

from attngen.runtime.kvcache_rotary import rotary_keywords


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


def planned_rotary(rotary_cos, rotary_sin, rotary_interleaved, causal, window_size) -> dict | None:
    """The decode module's rotary keywords for a planned call (kvcache_rotary.fused_rotary's,
    from the call's own options: query tokens at their own positions when causal or local)."""
    if rotary_cos is None:
        return None
    per_token = causal or window_size != (-1, -1)
    return rotary_keywords(rotary_cos, rotary_sin, bool(rotary_interleaved), per_token)


def same_kinds(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary) -> bool:
    """The checks of check_kvcache_shapes, cache_seqlens_tensor and cache_options that a
    signature key leaves open: the caches, the new keys and cos/sin have q's dtype and device,
    the index tensors are int32."""
    dtype, device = q.dtype, q.device
    if not (
        k_cache.dtype is dtype
        and v_cache.dtype is dtype
        and k_cache.device == device
        and v_cache.device == device
        and cache_seqlens.dtype is torch.int32
    ):
        return False
    if block_table is not None and block_table.dtype is not torch.int32:
        return False
    if rotary is not None and not all(
        t.dtype is dtype and t.device == device
        for t in (rotary["rotary_cos"], rotary["rotary_sin"])
    ):
        return False
    return k is None or (
        k.dtype is dtype and v.dtype is dtype and k.device == device and v.device == device
    )
