"""Plans: an eager call's route, decided once per call signature and bound to its launch.

Everything the runtime decides between a public function's arguments and the module's entry
point (the Need, the module, its Dispatch, the softmax scale, the entry point) depends only on
the call's signature: shapes, q's dtype and device, the scalar options. The first eager call
of a signature takes the full path and, when a module served it, leaves a `Plan` (the bound
launch) under its key in the route cache (docs/architecture.md, "The caches"); a later call
with an equal key runs it: the checks its key does not decide (the other tensors' dtypes and
devices), the Dispatch recorded, the run counted, and the entry point called, which makes
its own checks on every call as always.

An equal key must mean that the full path would decide the same. So options enter a key with
their values, and only in their plain types (None, bool, float, str, a pair of ints): a call
with an option of another type (an int softcap, a numpy scale, a list window) takes the full
path, whose checks are type-sensitive. Values the full path checks on every call are checked
on every call here too, or send the call to the full path (an int cache_seqlens).

Never planned: fallbacks and refusals (they warn or raise on every call). Never run from a
plan: calls under torch.compile (the full path and the torch.library ops), tensor subclasses,
inputs that need a gradient but those of flash_attn_func, SDPA, varlen and the transformers
function (run_trained, run_varlen: the ops' eager autograd, `deterministic` in the key), and
a call whose device's answer may change (bf16 under the interpreter: problem_may_change).
Loading another registry starts the route cache over, plans with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from attngen.runtime import decode_ops, ops, registry, selection
from attngen.runtime.dispatch import device_problem, problem_may_change
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import Dispatch, keep, record, routes
from attngen.spec import KernelKind

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_NO_KEYWORDS: dict = {}  # (never written: a ** of no keywords)


@dataclass(frozen=True, slots=True)
class Plan:
    """What eager calls of one signature run (a bound launch): the module, its entry point, the
    Dispatch recorded for it, and what the full path computed for the signature."""

    dispatch: Dispatch  # the route cache's Dispatch (what the full path records)
    key: str  # the module's key (dispatch.key)
    module: ModuleType
    # The entry point of a [B, H, N, D] call: prefill's attention_flash_out in place, else
    # attention; varlen's attention_varlen; decode's (unused: decode_ops.direct_decode's)
    entry: Callable[..., Any] | None
    flash: Callable[..., Any] | None  # attention_flash or decode_flash, with flash_entry
    sm_scale: float
    return_lse: bool
    in_place: bool  # the module writes the caller's heads-last output (its out=)
    flash_entry: bool  # in place through attention_flash / decode_flash ([B, N, H, D] in, out)
    device_check: tuple[Any, ...] | None  # device_problem's arguments when asked at each run


# -------------------------------------------------------------------------- the signature


def grad_mode(q: Any, k: Any, v: Any, alibi_slopes: Any) -> bool | None:
    """How a call with these tensors may run from a plan: False without gradients, True with
    them (through the ops' eager autograd), None not at all (not plain tensors, compiling, or
    slopes that need a gradient: the full path)."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return None
    if (alibi_slopes is not None and type(alibi_slopes) is not Tensor) or _is_compiling():
        return None
    if not _grad_enabled():
        return False
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        return None
    return q.requires_grad or k.requires_grad or v.requires_grad


def plain(scale: Any, softcap: Any, dropout_p: Any = 0.0) -> bool:
    """scale and softcap None or floats, and no dropout (0 or 0.0): options a key may hold."""
    return (
        (scale is None or type(scale) is float)
        and (softcap is None or type(softcap) is float)
        and (type(dropout_p) is float or type(dropout_p) is int)
        and not dropout_p
    )


def pair(window: Any) -> bool:
    """A window given as a tuple of two ints (flash-attn's (-1, -1) default among them)."""
    return (
        type(window) is tuple
        and len(window) == 2
        and type(window[0]) is int
        and type(window[1]) is int
    )


def slopes_rank(alibi_slopes: Tensor | None) -> int:
    """The slopes' part of a key: their rank ([HQ] or [B, HQ]), -1 without slopes."""
    return -1 if alibi_slopes is None else alibi_slopes.dim()


def find(key: tuple | None) -> Plan | None:
    """The plan of a signature key in the registry in use's route cache, or None; both read,
    not asked (routes()): a planned call stays in this file until its module's entry point."""
    if key is None:
        return None
    held = selection._routes
    try:
        if held.registry is not None and held.registry is registry._current:
            return held.table.get(key)
        return routes(current_registry()).get(key)
    except TypeError:  # an unhashable value inside an option: the full path decides
        return None


def _ran(plan: Plan, count: bool = True) -> bool:
    """False when the device refuses now what it served (the full path says why); else True,
    with selection.record(plan.dispatch) and ops.count_run(plan.key) (`count`) done in this
    file, in the state those functions keep (the logs of dispatch_log through record)."""
    if plan.device_check is not None and device_problem(*plan.device_check) is not None:
        return False
    records = selection._records
    if records.logs:
        record(plan.dispatch)
    else:
        records.last = plan.dispatch
    if count:
        with ops._counts_lock:
            ops._counts[plan.key] += 1
    return True


def _attend(plan: Plan, entry: Any, q: Tensor, k: Tensor, v: Tensor, alibi_slopes, sinks) -> Any:
    """A prefill module's entry point with the plan's scale, LSE flag and the call's sinks."""
    extra = _NO_KEYWORDS if sinks is None else {"sinks": sinks}
    return entry(
        q, k, v, sm_scale=plan.sm_scale, alibi_slopes=alibi_slopes, return_lse=plan.return_lse,
        **extra,
    )  # fmt: skip


def planned(registry) -> dict[tuple, Plan]:
    """The plans in `registry`'s route cache, by signature key (what tests and tools count)."""
    return {key: plan for key, plan in routes(registry).items() if isinstance(plan, Plan)}


def remember(
    key: tuple | None, dispatch: Dispatch, sm_scale: float, return_lse: bool, in_place: bool
) -> None:
    """Keep the route the full path just took for `key`'s signature (in_place: it passed the
    module out=, the caller's heads-last output), from the Dispatch the route cache holds for
    the call's Need: when another registry chose (load_kernels replaced it meanwhile),
    nothing is kept."""
    if key is None or dispatch.key is None or _is_compiling():
        return
    registry = current_registry()
    cached = routes(registry).get((dispatch.api, dispatch.need))
    if cached is None or cached.key != dispatch.key:
        return
    need = cached.need
    check = (
        (cached.api, need.arch, need.dtype) if problem_may_change(need.arch, need.dtype) else None
    )
    module = registry.module(dispatch.key)
    flash_entry = in_place and need.kind in (KernelKind.prefill, KernelKind.decode)
    entry, flash = _entries(module, need.kind, in_place)
    plan = Plan(
        cached, dispatch.key, module, entry, flash, float(sm_scale), bool(return_lse), in_place,
        flash_entry, check,
    )  # fmt: skip
    try:
        keep(registry, key, plan)
    except TypeError:  # an unhashable value inside an option
        pass


def _entries(module: ModuleType, kind: KernelKind, in_place: bool) -> tuple[Any, Any]:
    """(the entry point of [B, H, N, D] tensors, the flash-layout one or None) of a module of
    `kind`: every prefill and decode module has its flash-layout entry points (the header
    check refuses modules of another attngen)."""
    if kind is KernelKind.varlen:
        return module.attention_varlen, None
    if kind is KernelKind.decode:
        return None, (module.decode_flash if in_place else None)
    if in_place:
        return module.attention_flash_out, module.attention_flash
    return module.attention, None


# ----------------------------------------------------------------------------------- runs


def run_dense(
    plan: Plan, q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Tensor | None, heads_last: bool,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None] | None:  # fmt: skip
    """launch.run_dense's module call from a plan (sinks: the call's, whose presence its key
    holds): the plan's entry point, attention_flash_out when it writes in place (out
    [B, N, H, D]); None when the device refuses now."""
    if not _ran(plan):
        return None  # the full path says why
    result = _attend(plan, plan.entry, q, k, v, alibi_slopes, sinks)
    out, lse = result if plan.return_lse else (result, None)
    if heads_last and not plan.in_place:  # the module wrote [B, H, N, D]: copied
        out = out.transpose(1, 2).contiguous()
    return out, lse


def run_flash(
    plan: Plan, q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Tensor | None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None] | None:  # fmt: skip
    """run_dense for q, k, v in flash-attn's [B, N, H, D] layout: handed as they are to the
    module's attention_flash when the plan writes in place through it (no view, no output
    allocation here, and no layer between: the run counted and the module called here), else
    as [B, H, N, D] views to run_dense."""
    if not plan.flash_entry:
        views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return run_dense(plan, *views, alibi_slopes, heads_last=True, sinks=sinks)
    if not _ran(plan):
        return None  # the full path says why
    result = _attend(plan, plan.flash, q, k, v, alibi_slopes, sinks)
    return result if plan.return_lse else (result, None)


def run_trained(
    plan: Plan, q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Tensor | None, deterministic: bool,
    flash: bool = True, heads_last: bool = True, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None] | None:  # fmt: skip
    """run_flash / run_dense for a call that trains: ops.prefill as launch.run_dense calls it."""
    if not _ran(plan, count=False):
        return None  # the full path says why
    if flash and plan.in_place:  # the module writes [B, N, H, D]
        return ops.prefill_flash(plan.key, q, k, v, plan.sm_scale, alibi_slopes,
                                 plan.return_lse, sinks, deterministic)  # fmt: skip
    views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)) if flash else (q, k, v)
    out, lse = ops.prefill(plan.key, *views, plan.sm_scale, alibi_slopes, plan.return_lse,
                           plan.in_place, sinks, deterministic=deterministic)  # fmt: skip
    copy = heads_last and not plan.in_place  # the module wrote [B, H, N, D]
    return (out.transpose(1, 2).contiguous() if copy else out), lse


def run_varlen(
    plan: Plan, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Tensor | None,
    deterministic: bool | None = None,
) -> tuple[Tensor, Tensor | None] | None:  # fmt: skip
    """launch.run_varlen's module call from a plan (trains: ops.varlen); None when refused."""
    if not _ran(plan, count=deterministic is None):
        return None  # the full path says why
    if deterministic is not None:
        return ops.varlen(
            plan.key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            plan.sm_scale, alibi_slopes, None, plan.return_lse, deterministic=deterministic,
        )  # fmt: skip
    entry = plan.entry
    assert entry is not None  # a varlen plan's attention_varlen
    result = entry(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sm_scale=plan.sm_scale,
        alibi_slopes=alibi_slopes, return_lse=plan.return_lse, seqused_k=None,
    )  # fmt: skip
    return result if plan.return_lse else (result, None)


def run_decode(
    plan: Plan, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
    block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None,
    alibi_slopes: Tensor | None, num_splits: int = 0, rotary: dict | None = None,
) -> tuple[Tensor, Tensor | None] | None:  # fmt: skip
    """decode_ops.decode's direct call from a plan: flash-attn's [B, N, H, D] tensors as they
    are to the module's decode_flash when the plan writes through it (flash_entry: no layer
    between, decode_ops.direct_decode's flash_layout call with its arguments known), else
    [B, H, N, D] views (heads-last output when the plan writes in place), with the call's
    num_splits (which its key holds too) and rotary keywords (kvcache_plan.planned_rotary);
    None when the device refuses now."""
    if not _ran(plan, count=plan.flash_entry):  # direct_decode counts its own run
        return None  # the full path says why
    if not plan.flash_entry:
        return decode_ops.direct_decode(
            plan.module, plan.key, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
            plan.sm_scale, alibi_slopes, plan.return_lse, plan.in_place, None, num_splits,
            **(rotary or _NO_KEYWORDS),
        )  # fmt: skip
    return _decode_flash(
        plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, alibi_slopes,
        num_splits, rotary,
    )  # fmt: skip


def _decode_flash(
    plan: Plan, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
    block_table: Tensor | None, k_new: Tensor | None, v_new: Tensor | None,
    alibi_slopes: Tensor | None, num_splits: int, rotary: dict | None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The module's decode_flash with the plan's scale and LSE flag (a module with it takes
    num_splits and rotary_*); the caches' version counters bumped after an append, as the
    op's mutates_args would."""
    entry = plan.flash
    assert entry is not None  # flash_entry's decode_flash
    result = entry(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new,
        sm_scale=plan.sm_scale, alibi_slopes=alibi_slopes, return_lse=plan.return_lse,
        num_splits=num_splits, **(rotary or _NO_KEYWORDS),
    )  # fmt: skip
    if k_new is not None and v_new is not None:
        torch.autograd.graph.increment_version((k_cache, v_cache))
    return result if plan.return_lse else (result, None)
