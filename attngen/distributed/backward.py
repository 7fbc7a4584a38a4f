"""The backward of context_parallel_attention: dQ, dK, dV across ranks, from the forward's plan.

Given the whole sequence's out and LSE, a generated gradient kernel computes the exact share
of dQ, dK and dV that one chunk pair contributes (docs/context_parallel.md, "Backward", has
the algebra): each kernel call of the forward's plan (rows, keys, mask, alignment and fake
rows, so every pair's visibility and offset are the forward's) runs once more through the
gradient kernels (run_dense_backward, recorded by dispatch); fake rows get LSE -inf, output 0
and dO 0. The shares are summed in fp32:

    ring       dQ stays on its rank; a shard's dK/dV travel with it around the ring, each rank
               adding its share (overlapped with the next step's kernels), and one more send
               brings them to their owner. One group of KV heads at a time (`head_groups`),
               each group's result cast into its place in dq, dk, dv.
    allgather  K/V gathered again, dK/dV of the whole sequence in fp32, reduce-scattered.

ALiBi slopes get no gradient (as in flash-attn). Every rank checks, before any communication,
that a module with gradient kernels serves every rank's calls (`check_served(backward=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from attngen.distributed import execute
from attngen.distributed.execute import KernelOptions
from attngen.distributed.layout import Chunk
from attngen.distributed.plan import KernelCall
from attngen.runtime.launch import run_dense_backward


@dataclass(frozen=True)
class Problem:
    """What the backward needs of the forward besides its tensors: the strategy and its plan."""

    strategy: str  # ring | allgather
    steps: tuple[tuple[KernelCall, ...], ...]  # this rank's calls: ring per step, allgather one
    every_call: tuple[KernelCall, ...]  # every rank's, checked before any communication
    chunks: tuple[tuple[Chunk, ...], ...]
    seq_len: int
    group: dist.ProcessGroup | None
    options: KernelOptions
    head_groups: int = 1  # ring: trips around the ring, one per group of KV heads


class ContextParallelAttention(torch.autograd.Function):
    """(out, lse) = run(); backward: dq, dk, dv across ranks (the module docstring)."""

    @staticmethod
    def forward(ctx, run, problem: Problem, q, k, v):
        out, lse = run()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        problem: Problem = ctx.problem
        execute.check_served(list(problem.every_call), q, v, problem.options, backward=True)
        if q.shape[0] == 0 or problem.seq_len == 0 or (dout is None and dlse is None):
            return None, None, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = None if dlse is None else dlse.contiguous()
        saved = Saved(q, k, v, out, lse, dout, dlse)
        if problem.strategy == "ring":
            lengths = [sum(c.length for c in rank) for rank in problem.chunks]
            grads = ring_backward(saved, problem, lengths)
            return None, None, *grads
        dq, dk, dv = gather_backward(
            saved, problem.steps[0], list(problem.chunks), problem.group, problem.options
        )
        return None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@dataclass(frozen=True)
class Saved:
    """This rank's forward inputs and results, and the gradients of its results."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    dlse: torch.Tensor | None

    def heads(self, q_heads: slice, kv_heads: slice) -> Saved:
        """The tensors of some query heads and of their KV heads."""
        dlse = None if self.dlse is None else self.dlse[:, q_heads]
        q, out, lse, dout = (t[:, q_heads] for t in (self.q, self.out, self.lse, self.dout))
        return Saved(q, self.k[:, kv_heads], self.v[:, kv_heads], out, lse, dout, dlse)


def call_gradients(
    call: KernelCall, saved: Saved, k: torch.Tensor, v: torch.Tensor, options: KernelOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq of the call's real rows, dk, dv of its keys): one chunk pair's share, from the
    gradient kernels with the whole sequence's out and LSE of the call's rows."""
    dlse = None if saved.dlse is None else execute.call_rows(saved.dlse, call)
    dout, q, out = (execute.call_rows(t, call) for t in (saved.dout, saved.q, saved.out))
    lse, keys = execute.call_rows(saved.lse, call, float("-inf")), slice(*call.keys)
    kernel_call = execute.runtime_call(call, options)
    dq, dk, dv = run_dense_backward(
        execute.API_NAME, dout, q, k[:, :, keys], v[:, :, keys], out, lse, dlse, kernel_call
    )
    return execute.real_rows(dq, call), dk, dv


def add_gradients(calls, saved: Saved, k, v, options: KernelOptions, dq, dk, dv) -> None:
    """Each call's share added into the fp32 dq (this rank's rows) and dk, dv (rows of k, v)."""
    for call in calls:
        dq_part, dk_part, dv_part = call_gradients(call, saved, k, v, options)
        dq[:, :, call.rows[0] : call.rows[1]] += dq_part
        dk[:, :, call.keys[0] : call.keys[1]] += dk_part
        dv[:, :, call.keys[0] : call.keys[1]] += dv_part
        del dq_part, dk_part, dv_part  # before the next call's are allocated


def _fp32(x: torch.Tensor, length: int, zero: bool = True) -> torch.Tensor:
    make = torch.zeros if zero else torch.empty
    return make(*x.shape[:2], length, x.shape[3], dtype=torch.float32, device=x.device)


def ring_backward(saved: Saved, problem: Problem, lengths: list[int]):
    """(dq, dk, dv) in the inputs' dtypes, one group of KV heads (and their query heads) at a
    time: each group goes once around the ring (`ring_pass`) with fp32 accumulators of its
    own heads, then is cast into its place (fp32 inputs: dq accumulates in place)."""
    q, k, v = saved.q, saved.k, saved.v
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    comm_stream = torch.cuda.Stream(q.device) if q.is_cuda else None
    groups = execute.head_group_slices(problem.options, q, k, problem.head_groups)
    for lo, hi, heads, options in groups:
        into = dq[:, heads].zero_() if dq.dtype == torch.float32 else None
        group = saved.heads(heads, slice(lo, hi))
        grads = ring_pass(group, problem, lengths, options, comm_stream, into)
        for dest, grad in zip((dq[:, heads], dk[:, lo:hi], dv[:, lo:hi]), grads, strict=True):
            if grad is not into:
                dest.copy_(grad)
        del grads, grad  # before the next group's accumulators are allocated
    return dq, dk, dv


def ring_pass(saved: Saved, problem: Problem, lengths, options, comm_stream, dq=None):
    """One group's (dq, dk, dv) in fp32: step s runs the forward's calls of step s on the K/V
    shard of rank (rank - s) mod W while the next shard arrives; the shard's dK/dV, summed
    over the ranks that held it before, arrive from rank - 1 and leave, with this rank's share
    added, for rank + 1; the last send delivers each rank its own. Holds at most two of the
    group's K/V shards and three of its fp32 dK/dV (being computed, arriving, leaving)."""
    group, steps = problem.group, problem.steps
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to, recv_from = execute.ring_peers(group)
    dq = _fp32(saved.q, saved.q.shape[2]) if dq is None else dq
    k_cur, v_cur = saved.k.contiguous(), saved.v.contiguous()
    grads_in: tuple[torch.Tensor, torch.Tensor] | None = None
    grads_works: list = []
    grads_sent: tuple[torch.Tensor, ...] = ()
    for step in range(world):
        kv_works, kv_in = [], None
        if step + 1 < world:
            length = lengths[(rank - step - 1) % world]
            kv_in = (
                k_cur.new_empty(*k_cur.shape[:2], length, k_cur.shape[3]),
                v_cur.new_empty(*v_cur.shape[:2], length, v_cur.shape[3]),
            )
            kv_works = execute.exchange(
                (k_cur, v_cur), kv_in, send_to, recv_from, group, comm_stream
            )
        dk, dv = _fp32(k_cur, k_cur.shape[2]), _fp32(v_cur, v_cur.shape[2])
        add_gradients(steps[step], saved, k_cur, v_cur, options, dq, dk, dv)
        if grads_in is not None:  # the shard's dK/dV from the ranks that held it before
            _wait(grads_works)
            dk += grads_in[0]
            dv += grads_in[1]
            grads_in, grads_works, grads_sent = None, [], ()  # freed before the next arrive
        _wait(kv_works)
        if kv_in is not None:
            k_cur, v_cur = kv_in
        if world == 1:
            return dq, dk, dv
        length = lengths[(rank - step - 1) % world]  # the shard rank - 1 held at this step
        grads_in = (_fp32(dk, length, zero=False), _fp32(dv, length, zero=False))
        # The sent tensors stay referenced until their wait: on CUDA their memory must not
        # return to the allocator while the second stream may still read it.
        grads_sent = (dk, dv)
        grads_works = execute.exchange(grads_sent, grads_in, send_to, recv_from, group, comm_stream)
    _wait(grads_works)
    assert grads_in is not None  # world > 1: the last step received this rank's own
    return dq, grads_in[0], grads_in[1]


def _wait(works: list) -> None:
    """Wait for the transfers (on CUDA the compute stream waits, not the host)."""
    for work in works:
        work.wait()


def gather_backward(saved: Saved, calls, chunks, group, options: KernelOptions):
    """(dq, dk, dv) in fp32 from the calls against the whole K/V sequence, gathered again; the
    whole sequence's dK/dV reduce-scattered to the ranks holding each chunk."""
    k_all, v_all = execute.gather_sequences((saved.k, saved.v), chunks, group)
    dq = _fp32(saved.q, saved.q.shape[2])
    dk_all, dv_all = _fp32(k_all, k_all.shape[2]), _fp32(v_all, v_all.shape[2])
    add_gradients(calls, saved, k_all, v_all, options, dq, dk_all, dv_all)
    dk, dv = reduce_scatter_sequences((dk_all, dv_all), chunks, group)
    return dq, dk, dv


def reduce_scatter_sequences(
    tensors, chunks: list[tuple[Chunk, ...]], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """For each whole-sequence tensor (positions along dim 2), this rank's shard of its sum
    over ranks: the inverse of execute.gather_sequences. Shards are padded to the longest for
    the collective (uneven lengths), then cut back."""
    rank = dist.get_rank(group)
    lengths = [sum(c.length for c in r) for r in chunks]
    longest = max(lengths)
    results, works = [], []
    for x in tensors:
        shards = []
        for owned, length in zip(chunks, lengths, strict=True):
            pieces = [x[:, :, c.start : c.stop] for c in owned]
            pieces.append(x.new_zeros(*x.shape[:2], longest - length, x.shape[3]))
            shards.append(torch.cat(pieces, dim=2))
        if len(chunks) == 1:
            results.append(shards[0])
            continue
        results.append(torch.empty_like(shards[rank]))
        works.append(dist.reduce_scatter(results[-1], shards, group=group, async_op=True))
    for work in works:
        work.wait()
    return [r[:, :, : lengths[rank]] for r in results]
