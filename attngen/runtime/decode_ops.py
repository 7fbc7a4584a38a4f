"""The decode kind's calls: its entry point directly in eager mode, the `attngen::decode`
custom op (which appends into the caches: mutates_args) under torch.compile or for inputs
that need a gradient; see ops.py's docstring for the layout conventions. Decode has no
autograd formula (torch allows none for an op that mutates its inputs): its outputs are
wrapped in a function whose backward raises that decode is forward-only."""

from __future__ import annotations

import torch
from torch import Tensor

from attngen.runtime.kvcache_options import given_keywords, rotary_keywords
from attngen.runtime.ops import _direct, _heads_last, _no_lse, _sinks, count_run
from attngen.runtime.registry import current_registry

# --------------------------------------------------------------------------------- decode


def call_decode(
    module, key: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
    block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None, sm_scale: float,
    alibi_slopes: Tensor | None, return_lse: bool, heads_last: bool,
    sinks: Tensor | None = None, num_splits: int = 0, rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None, rotary_interleaved: bool = True,
    rotary_q_per_token: bool = False, flash_layout: bool = False,
    k_descale: Tensor | None = None, v_descale: Tensor | None = None,
    tree_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The decode kind's `decode` entry point of `module` (docs/generated_modules.md), which
    appends k_new/v_new into the caches at cache_seqlens, in place, before attending: (out,
    lse or None); out [B, Nq, HQ, DV] with heads_last, else [B, HQ, Nq, DV]. num_splits: the
    module's (0: its split rule). rotary_*: the module's rotary embedding of q and the new keys
    (ACCEPTS_ROTARY modules); k_descale/v_descale: an fp8 cache's (kv_dtype modules);
    tree_mask: the draft tree's (each keyword passed only when given, as sinks, since other
    modules do not take them).
    flash_layout (with heads_last): q, the caches
    (paged ones as always) and k_new/v_new in flash-attn's [B, N, H, D] layout, handed to its
    decode_flash as they are."""
    count_run(key)
    extra = {**_sinks(sinks), **_splits(num_splits)}
    if rotary_cos is not None or rotary_sin is not None:  # (modules with ACCEPTS_ROTARY)
        extra.update(
            rotary_keywords(rotary_cos, rotary_sin, rotary_interleaved, rotary_q_per_token)
        )
    extra.update(given_keywords(k_descale, v_descale, tree_mask))
    # flash_layout: its callers' promise (heads_last)
    entry = module.decode_flash_out if heads_last else module.decode  # out [B, Nq, HQ, DV]
    entry = module.decode_flash if flash_layout else entry
    result = entry(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new,
        sm_scale=sm_scale, alibi_slopes=alibi_slopes, return_lse=return_lse, **extra,
    )  # fmt: skip
    return result if return_lse else (result, None)


def _splits(num_splits: int) -> dict[str, int]:
    """decode's num_splits keyword, only when one is asked for (0 is every module's default)."""
    return {"num_splits": num_splits} if num_splits else {}


def decode(
    key: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
    block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None, sm_scale: float,
    alibi_slopes: Tensor | None, return_lse: bool, heads_last: bool = False,
    sinks: Tensor | None = None, num_splits: int = 0, rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None, rotary_interleaved: bool = True,
    rotary_q_per_token: bool = False, flash_layout: bool = False,
    k_descale: Tensor | None = None, v_descale: Tensor | None = None,
    tree_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """(out, lse or None) of the decode module `key`; see the module docstring. Directly,
    the caches' version counters are bumped as the op's mutates_args would. flash_layout: q,
    the caches and k_new/v_new come in flash-attn's layout (flash_attn_with_kvcache's: see
    heads_first), handed as they are to the module's decode_flash on a direct call with
    heads_last, else as [B, H, N, D] views."""
    news = (k_new, v_new) if k_new is not None and v_new is not None else None
    direct = (
        _direct(q, k_cache, v_cache, alibi_slopes)
        and (news is None or _direct(q, news[0], news[1], None))
        and (sinks is None or _direct(q, k_cache, v_cache, sinks))
        and (
            rotary_cos is None
            or (rotary_sin is not None and _direct(q, rotary_cos, rotary_sin, None))
        )
        and all(t is None or type(t) is Tensor for t in (k_descale, v_descale, tree_mask))
    )
    module = current_registry().module(key) if direct else None
    if flash_layout and not (heads_last and direct):
        q, k_cache, v_cache, k_new, v_new = heads_first(
            q, k_cache, v_cache, k_new, v_new, block_table
        )
        flash_layout = False
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    options = (sm_scale, alibi_slopes, return_lse, heads_last, sinks, num_splits)
    rotary = (rotary_cos, rotary_sin, rotary_interleaved, rotary_q_per_token)
    descales = (k_descale, v_descale, tree_mask)
    if direct:
        return direct_decode(module, key, *tensors, *options, *rotary, flash_layout, *descales)
    out, lse = decode_op(key, *tensors, *options, *rotary, *descales)
    inputs = (q, k_cache, v_cache, k_new, v_new)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        out, lse = _ForwardOnly.apply(out, lse)
    return (out.transpose(1, 2) if heads_last else out), (lse if return_lse else None)


def heads_first(q, k_cache, v_cache, k_new, v_new, block_table):
    """decode()'s [B, H, N, D] views of flash-attn's [B, N, H, D] q, caches and new keys
    (paged caches, block_table given, as they are: their layout is decode()'s)."""
    if block_table is None:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    if k_new is not None:
        k_new, v_new = k_new.transpose(1, 2), v_new.transpose(1, 2)
    return q.transpose(1, 2), k_cache, v_cache, k_new, v_new


def direct_decode(module, key: str, *args, **keywords) -> tuple[Tensor, Tensor | None]:
    """call_decode(module, key, *args, **keywords) without the op: the caches' version
    counters (args[1:3]) are bumped after an append (k_new and v_new, args[5:7]), as the op's
    mutates_args would."""
    result = call_decode(module, key, *args, **keywords)
    if args[5] is not None and args[6] is not None:
        torch.autograd.graph.increment_version((args[1], args[2]))
    return result


@torch.library.custom_op("attngen::decode", mutates_args=("k_cache", "v_cache"))
def decode_op(
    key: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
    block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None, sm_scale: float,
    alibi_slopes: Tensor | None, return_lse: bool, heads_last: bool,
    sinks: Tensor | None = None, num_splits: int = 0, rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None, rotary_interleaved: bool = True,
    rotary_q_per_token: bool = False, k_descale: Tensor | None = None,
    v_descale: Tensor | None = None, tree_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    options = (sm_scale, alibi_slopes, return_lse, heads_last, sinks, num_splits)
    rotary = (rotary_cos, rotary_sin, rotary_interleaved, rotary_q_per_token)
    module = current_registry().module(key)
    descales = (k_descale, v_descale, tree_mask)
    out, lse = call_decode(module, key, *tensors, *options, *rotary, False, *descales)
    return (out.transpose(1, 2) if heads_last else out), (_no_lse(q) if lse is None else lse)


@decode_op.register_fake
def _(key, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sm_scale,
      alibi_slopes, return_lse, heads_last, *_):  # fmt: skip
    batch, heads, seqlen_q, _ = q.shape
    if heads_last:
        out = _heads_last(q, v_cache.shape[-1]).transpose(1, 2)
    else:
        out = q.new_empty((batch, heads, seqlen_q, v_cache.shape[-1]))
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return out, lse


# ------------------------------------------------------------------------ forward only


class _ForwardOnly(torch.autograd.Function):
    """Identity on decode's outputs whose backward raises; marks them as needing grad."""

    @staticmethod
    def forward(ctx, out, lse):
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "attngen::decode: decode is forward-only (it appends to its caches in place): "
            "gradients cannot flow through it; train through prefill or varlen modules built "
            "with backward: true"
        )
