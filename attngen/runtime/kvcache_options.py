"""flash_attn_with_kvcache's options: their meaning and checks, and route 2's key layout.

- rotary_cos/rotary_sin: checked here; applied by the decode module's kernels or in torch
  (kvcache_rotary.py).
- cache_batch_idx / cache_leftpad: which cache row holds sequence b, and where its keys
  start. The varlen route reads the cache in place with sequence b's keys from
  cache_batch_idx[b] * L + cache_leftpad[b] (its cu_seqlens_k start) and
  cache_seqlens[b] + Nnew - cache_leftpad[b] of them (seqused_k); the new keys are written at
  cache_seqlens[b] of row cache_batch_idx[b]. Device arithmetic only. The decode kind's
  modules take neither, so such calls take the varlen route. Neither goes with block_table
  (flash-attn refuses both combinations too).
- num_splits: 0 lets the kernels decide; s >= 1 asks for s splits of the keys. The decode
  kind's modules take it per call: the span's key blocks in min(s, MAX_SPLITS = 64) splits
  of ceil(blocks / that) blocks (the empty ones dropped), so at most one split per key
  block (attngen/tiling/decode.py); the module's LAST_NUM_SPLITS is the count its latest
  launch used. The varlen route has no split of
  the keys (one program per query block attends to all of them): there s is a hint, as
  flash-attn's is, and the call runs unsplit (`last_dispatch().kind` is "varlen").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    q,
    k,
    rotary_cos,
    rotary_sin,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    rotary_interleaved,
    num_splits,
    capacity,
) -> CacheOptions:
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
