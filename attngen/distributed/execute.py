"""Running a plan: the kernel calls through the runtime, K/V around the ring or gathered, and
the exact merge of the partial results.

Every call goes through attngen.runtime.launch.run_dense, so dispatch picks (and records) the
generated module for its mask, alignment and lengths, or raises NoKernelError naming what is
missing. Before any communication, `check_served` asks the registry for every call of every
rank, so a missing module stops all ranks at the same point instead of leaving the others
waiting in a send.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from attngen.distributed.layout import Chunk
from attngen.distributed.merge import merge_partial
from attngen.distributed.plan import KernelCall, rows_covered_once
from attngen.runtime.dispatch import Call, choose, get_fallback
from attngen.runtime.launch import run_dense
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import NO_BACKWARD, Need, NoKernelError, mismatches
from attngen.spec import CausalAlign, KernelKind, Mask

API_NAME = "context_parallel_attention"


@dataclass(frozen=True)
class KernelOptions:
    """What every call of one attention shares besides its rows, keys and mask."""

    softcap: float
    alibi_slopes: torch.Tensor | None
    sm_scale: float


class Accumulator:
    """One head group's output and LSE, written into views of the shard's (out, lse). When each
    query row is computed by one call only, the results are copied into the output in place (no
    merge); otherwise an fp32 accumulator of the group's heads merges them and `finish` casts
    it into the output once (one rounding to the output dtype, as with a single call)."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor, single: bool):
        self.single, self.dest, self.lse = single, out, lse
        if single or out.dtype == torch.float32:
            self.out = out.zero_()  # rows no call computes (no key visible) stay output 0
        else:
            self.out = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        lse.fill_(float("-inf"))

    def add(self, rows: tuple[int, int], out: torch.Tensor, lse: torch.Tensor) -> None:
        acc, acc_lse = self.out[:, :, rows[0] : rows[1]], self.lse[:, :, rows[0] : rows[1]]
        if self.single:
            acc.copy_(out)
            acc_lse.copy_(lse)
        else:
            merge_partial(acc, acc_lse, out, lse)

    def finish(self) -> None:
        if self.out is not self.dest:
            self.dest.copy_(self.out)


def head_ranges(num_kv_heads: int, groups: int) -> list[tuple[int, int]]:
    """`groups` contiguous ranges of KV heads, as even as they can be (the first ones longer)."""
    size, longer = divmod(num_kv_heads, groups)
    bounds = [0]
    for g in range(groups):
        bounds.append(bounds[-1] + size + (g < longer))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def head_group_slices(options: KernelOptions, q: torch.Tensor, k: torch.Tensor, groups: int):
    """(first KV head, last + 1, slice of their query heads, options with their ALiBi slopes)
    of each group of `head_ranges`."""
    ratio, slopes = q.shape[1] // k.shape[1], options.alibi_slopes
    for lo, hi in head_ranges(k.shape[1], groups):
        heads = slice(lo * ratio, hi * ratio)
        sliced = replace(options, alibi_slopes=None if slopes is None else slopes[heads])
        yield lo, hi, heads, sliced


def auto_head_groups(q, v, rows: int, budget: int, backward: bool = False) -> int:
    """The fewest KV-head groups whose fp32 accumulators take at most `budget` bytes, one KV
    head per group at most: the forward's output [B, group's Hq, rows, Dv]; with backward,
    its dQ and three of the shard's dK/dV (being computed, arriving, leaving). `rows` is the
    longest shard's length, so that every rank chooses the same (their trips must pair up)."""
    batch, heads_q, dim_v, heads_kv = q.shape[0], q.shape[1], v.shape[-1], v.shape[1]
    per_kv_head = batch * (heads_q // heads_kv) * rows * dim_v * 4
    if backward:
        per_kv_head = (
            batch * rows * 4 * (heads_q // heads_kv * q.shape[-1] + 3 * (q.shape[-1] + dim_v))
        )
    for groups in range(1, heads_kv + 1):
        if -(-heads_kv // groups) * per_kv_head <= budget:
            return groups
    return heads_kv


def call_need(
    call: KernelCall,
    q: torch.Tensor,
    v: torch.Tensor,
    options: KernelOptions,
    backward: bool = False,
) -> Need:
    """The Need of the kernel call (as run_dense builds it; run_dense_backward with
    backward)."""
    rows, keys = call.num_rows + call.pad_front + call.pad_back, call.num_keys
    lengths = (rows, keys)
    return runtime_call(call, options).need(
        KernelKind.prefill, q, v, lengths, rows == keys, backward=backward
    )


def runtime_call(call: KernelCall, options: KernelOptions, return_lse: bool = False) -> Call:
    """The runtime's Call of the kernel call: its mask, alignment and window, and `options`."""
    align = None if call.align is None else CausalAlign(call.align)
    mask = (Mask(call.mask), align, call.window)
    return Call(*mask, options.softcap, options.alibi_slopes, options.sm_scale, return_lse)


def check_served(
    calls: list[KernelCall],
    q: torch.Tensor,
    v: torch.Tensor,
    options: KernelOptions,
    backward: bool = False,
) -> None:
    """Raise NoKernelError (from dispatch, with its list of nearest modules) for the first call
    no generated module serves, unless the fallback mode lets torch run it. With backward, for
    the first call no module with gradient kernels serves (no fallback computes those)."""
    if get_fallback() != "error" and not backward:
        return
    entries = current_registry().entries
    for need in dict.fromkeys(call_need(c, q, v, options, backward) for c in calls):
        if any(not mismatches(e, need) for e in entries):
            continue
        call = next(c for c in calls if call_need(c, q, v, options, backward) == need)
        try:  # may build on demand
            choose(API_NAME, need, "error" if backward else None, heads=(q.shape[1], v.shape[1]))
        except NoKernelError as err:
            if backward:
                forward_only = [
                    e.describe() for e in entries if mismatches(e, need) == [NO_BACKWARD]
                ]
                rebuild = f"; {', '.join(forward_only)} serves it without them: rebuild its "
                rebuild = rebuild + "spec with backward: true" if forward_only else ""
                raise NoKernelError(
                    f"context_parallel_attention's backward needs a module with gradient "
                    f"kernels (spec `backward: true`) for {call.describe()} ({_why(call)})"
                    f"{rebuild}; no fallback computes a chunk pair's gradients from the whole "
                    f"sequence's LSE: {err}"
                ) from None
            raise NoKernelError(
                f"context_parallel_attention needs a kernel for {call.describe()}"
                f" ({_why(call)}): {err}"
            ) from None


def _why(call: KernelCall) -> str:
    if call.mask == "none":
        return "a key range every query of the chunk sees runs without a mask"
    return f"a {call.mask} kernel aligned {call.align} places the chunk's global positions"


def call_rows(x: torch.Tensor, call: KernelCall, fill: float = 0.0) -> torch.Tensor:
    """The call's rows of x (along dim 2: queries, outputs, LSEs), with its fake rows, filled
    with `fill`, before and after them."""
    rows = x[:, :, call.rows[0] : call.rows[1]]
    if not (call.pad_front or call.pad_back):
        return rows
    front = x.new_full((*x.shape[:2], call.pad_front, *x.shape[3:]), fill)
    back = x.new_full((*x.shape[:2], call.pad_back, *x.shape[3:]), fill)
    return torch.cat([front, rows, back], dim=2)


def real_rows(x: torch.Tensor, call: KernelCall) -> torch.Tensor:
    """A call's result without its fake rows."""
    if not (call.pad_front or call.pad_back):
        return x
    return x[:, :, call.pad_front : call.pad_front + call.num_rows]


def run_call(
    call: KernelCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: KernelOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the call's real query rows."""
    keys = slice(*call.keys)
    kv = (k[:, :, keys], v[:, :, keys])
    out, lse = run_dense(API_NAME, call_rows(q, call), *kv, runtime_call(call, options, True))
    return real_rows(out, call), real_rows(lse, call)


def run_calls(calls, q, k, v, options: KernelOptions, acc: Accumulator) -> None:
    for call in calls:
        out, lse = run_call(call, q, k, v, options)
        acc.add(call.rows, out, lse)


def ring_attention(
    q,
    k,
    v,
    steps: list[list[KernelCall]],
    lengths: list[int],
    group: dist.ProcessGroup | None,
    options: KernelOptions,
    head_groups: int = 1,
):
    """This rank's (out, lse), one group of KV heads (and their query heads) at a time: each
    group goes once around the ring (`ring_pass`). The output is written in q's dtype straight
    into its place; only the group's fp32 accumulator, its K/V shard in flight and one call's
    partial result exist besides q, k, v, out and lse (docs/context_parallel.md, "Memory")."""
    every_call = [c for step in steps for c in step]
    single = rows_covered_once(every_call, q.shape[2])
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    comm_stream = torch.cuda.Stream(q.device) if q.is_cuda else None
    for lo, hi, heads, group_options in head_group_slices(options, q, k, head_groups):
        acc = Accumulator(out[:, heads], lse[:, heads], single)
        kv = (k[:, lo:hi], v[:, lo:hi])
        ring_pass(q[:, heads], *kv, steps, lengths, group, group_options, acc, comm_stream)
        acc.finish()
    return out, lse


def ring_pass(q, k, v, steps, lengths, group, options, acc: Accumulator, comm_stream) -> None:
    """One trip around the ring: step s runs its calls on the K/V shard of rank (rank - s) mod W
    while the shard for step s + 1 arrives from rank - 1 (and this one leaves for rank + 1).
    The shard received at step s is dropped after step s + 1 sent it on, so the allocator
    reuses its memory for the next receive."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to, recv_from = ring_peers(group)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(world):
        pending, incoming = [], None
        if step + 1 < world:
            length = lengths[(rank - step - 1) % world]
            incoming = (
                k_cur.new_empty(*k_cur.shape[:2], length, k_cur.shape[3]),
                v_cur.new_empty(*v_cur.shape[:2], length, v_cur.shape[3]),
            )
            pending = exchange((k_cur, v_cur), incoming, send_to, recv_from, group, comm_stream)
        run_calls(steps[step], q, k_cur, v_cur, options, acc)
        for work in pending:
            work.wait()  # on CUDA: the compute stream waits for the transfer, the host does not
        if incoming is not None:
            k_cur, v_cur = incoming


def ring_peers(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(the rank this one sends to, the rank it receives from), as global ranks (P2POp takes
    those)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        send_to, recv_from = (dist.get_global_rank(group, r) for r in (send_to, recv_from))
    return send_to, recv_from


def exchange(outgoing, incoming, send_to, recv_from, group, comm_stream) -> list:
    """Start sending `outgoing` to `send_to` and receiving `incoming` from `recv_from`.

    On CUDA the transfers are issued from a second stream that first waits for the compute
    stream: the receive buffers must not be overwritten while the previous step's kernels may
    still read memory they were carved from, and NCCL runs them concurrently with the kernels
    issued next. Empty tensors are not sent (both ends know the lengths)."""
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in outgoing if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in incoming if t.numel()]
    if not ops:
        return []
    if comm_stream is None:
        return dist.batch_isend_irecv(ops)
    comm_stream.wait_stream(torch.cuda.current_stream(comm_stream.device))
    with torch.cuda.stream(comm_stream):
        return dist.batch_isend_irecv(ops)


def gather_attention(
    q,
    k,
    v,
    calls: list[KernelCall],
    chunks: list[tuple[Chunk, ...]],
    group: dist.ProcessGroup | None,
    options: KernelOptions,
):
    """This rank's (out, lse) from the calls against the whole gathered K/V sequence."""
    k_all, v_all = gather_sequences((k, v), chunks, group)
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    acc = Accumulator(out, lse, rows_covered_once(calls, q.shape[2]))
    run_calls(calls, q, k_all, v_all, options, acc)
    acc.finish()
    return out, lse


def gather_sequences(
    tensors, chunks: list[tuple[Chunk, ...]], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Each tensor's full sequence from every rank's shard, in position order. Shards are
    padded to the longest for the collective (uneven lengths), then cut back."""
    lengths = [sum(c.length for c in rank) for rank in chunks]
    pieces = sorted(
        ((c.start, r, c) for r, rank in enumerate(chunks) for c in rank if c.length),
        key=lambda item: item[0],
    )
    gathered, works = [], []
    for x in tensors:
        padded = x
        if x.shape[2] < max(lengths):
            pad = x.new_zeros(*x.shape[:2], max(lengths) - x.shape[2], x.shape[3])
            padded = torch.cat([x, pad], dim=2)
        padded = padded.contiguous()
        if len(chunks) == 1:
            gathered.append([padded])
            continue
        gathered.append([torch.empty_like(padded) for _ in chunks])
        works.append(dist.all_gather(gathered[-1], padded, group=group, async_op=True))
    for work in works:
        work.wait()
    if not pieces:
        return [x[:, :, :0] for x in tensors]
    return [
        torch.cat([parts[r][:, :, c.local : c.local + c.length] for _, r, c in pieces], dim=2)
        for parts in gathered
    ]
