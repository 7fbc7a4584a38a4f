"""context_parallel_attention: each rank's shard of exact attention over a sequence split
across the ranks of a torch.distributed group (NCCL on GPUs, gloo on CPUs), by one of
    ring       K/V shards around the ring, overlapped with the kernels, partials merged through
               their LSE; once per group of KV heads (ring_head_groups) for long sequences;
    allgather  K/V gathered once, one call per query chunk over every key it sees: any mask;
    auto       allgather when the ring cannot express the mask, or when the gathered K/V
               takes no more memory than the ring's buffers (or <= 64 MiB); else ring.
docs/context_parallel.md has the arithmetic behind the choice.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attngen.distributed import backward, execute, plan
from attngen.distributed.layout import check_layout, rank_chunks
from attngen.distributed.plan import ALIGNS, KernelCall, MaskRule, PlanError
from attngen.runtime.dispatch import Call, get_fallback
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import mismatches
from attngen.spec import CausalAlign, KernelKind, Mask

STRATEGIES = ("auto", "ring", "allgather")
SHORT_KV_BYTES = 64 * 2**20  # gathered K/V below this is "a short sequence": gather it
# The ring's fp32 accumulator of one head group may take this much; past it (long sequences)
# the ring goes around once per group of KV heads (docs/context_parallel.md, "Memory").
RING_ACCUMULATOR_BYTES = 2**30


@dataclass(frozen=True)
class ContextParallelPlan:
    """What one call ran on this rank: the strategy, why, and the kernel calls per step."""

    strategy: str
    reason: str
    layout: str
    world_size: int
    rank: int
    seq_len: int
    rule: MaskRule
    steps: tuple[tuple[KernelCall, ...], ...]  # ring: one per step; allgather: one
    head_groups: int = 1  # ring: trips around the ring, one per group of KV heads
    backward_head_groups: int = 1  # the ring's backward: the same, for its accumulators

    def describe(self) -> str:
        groups = f", {self.head_groups} head groups" if self.head_groups > 1 else ""
        if self.backward_head_groups > 1:
            groups += f", backward in {self.backward_head_groups}"
        lines = [
            f"{self.strategy} ({self.reason}); rank {self.rank} of {self.world_size}, "
            f"{self.layout}, N = {self.seq_len}, mask {self.rule.describe()}{groups}"
        ]
        for i, calls in enumerate(self.steps):
            text = "; ".join(c.describe() for c in calls) or "nothing"
            lines.append(f"  step {i}: {text}")
        return "\n".join(lines)


_last: ContextParallelPlan | None = None


def last_plan() -> ContextParallelPlan | None:
    """The plan of this process's most recent context_parallel_attention call."""
    return _last


@torch.compiler.disable
def context_parallel_attention(q, k, v, *, causal=False, window=None, softcap=0.0,
                               alibi_slopes=None, sm_scale=None, group=None,
                               layout="zigzag", strategy="auto", seq_len=None,
                               return_lse=False, ring_head_groups=None):  # fmt: skip
    """This rank's shard of attention over the whole sequence (docs/context_parallel.md).

    q [B, Hq, n, D], k [B, Hkv, n, D], v [B, Hkv, n, Dv]: this rank's n tokens of the sequence,
    as `shard_sequence` cuts them for `layout` ("zigzag": chunks r and 2W - 1 - r of 2W;
    "contiguous": chunk r of W). seq_len is the full length (default W x n; give it when the
    shards differ in length). causal (j <= i), window=(left, right) (i - left <= j <= i + right,
    with causal=False), softcap, alibi_slopes ([Hq] fp32, bias -slope |i - j| in global
    positions) and sm_scale as in attngen.scaled_dot_product_attention. Every rank of `group`
    must call it with the same arguments but its own shard. Returns out [B, Hq, n, Dv] in q's
    dtype, and with return_lse the LSE [B, Hq, n] fp32 (-inf where a row sees no key).
    Differentiable in q, k and v (and through the LSE) when modules built with `backward: true`
    serve every call (backward.py); alibi_slopes get no gradient. Under torch.compile the
    call runs eagerly. ring_head_groups: how many groups of KV heads the ring computes one
    after another (`_head_groups`); the result is the same bit for bit.
    """
    scale = _check_inputs(q, k, v, causal, window, softcap, alibi_slopes, sm_scale, strategy)
    _check_head_groups(ring_head_groups, k.shape[1])  # before any communication, as the rest
    rule = _mask_rule(causal, window, alibi_slopes)
    world, rank = _world_and_rank(group)
    seq_len = _check_length(q, world, rank, check_layout(layout), seq_len)
    chunks = rank_chunks(seq_len, world, layout)
    options = execute.KernelOptions(float(softcap or 0.0), alibi_slopes, scale)
    trains = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    aligns = _served_aligns(q, v, rule, options, trains)
    chosen, reason, all_calls, steps = _choose(
        strategy, rule, seq_len, world, layout, aligns, rank, q, k, v
    )
    execute.check_served(all_calls, q, v, options)
    groups = _head_groups(ring_head_groups, q, v, chunks) if chosen == "ring" else (1, 1)
    plan_steps = _record(chosen, reason, layout, world, rank, seq_len, rule, steps, groups)
    run = _forward(chosen, q, k, v, steps, chunks, seq_len, group, options, groups[0])
    if trains:
        # Before any communication, as the forward's check: every rank refuses together.
        execute.check_served(all_calls, q, v, options, backward=True)
        problem = backward.Problem(
            chosen, plan_steps, tuple(all_calls), tuple(chunks), seq_len, group, options, groups[1]
        )
        out, lse = backward.ContextParallelAttention.apply(run, problem, q, k, v)
    else:
        out, lse = run()
    return (out, lse) if return_lse else out


def _world_and_rank(group) -> tuple[int, int]:
    """The group's size and this process's rank in it; RuntimeError saying how to start
    torch.distributed when it is not initialized."""
    if not dist.is_initialized():
        raise RuntimeError(
            "context_parallel_attention: torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first (one process "
            "works too: backend 'gloo', store=dist.HashStore(), world_size=1)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def _record(chosen, reason, layout, world, rank, seq_len, rule, steps, groups):
    """The steps as tuples, after recording the plan for last_plan()."""
    global _last
    plan_steps = tuple(tuple(s) for s in steps)
    _last = ContextParallelPlan(
        chosen, reason, layout, world, rank, seq_len, rule, plan_steps, *groups
    )
    return plan_steps


def _head_groups(asked, q, v, chunks) -> tuple[int, int]:
    """How many groups of KV heads the ring's forward and its backward compute one after
    another, each going around the ring once with its own fp32 accumulators and K/V in
    flight: `asked` (an int from 1 to Hkv, checked) for both, or for None the fewest groups
    whose accumulators fit RING_ACCUMULATOR_BYTES (one for short sequences), the same on every
    rank (from the longest shard). More groups hold less memory and exchange more, smaller
    messages (docs/context_parallel.md, "Memory")."""
    if asked is not None:
        return asked, asked
    longest = max(sum(c.length for c in rank) for rank in chunks)
    auto = functools.partial(execute.auto_head_groups, q, v, longest, RING_ACCUMULATOR_BYTES)
    return auto(False), auto(True)


def _check_head_groups(asked, num_kv_heads: int) -> None:
    if asked is not None and (
        isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= num_kv_heads
    ):
        raise ValueError(
            f"ring_head_groups: got {asked!r}; allowed: None or an int from 1 to the "
            f"{num_kv_heads} KV heads"
        )


def _forward(chosen, q, k, v, steps, chunks, seq_len, group, options, head_groups=1):
    """The forward of the chosen strategy as a function of no arguments, returning (out, lse):
    what the autograd function runs (and records around) when the call trains."""

    def run():
        if q.shape[0] == 0 or seq_len == 0:
            out = q.new_zeros(*q.shape[:3], v.shape[-1])
            return out, torch.full(q.shape[:3], float("-inf"), device=q.device)
        if chosen == "ring":
            lengths = [sum(c.length for c in r) for r in chunks]
            return execute.ring_attention(q, k, v, steps, lengths, group, options, head_groups)
        return execute.gather_attention(q, k, v, steps[0], chunks, group, options)

    return run


def _choose(strategy, rule, seq_len, world, layout, aligns, rank, q, k, v):
    """(strategy, reason, every rank's calls, this rank's steps) for the asked strategy."""
    ring, ring_error = None, None
    if strategy in ("auto", "ring"):
        try:
            ring = _ring_plan(rule, seq_len, world, layout, aligns)
        except PlanError as err:
            ring_error = err
    if strategy == "ring":
        if ring is None:  # the plan failed with ring_error
            raise ValueError(
                f"strategy: 'ring' cannot compute this attention: {ring_error}; "
                "strategy='allgather' can (one call per chunk over its whole key "
                "range)"
            ) from None
        return "ring", "asked", _flat(ring), ring[rank]
    if strategy == "allgather":
        reason = "asked"
    elif ring is None:  # strategy auto, and the plan failed with ring_error
        reason = f"the ring cannot: {ring_error}"
    else:
        gathered, ring_bytes = _memory(q, k, v, rank_chunks(seq_len, world, layout), seq_len)
        if gathered > max(ring_bytes, SHORT_KV_BYTES):
            why = f"({gathered} B) would exceed the ring's buffers ({ring_bytes} B) and"
            return "ring", f"gathered K/V {why} {SHORT_KV_BYTES} B", _flat(ring), ring[rank]
        reason = (
            f"gathered K/V ({gathered} B) within max(ring buffers {ring_bytes} B, "
            f"{SHORT_KV_BYTES} B)"
        )
    gather = _gather_plan(rule, seq_len, world, layout, aligns)
    return "allgather", reason, [c for calls in gather for c in calls], [gather[rank]]


@functools.lru_cache(maxsize=64)
def _ring_plan(rule, seq_len, world, layout, aligns):
    """plan.ring_plan, once per shape of problem (a model calls with the same one per layer)."""
    return plan.ring_plan(rule, rank_chunks(seq_len, world, layout), aligns)


@functools.lru_cache(maxsize=64)
def _gather_plan(rule, seq_len, world, layout, aligns):
    return plan.gather_plan(rule, rank_chunks(seq_len, world, layout), seq_len, aligns)


def _flat(ring_plan) -> list[KernelCall]:
    return [c for rank in ring_plan for step in rank for c in step]


def _memory(q, k, v, chunks, seq_len) -> tuple[int, int]:
    """(bytes of the gathered K/V, bytes the ring holds in one head group: two K/V shards and
    the fp32 accumulator), from the longest shard."""
    batch, heads_q, heads_kv = q.shape[0], q.shape[1], k.shape[1]
    per_token = batch * heads_kv * (k.shape[-1] + v.shape[-1]) * k.element_size()
    longest = max(sum(c.length for c in rank) for rank in chunks)
    accumulator = batch * heads_q * longest * v.shape[-1] * 4
    return seq_len * per_token, 2 * longest * per_token + accumulator


def _served_aligns(q, v, rule: MaskRule, options, trains: bool) -> tuple[str, ...]:
    """The alignments (of ALIGNS, in order) that a generated module serves for this mask with
    Nq != Nk: with trains, those a module with gradient kernels serves, or when none does,
    those the forward's modules serve (so that the refusal names the missing gradient
    kernels); all of them when no module serves any (dispatch then names what is missing) or
    when the fallback mode lets torch run the forward and nothing needs gradients."""
    if rule.mask == "none" or (get_fallback() != "error" and not trains):
        return ALIGNS
    entries = current_registry().entries

    def served(backward: bool) -> tuple[str, ...]:
        found = []
        for align in ALIGNS:
            mask = (Mask(rule.mask), CausalAlign(align), rule.window)
            call = Call(*mask, options.softcap, options.alibi_slopes)
            lengths = (2**30, 2**30 + 1)
            need = call.need(KernelKind.prefill, q, v, lengths, False, backward=backward)
            if any(not mismatches(e, need) for e in entries):
                found.append(align)
        return tuple(found)

    return (trains and served(True)) or served(False) or ALIGNS


def _mask_rule(causal, window, alibi_slopes) -> MaskRule:
    alibi = alibi_slopes is not None
    if window is not None:
        ok = (
            isinstance(window, (tuple, list))
            and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)
        )
        if not ok:
            raise ValueError(f"window: got {window!r}; allowed: (left, right), ints >= 0")
        return MaskRule("sliding_window", (int(window[0]), int(window[1])), alibi)
    return MaskRule("causal" if causal else "none", None, alibi)


def _check_inputs(q, k, v, causal, window, softcap, alibi_slopes, sm_scale, strategy) -> float:
    """The softmax scale, after checking every argument that needs no communication."""
    _check_tensors(q, k, v)
    if not isinstance(causal, bool):
        raise ValueError(f"causal: got {causal!r}; allowed: True or False")
    if window is not None and causal:
        raise ValueError(
            "causal: must be False with window=(left, right); the window says "
            "which keys each query sees (right=0 is causal)"
        )
    if not (_finite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: got {softcap!r}; allowed: a finite float >= 0")
    if alibi_slopes is not None and not (
        isinstance(alibi_slopes, torch.Tensor)
        and alibi_slopes.shape == (q.shape[1],)
        and alibi_slopes.dtype == torch.float32
        and alibi_slopes.device == q.device
    ):
        got = (
            f"{tuple(alibi_slopes.shape)} {alibi_slopes.dtype} on {alibi_slopes.device}"
            if isinstance(alibi_slopes, torch.Tensor)
            else type(alibi_slopes).__name__
        )
        raise ValueError(
            f"alibi_slopes: got {got}; allowed: a float32 tensor [{q.shape[1]}] on {q.device}"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: got {strategy!r}; allowed: {', '.join(map(repr, STRATEGIES))}")
    if sm_scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if not (_finite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale: got {sm_scale!r}; allowed: a finite float > 0 or None")
    return float(sm_scale)


def _finite(x) -> bool:
    """Whether x is a finite int or float (a bool is not)."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _check_length(q, world, rank, layout, seq_len) -> int:
    """The full length, after checking that this rank holds the tokens the layout gives it."""
    local = q.shape[2]
    if seq_len is None:
        seq_len = world * local
    elif isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len: got {seq_len!r}; allowed: an int >= 0 or None")
    chunks = rank_chunks(seq_len, world, layout)[rank]
    expected = sum(c.length for c in chunks)
    if local != expected:
        raise ValueError(
            f"q: rank {rank} holds {local} tokens, but layout {layout!r} over {world} ranks of "
            f"a {seq_len}-token sequence gives it {expected} (chunks "
            f"{', '.join(c.describe() for c in chunks)}); cut shards with shard_sequence and "
            "pass seq_len when they differ in length"
        )
    return seq_len


def _check_tensors(q, k, v) -> None:
    """q, k, v: rank-4 tensors of one dtype and device, with the same batch and shard length,
    k and v the same heads, and q's heads a multiple of theirs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a rank-4 tensor [B, H, n, D], got {got}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name}: expected {q.dtype} on {q.device} (as q), got {t.dtype} on {t.device}"
            )
    if not (
        q.shape[0] == k.shape[0] == v.shape[0]
        and q.shape[2] == k.shape[2] == v.shape[2]
        and k.shape[1] == v.shape[1]
    ):
        raise ValueError(
            f"q, k, v: expected the same batch and shard length and k, v the same "
            f"heads, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"heads: expected q heads a multiple of k/v heads, got {q.shape[1]} and {k.shape[1]}"
        )
