"""Calling a generated module's entry point: directly in eager mode, through torch.library
custom ops (namespace `attngen`) under torch.compile or autograd.

`prefill`, `varlen` and `decode` take the module key chosen by dispatch (a string: selection
happens outside the ops, so a compiled graph holds a fixed module). An eager call with no
input that needs a gradient calls the module's entry point itself: the op layer's own
dispatch costs tens of microseconds per call, more than the rest of a small call's host time.
Under torch.compile (and for inputs that need a gradient, or tensor subclasses) the call goes
through the op, whose fake implementation gives the output shapes and strides, so
torch.compile(fullgraph=True) traces through it without running a kernel. Either way
`run_counts()` counts the kernel calls per module, including calls from compiled graphs.

    attngen::prefill  q [B, HQ, M, D], k/v [B, HKV, N, D]  -> out [B, HQ, M, DV], lse [B, HQ, M]
    attngen::varlen   q [Tq, HQ, D], k/v [Tk, HKV, D]       -> out [Tq, HQ, DV], lse [HQ, Tq]
    attngen::decode   q [B, HQ, Nq, D], caches contiguous [B, HKV, L, D] or paged
                      [pages, page_size, HKV, D]; appends k_new/v_new into the caches in
                      place (mutates_args) -> out [B, HQ, Nq, DV], lse [B, HQ, Nq]

`heads_last` (prefill, decode): the module writes a contiguous [B, M, HQ, DV] output
(flash-attn's layout) in place: through its `attention_flash_out` or `decode_flash_out` entry
point, which allocates that output itself (or `attention_flash` / `decode_flash`, which take
flash-attn's [B, N, H, D] tensors as they are: plans.run_flash and decode_ops' flash_layout);
every module of the running attngen has them (the registry's header check). Callers ask for
it only from a module that takes `out=` (Dispatch.writes_out). `prefill` and `decode` then
return that [B, M, HQ, DV] tensor; the ops return the view (an op's output has the shape its
fake implementation gives). The LSE is always an op output (an empty tensor when not asked
for): an op's outputs cannot be optional; the functions here return None instead.

prefill and varlen have an autograd formula (backward_ops.py), so torch.compile(fullgraph=True)
traces forward and backward; through the ops the forward always computes the LSE the backward
needs. With dropout_p > 0 (a module built with dropout: true) the call's Philox state,
rng_state, is an input of the op, saved for its backward, which so regenerates the forward's
mask; so is `deterministic` (the backward's path: False adds dQ by atomics, backward_ops.py).
Decode mutates its caches, which torch allows no formula for, so `decode()`
(decode_ops.py, the decode kind's calls and op) wraps its outputs in a function whose backward
raises that it is forward-only.
"""

from __future__ import annotations

import collections
import threading

import torch
from torch import Tensor

from attngen.runtime.registry import current_registry

_counts: collections.Counter[str] = collections.Counter()
_counts_lock = threading.Lock()


def count_run(key: str) -> None:
    """Count one kernel call of the module `key` (run_counts)."""
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


def _direct(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Tensor | None) -> bool:
    """Whether the module can be called without the op layer: eager mode, plain tensors and
    no autograd to record (the op's formula is what refuses backward)."""
    if torch.compiler.is_compiling():
        return False
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return False
    if torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (alibi_slopes is not None and alibi_slopes.requires_grad)
    ):
        return False
    return True


def _heads_last(q: Tensor, dim_v: int) -> Tensor:
    """An uninitialized contiguous [B, M, HQ, DV] tensor for q [B, HQ, M, D]."""
    batch, heads, rows, _ = q.shape
    return q.new_empty((batch, rows, heads, dim_v))


def _sinks(sinks: Tensor | None) -> dict[str, Tensor]:
    """The entry point's `sinks=` keyword, only for a module built with sinks (older modules'
    entry points do not take the keyword; dispatch matched the module to the call)."""
    return {} if sinks is None else {"sinks": sinks}


# -------------------------------------------------------------------------------- prefill


def _dropout_options(dropout_p: float, rng_state: Tensor | None) -> dict:
    """The module's dropout arguments: none without dropout (forward-only modules take none)."""
    return {"dropout_p": dropout_p, "rng_state": rng_state} if dropout_p else {}


def run_prefill(
    key: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    return_lse: bool,
    heads_last: bool,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(out, lse or None); out [B, M, HQ, DV] with heads_last (the module's
    attention_flash_out), else [B, HQ, M, DV] (its attention)."""
    module = current_registry().module(key)
    count_run(key)
    entry = module.attention_flash_out if heads_last else module.attention
    result = entry(
        q,
        k,
        v,
        sm_scale=sm_scale,
        alibi_slopes=alibi_slopes,
        return_lse=return_lse,
        **_sinks(sinks),
        **_dropout_options(dropout_p, rng_state),
    )
    return result if return_lse else (result, None)


def takes_flash_layout(module) -> bool:
    """Whether a prefill or decode module has its kind's entry points in flash-attn's layout
    (attention_flash and attention_flash_out, decode_flash and decode_flash_out): always,
    since the registry imports only modules of the running attngen's templates (its header
    check), which render them. Kept for decode_ops and kvcache, which still ask."""
    del module
    return True


def prefill(
    key: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    return_lse: bool,
    heads_last: bool = False,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """(out, lse or None) of the prefill module `key`; see the module docstring."""
    args = (sinks, dropout_p, rng_state)
    if _direct(q, k, v, alibi_slopes) and (sinks is None or _direct(q, k, v, sinks)):
        return run_prefill(key, q, k, v, sm_scale, alibi_slopes, return_lse, heads_last, *args)
    # The LSE is always computed here: the backward needs it.
    out, lse = prefill_op(
        key, q, k, v, sm_scale, alibi_slopes, True, heads_last, *args, deterministic
    )
    return (out.transpose(1, 2) if heads_last else out), (lse if return_lse else None)


@torch.library.custom_op("attngen::prefill", mutates_args=())
def prefill_op(
    key: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    return_lse: bool,
    heads_last: bool,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():  # the op's autograd formula records the backward, not the module
        out, lse = run_prefill(
            key,
            q,
            k,
            v,
            sm_scale,
            alibi_slopes,
            return_lse,
            heads_last,
            sinks,
            dropout_p,
            rng_state,
        )
    return (out.transpose(1, 2) if heads_last else out), (_no_lse(q) if lse is None else lse)


@prefill_op.register_fake
def _(
    key,
    q,
    k,
    v,
    sm_scale,
    alibi_slopes,
    return_lse,
    heads_last,
    sinks=None,
    dropout_p=0.0,
    rng_state=None,
    deterministic=True,
):
    batch, heads, seqlen_q, _ = q.shape
    if heads_last:
        out = _heads_last(q, v.shape[-1]).transpose(1, 2)
    else:
        out = q.new_empty((batch, heads, seqlen_q, v.shape[-1]))
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return out, lse


# --------------------------------------------------------------------------------- varlen


def run_varlen(
    key: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    seqused_k: Tensor | None,
    return_lse: bool,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    module = current_registry().module(key)
    count_run(key)
    result = module.attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        sm_scale=sm_scale,
        alibi_slopes=alibi_slopes,
        return_lse=return_lse,
        seqused_k=seqused_k,
        **_sinks(sinks),
        **_dropout_options(dropout_p, rng_state),
    )
    return result if return_lse else (result, None)


def varlen(
    key: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    seqused_k: Tensor | None,
    return_lse: bool,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """(out, lse or None) of the varlen module `key`; see the module docstring."""
    args = (
        key,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        sm_scale,
        alibi_slopes,
        seqused_k,
    )
    if _direct(q, k, v, alibi_slopes) and (sinks is None or _direct(q, k, v, sinks)):
        return run_varlen(*args, return_lse, sinks, dropout_p, rng_state)
    # the LSE is always computed: the backward needs it
    out, lse = varlen_op(*args, True, sinks, dropout_p, rng_state, deterministic)
    return out, (lse if return_lse else None)


@torch.library.custom_op("attngen::varlen", mutates_args=())
def varlen_op(
    key: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    seqused_k: Tensor | None,
    return_lse: bool,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():  # the op's autograd formula records the backward, not the module
        out, lse = run_varlen(
            key,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            sm_scale,
            alibi_slopes,
            seqused_k,
            return_lse,
            sinks,
            dropout_p,
            rng_state,
        )
    return out, (_no_lse(q) if lse is None else lse)


@varlen_op.register_fake
def _(
    key,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    sm_scale,
    alibi_slopes,
    seqused_k,
    return_lse,
    sinks=None,
    dropout_p=0.0,
    rng_state=None,
    deterministic=True,
):
    total_q, heads, _ = q.shape
    out = q.new_empty((total_q, heads, v.shape[-1]))
    lse = q.new_empty((heads, total_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return out, lse
