"""transformers' static cache (StaticCache, generate(cache_implementation="static")): decode
steps on a generated decode module, with no host read, so that a step can be captured; and a
DynamicCache's decode steps on the same module.

What transformers does with a static cache (5.x, read from its code):
- each full-attention layer's StaticLayer keeps keys/values [B, HKV, max_cache_len, D] and
  writes a step's tokens at its `cumulative_length` (a device scalar, the same for every
  sequence), then hands the attention function the whole cache: k/v [B, HKV, L, D], of
  which only the first cumulative_length positions are written;
- the mask function is called with kv_length = L, kv_offset 0 and q_offset = the cache's
  cumulative_length before the step (a tensor, "to avoid graph breaks"; the int 0 before the
  cache's first write) and the 2D padding mask [B, seen + Nq] (or None);
- generate() calls the mask function once per step outside the model (prepare_inputs_for_
  generation, never compiled) and hands its result to the model, which calls it again; with a
  static cache on a GPU it compiles the model's forward (mode "reduce-overhead": CUDA graphs).

The "attngen" mask function turns such a call into `CacheLengths`: the number of written keys
of each sequence, q_offset + Nq, computed on the device. The attention function then runs a
step of at most the decode module's query tokens on a generated decode module (contiguous
cache, nothing appended: the layer wrote the step's keys already) with those lengths as
cache_seqlens; no device value is read on the host. The decode kernel attends to keys
[0, cache_seqlens[b]), so a sequence's keys must start at 0: a padding mask with any padded
position (left padding) is not a CacheLengths, and the step takes the varlen route (exact,
unpadded with a host read, as transformers' flash-attention path does).

A DynamicCache hands the layer exactly its written keys [B, HKV, Nk, D] and the mask
function kv_length = q_offset + Nq with q_offset an int. A step after its prefill (q_offset
> 0) with no padded position gets CacheLengths too, every length Nk and `all_written` set, so
that it runs on a decode module when one serves it (each KV head read once, where the
prefill kind reads it once per query head) and otherwise on the prefill kind as before; the
lengths are one torch.full per mask-function call, shared by the layers.

Whether a padding mask pads anything is device data. The mask function reads it on the host
only where transformers' flash-attention mask function does (`attention_mask.all()`), and not
while compiling or capturing a CUDA graph: there a padding mask is kept as one (varlen
route). generate()'s first call of each step runs eagerly, so its steps reach the decode
module compiled or not; a forward compiled or captured by hand reaches it when it is given
no attention_mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attngen.runtime import arguments, decode_ops
from attngen.runtime.dispatch import Call, probe
from attngen.runtime.selection import Dispatch
from attngen.spec import KernelKind, KvLayout


class CacheLengths(NamedTuple):
    """What the mask function hands a layer of a static cache, or a dynamic cache's decode
    step, with no padded position: the keys each sequence has written, int32 [B] on the device
    (the cache's first positions). all_written: the layer's keys are exactly those (a dynamic
    cache), so a step no decode module serves is plain attention over them."""

    seqlens: Tensor
    all_written: bool = False

    @property
    def ndim(self) -> int:
        """1: transformers converts a mask it is handed back with ndim == 2 to bool, and reads
        ndim of it (generate() hands the model the mask function's answer)."""
        return 1


def cache_lengths(kwargs: dict) -> CacheLengths | None:
    """CacheLengths for a mask-function call that sizes a static cache's full-attention mask,
    or a dynamic cache's after its prefill (see the module docstring), with no padded
    position; None for any other call."""
    q_offset, q_length = kwargs.get("q_offset", 0), kwargs.get("q_length")
    kv_length, padding = kwargs.get("kv_length"), kwargs.get("attention_mask")
    if not (isinstance(q_length, int) and isinstance(kv_length, int)):
        return None
    if kwargs.get("local_size") is not None or kwargs.get("kv_offset", 0) != 0:
        return None  # sliding and chunked layers' caches do not start at position 0
    from transformers.masking_utils import causal_mask_function

    if kwargs.get("mask_function", causal_mask_function) is not causal_mask_function:
        return None  # a mask with more than causality and padding (image tokens, packing)
    if isinstance(q_offset, Tensor):
        if q_offset.numel() != 1:
            return None
    elif not isinstance(q_offset, int) or kv_length < q_offset + q_length:
        return None
    elif kv_length == q_offset + q_length and q_offset == 0:
        return None  # a dynamic cache's prefill (nothing cached before it): plain attention
    if isinstance(padding, CacheLengths):
        padding = None  # generate()'s first call said no padding; recomputed from the cache
    if padding is not None and not _pads_nothing(padding):
        return None
    batch = kwargs.get("batch_size")
    if not isinstance(batch, int):
        return None
    written = q_offset + q_length
    if isinstance(written, Tensor):  # a static cache: how many are written is device data
        seqlens = written.reshape(1).to(torch.int32).expand(batch).contiguous()
        return CacheLengths(seqlens)
    seqlens = torch.full((batch,), written, dtype=torch.int32, device=kwargs.get("device"))
    return CacheLengths(seqlens, all_written=written == kv_length)


def _pads_nothing(padding) -> bool:
    """Whether a 2D padding mask keeps every position: read on the host, as transformers'
    flash_attention_mask does, except while compiling or capturing (then False: kept)."""
    if not isinstance(padding, Tensor) or padding.dim() != 2:
        return False
    if torch.compiler.is_compiling():
        return False
    if padding.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return bool(padding.all())


def decode_module(query, key, value, common: Call) -> Dispatch | None:
    """The decode-kind module (contiguous cache) that serves a static-cache step of these
    tensors and options, recorded (last_dispatch), or None: then the varlen route serves it.
    Decode is forward-only: dropout and inputs that need a gradient take the varlen route."""
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value) if t is not None
    )
    if common.dropout_p or needs_grad:
        return None
    lengths = (query.shape[2], key.shape[2])
    need = common.need(
        KernelKind.decode, query, value, lengths, False, kv_layout=KvLayout.contiguous
    )
    return probe("transformers", need, (query.shape[1], key.shape[1]))


def run_decode_module(decode: Dispatch, query, key, value, lengths: CacheLengths, common):
    """out [B, Nq, HQ, DV] contiguous from the decode module: q [B, HQ, Nq, D] and the whole
    static cache [B, HKV, L, D] read in place, cache_seqlens the written keys, no append."""
    assert decode.key is not None  # probe() answers served dispatches only
    out, _ = decode_ops.decode(
        decode.key,
        query,
        key,
        value,
        lengths.seqlens,
        None,
        None,
        None,
        arguments.softmax_scale(common.scale, query),
        None,
        False,
        heads_last=True,
        sinks=common.sinks,
    )
    return out


def valid_keys(lengths: CacheLengths, seqlen_k: int) -> Tensor:
    """The padding mask [B, L] of the lengths: key j of sequence b kept when j < seqlens[b]."""
    positions = torch.arange(seqlen_k, device=lengths.seqlens.device)
    return positions[None, :] < lengths.seqlens[:, None]
