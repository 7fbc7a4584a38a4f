"""torch.library custom ops around the generated entry points (namespace `attngen`).

Each op takes the module key chosen by dispatch (a string: selection happens outside the op,
so a compiled graph holds a fixed module) and calls that module's entry point. Fake
implementations give the output and LSE shapes, so torch.compile(fullgraph=True) traces
through the ops without running a kernel. The LSE is always an output (an empty tensor when
not asked for): an op's outputs cannot be optional.

    attngen::prefill  q [B, HQ, M, D], k/v [B, HKV, N, D]  -> out [B, HQ, M, DV], lse [B, HQ, M]
    attngen::varlen   q [Tq, HQ, D], k/v [Tk, HKV, D]       -> out [Tq, HQ, DV], lse [HQ, Tq]
    attngen::decode   q [B, HQ, Nq, D], caches contiguous [B, HKV, L, D] or paged
                      [pages, page_size, HKV, D]; appends k_new/v_new into the caches in
                      place (mutates_args) -> out [B, HQ, Nq, DV], lse [B, HQ, Nq]

`run_counts()` counts the kernel calls per module, including calls from compiled graphs.

The kernels are forward-only: backward through any op raises an error that says so (instead
of torch's "no autograd formula"). prefill and varlen register that as their autograd
formula; decode mutates its caches, which torch allows no formula for, so `decode()` wraps its
outputs in a function whose backward raises the same error.
"""

from __future__ import annotations

import collections
import threading

import torch
from torch import Tensor

from attngen.runtime.registry import current_registry

_counts: collections.Counter[str] = collections.Counter()
_counts_lock = threading.Lock()


def _ran(key: str) -> None:
    with _counts_lock:
        _counts[key] += 1


def run_counts() -> dict[str, int]:
    """{module key: number of kernel calls} since the last reset_run_counts()."""
    with _counts_lock:
        return dict(_counts)


def reset_run_counts() -> None:
    with _counts_lock:
        _counts.clear()


def _no_lse(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("attngen::prefill", mutates_args=())
def prefill(key: str, q: Tensor, k: Tensor, v: Tensor, sm_scale: float,
            alibi_slopes: Tensor | None, return_lse: bool) -> tuple[Tensor, Tensor]:
    module = current_registry().module(key)
    _ran(key)
    result = module.attention(q, k, v, sm_scale=sm_scale, alibi_slopes=alibi_slopes,
                              return_lse=return_lse)
    return result if return_lse else (result, _no_lse(q))


@prefill.register_fake
def _(key, q, k, v, sm_scale, alibi_slopes, return_lse):
    batch, heads, seqlen_q, _ = q.shape
    out = q.new_empty((batch, heads, seqlen_q, v.shape[-1]))
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return out, lse


@torch.library.custom_op("attngen::varlen", mutates_args=())
def varlen(key: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, sm_scale: float,
           alibi_slopes: Tensor | None, seqused_k: Tensor | None,
           return_lse: bool) -> tuple[Tensor, Tensor]:
    module = current_registry().module(key)
    _ran(key)
    result = module.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, sm_scale=sm_scale, alibi_slopes=alibi_slopes,
                                     return_lse=return_lse, seqused_k=seqused_k)
    return result if return_lse else (result, _no_lse(q))


@varlen.register_fake
def _(key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sm_scale,
      alibi_slopes, seqused_k, return_lse):
    total_q, heads, _ = q.shape
    out = q.new_empty((total_q, heads, v.shape[-1]))
    lse = q.new_empty((heads, total_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return out, lse


@torch.library.custom_op("attngen::decode", mutates_args=("k_cache", "v_cache"))
def decode_op(key: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
           block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None,
           sm_scale: float, alibi_slopes: Tensor | None,
           return_lse: bool) -> tuple[Tensor, Tensor]:
    """The decode kind's `decode` entry point (the README's decode contract); appends
    k_new/v_new into the caches at cache_seqlens, in place, before attending."""
    module = current_registry().module(key)
    _ran(key)
    result = module.decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                           k_new=k_new, v_new=v_new, sm_scale=sm_scale,
                           alibi_slopes=alibi_slopes, return_lse=return_lse)
    return result if return_lse else (result, _no_lse(q))


@decode_op.register_fake
def _(key, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sm_scale,
      alibi_slopes, return_lse):
    batch, heads, seqlen_q, _ = q.shape
    out = q.new_empty((batch, heads, seqlen_q, v_cache.shape[-1]))
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return out, lse


def decode(key, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sm_scale,
           alibi_slopes, return_lse) -> tuple[Tensor, Tensor]:
    """attngen::decode, with outputs whose backward raises (see the module's docstring)."""
    out, lse = decode_op(key, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                         sm_scale, alibi_slopes, return_lse)
    inputs = (q, k_cache, v_cache, k_new, v_new)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        out, lse = _ForwardOnly.apply(out, lse)
    return out, lse


def _refuse_backward(op: str):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"attngen::{op}: the generated kernels are forward-only (inference): no backward "
            "kernel exists yet, so gradients cannot flow through attngen attention; train "
            "with another attention implementation (torch SDPA, flash-attn)")
    return backward


class _ForwardOnly(torch.autograd.Function):
    """Identity on decode's outputs whose backward raises; marks them as needing grad."""

    @staticmethod
    def forward(ctx, out, lse):
        return out.view_as(out), lse.view_as(lse)

    backward = staticmethod(_refuse_backward("decode"))


torch.library.register_autograd("attngen::prefill", _refuse_backward("prefill"))
torch.library.register_autograd("attngen::varlen", _refuse_backward("varlen"))
