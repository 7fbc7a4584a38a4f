"""Bad index tensors against the decode and varlen kernels, judged with guard regions.

The rule (shared/RELIABILITY.md): a kernel never reads or writes outside the memory it was given
for a sequence, whatever the index tensors hold; a sequence whose request does not fit gets NaN
output and NaN LSE (and nothing appended), and the other sequences stay correct. Each check
copies the caller's tensors into views of larger buffers filled with GUARD, makes
one sequence's index entries bad, runs the kernel (inside `watch`: on the CPU,
tests.memory_watch.watching, which refuses any access outside the tensor arguments), and
asserts that every byte outside the good sequences' new slots is bitwise unchanged, that the
bad sequence's rows are NaN and that the good ones match the float64 reference. Each case also
names the ValueError that the checked mode (ATTNGEN_CHECKS=1) raises instead.
tests/test_memory_safety.py runs these on the CPU, tests/test_safety_gpu.py on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attngen.reference import compare_to_reference
from tests.decode_harness import Cache, decode_problems, make_cache, make_queries, same_bits
from tests.test_varlen_properties import cu_seqlens, packed_inputs

NO_WATCH = contextlib.nullcontext


# Guard regions hold a finite sentinel: NaN would hide a stray read behind the NaN that a bad
# sequence gets anyway, while keys of 1000 dominate any softmax that reads them.
GUARD = 1000.0


def guarded(t: torch.Tensor, pad: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of t that is a view into a larger buffer filled with GUARD, that buffer)."""
    buffer = torch.full((t.numel() + 2 * pad,), GUARD, dtype=t.dtype, device=t.device)
    view = buffer[pad : pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buffer


@dataclass(frozen=True)
class Sizes:
    capacity: int  # keys a sequence may hold
    num_new: int
    num_pages: int  # 0 for a contiguous cache
    needed_pages: int  # pages the bad sequence uses, appended keys included


@dataclass(frozen=True)
class DecodeBad:
    name: str
    target: str  # "cache_seqlens", or "block_table" at `page` (0, or -1: the last needed page)
    value: Callable[[Sizes], int]
    error: str  # what the checked mode says (a regex), with {b} the bad sequence
    page: int = 0


DECODE_BAD = [
    DecodeBad(
        "append past the capacity",
        "cache_seqlens",
        lambda s: s.capacity - s.num_new + 1,
        r"cache_seqlens\[{b}\] = \d+: expected 0\.\.\d+ \(the capacity",
    ),
    DecodeBad(
        "negative length",
        "cache_seqlens",
        lambda s: -1,
        r"cache_seqlens\[{b}\] = -1: expected 0\.\.",
    ),
    DecodeBad(
        "length past the capacity",
        "cache_seqlens",
        lambda s: s.capacity + 3,
        r"cache_seqlens\[{b}\] = \d+: expected",
    ),
    DecodeBad(
        "length near 2**31",
        "cache_seqlens",
        lambda s: 2**31 - 1,
        r"cache_seqlens\[{b}\] = 2147483647",
    ),
]
PAGE_BAD = [
    DecodeBad(
        "page past the cache",
        "block_table",
        lambda s: s.num_pages,
        r"block_table\[{b}, 0\] = \d+: expected a page in 0\.\.\d+",
    ),
    DecodeBad(
        "negative page for the new keys",
        "block_table",
        lambda s: -1,
        r"block_table\[{b}, \d+\] = -1",
        page=-1,
    ),
    DecodeBad(
        "page near 2**31", "block_table", lambda s: 2**31 - 1, r"block_table\[{b}, 0\] = 2147483647"
    ),
]


@dataclass
class DecodeProblem:
    """A decode call with sequence `bad` broken by `case`; caches in guard regions."""

    cache: Cache  # the original cache (CPU), dense keys per sequence
    q: torch.Tensor
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    slopes: torch.Tensor | None
    lengths: torch.Tensor  # cache_seqlens with the bad entry
    table: torch.Tensor | None  # block_table with the bad entry
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    k_view: torch.Tensor
    v_view: torch.Tensor
    bad: int

    def call(self, kernel):
        return kernel.decode(
            self.q,
            self.k_view,
            self.v_view,
            self.lengths,
            block_table=self.table,
            k_new=self.k_new,
            v_new=self.v_new,
            alibi_slopes=self.slopes,
            return_lse=True,
        )


def decode_problem(
    spec, lengths, case: DecodeBad | None, *, num_new, num_q_tokens, seed, device, bad=1
) -> DecodeProblem:
    # Unused slots hold 0, not NaN: the bad sequence's NaN must come from the kernel's bound,
    # not from garbage it read.
    cache = make_cache(spec, lengths, seed=seed, room=num_new, fill=0.0)
    q, k_new, v_new, slopes = make_queries(
        spec, len(lengths), num_q_tokens, seed=seed, num_new=num_new
    )
    paged = cache.block_table is not None
    page_size = spec.page_size if paged else 1
    capacity = cache.block_table.shape[1] * page_size if paged else cache.k.shape[2]
    sizes = Sizes(
        capacity,
        num_new,
        cache.k.shape[0] if paged else 0,
        -(-(lengths[bad] + num_new) // page_size),
    )
    bad_lengths = cache.lengths.clone()
    table = cache.block_table.clone() if paged else None
    if case is not None and case.target == "cache_seqlens":
        bad_lengths[bad] = case.value(sizes)
    elif case is not None:
        table[bad, case.page % sizes.needed_pages] = case.value(sizes)
    k_view, k_buffer = guarded(cache.k.to(device))
    v_view, v_buffer = guarded(cache.v.to(device))

    def to(t):
        return None if t is None else t.to(device)

    return DecodeProblem(
        cache,
        to(q),
        to(k_new),
        to(v_new),
        to(slopes),
        to(bad_lengths),
        to(table),
        k_buffer,
        v_buffer,
        k_view,
        v_view,
        bad,
    )


def _expected_buffers(problem: DecodeProblem, good: list[int]):
    """The guard buffers after the call: the good sequences' new keys in their slots."""
    k_buffer, v_buffer = problem.k_buffer.clone(), problem.v_buffer.clone()
    if problem.k_new is None:
        return k_buffer, v_buffer
    pad = (k_buffer.numel() - problem.k_view.numel()) // 2
    k = k_buffer[pad : pad + problem.k_view.numel()].view(problem.k_view.shape)
    v = v_buffer[pad : pad + problem.v_view.numel()].view(problem.v_view.shape)
    table = problem.cache.block_table
    for b in good:
        pos = problem.cache.lengths[b].item() + torch.arange(problem.k_new.shape[2])
        if table is None:
            k[b, :, pos], v[b, :, pos] = problem.k_new[b], problem.v_new[b]
        else:
            page_size = k.shape[1]
            pages, slots = table[b, pos // page_size].long(), pos % page_size
            k[pages, slots] = problem.k_new[b].transpose(0, 1)
            v[pages, slots] = problem.v_new[b].transpose(0, 1)
    return k_buffer, v_buffer


def check_bad_decode(
    kernel, spec, problem: DecodeProblem, *, splits=None, watch=NO_WATCH, expect_nan=True
):
    """Run the problem; assert guard regions, NaN for the bad sequence (unless `expect_nan`
    is False: an entry the call does not need), and the reference for the others."""
    batch = problem.q.shape[0]
    good = [b for b in range(batch) if b != problem.bad or not expect_nan]
    k_expected, v_expected = _expected_buffers(problem, good)
    kernel.FORCE_NUM_SPLITS = splits
    try:
        with watch():
            out, lse = problem.call(kernel)
    finally:
        kernel.FORCE_NUM_SPLITS = None
    assert same_bits(problem.k_buffer.cpu(), k_expected.cpu()), "k_cache: bytes outside the slots"
    assert same_bits(problem.v_buffer.cpu(), v_expected.cpu()), "v_cache: bytes outside the slots"
    out, lse = out.cpu(), lse.cpu()
    if expect_nan:
        assert out[problem.bad].isnan().all() and lse[problem.bad].isnan().all()
    sub = Cache(
        None,
        None,
        None,
        None,
        [problem.cache.dense_k[b] for b in good],
        [problem.cache.dense_v[b] for b in good],
    )

    def pick(t):
        return None if t is None else t.cpu()[good]

    problems = decode_problems(
        spec,
        sub,
        out[good],
        lse[good],
        pick(problem.q),
        pick(problem.k_new),
        pick(problem.v_new),
        None if problem.slopes is None else problem.slopes.cpu(),
    )
    assert not problems, "; ".join(problems)


@dataclass(frozen=True)
class VarlenBad:
    name: str
    bad: int  # the sequence the change breaks
    change: Callable[[dict], None]  # edits {"cu_q", "cu_k", "used", "max_q"} in place
    error: str  # the checked mode's ValueError (a regex)
    seqused: bool = False  # the call passes seqused_k


def _set(key, index, value):
    def change(args):
        args[key][index] = value(args) if callable(value) else value

    return change


VARLEN_BAD = [
    VarlenBad(
        "q end past the packed rows",
        2,
        _set("cu_q", 3, lambda a: a["rows_q"] + 5),
        r"cu_seqlens_q\[3\] = \d+: expected 0\.\.\d+, the rows of q",
    ),
    VarlenBad(
        "k end past the packed rows",
        2,
        _set("cu_k", 3, lambda a: a["rows_k"] + 100),
        r"cu_seqlens_k\[3\] = \d+: expected 0\.\.\d+, the rows of k",
    ),
    VarlenBad("k end near 2**31", 2, _set("cu_k", 3, 2**31 - 1), r"cu_seqlens_k\[3\] = 2147483647"),
    VarlenBad(
        "decreasing cu_seqlens_k",
        1,
        _set("cu_k", 2, lambda a: int(a["cu_k"][1]) - 4),
        r"cu_seqlens_k\[2\] = \d+: expected >= cu_seqlens_k\[1\]",
    ),
    VarlenBad("negative start", 0, _set("cu_q", 0, -3), r"cu_seqlens_q\[0\] = -3"),
    VarlenBad(
        "seqused_k past its keys",
        1,
        _set("used", 1, lambda a: int(a["cu_k"][2] - a["cu_k"][1]) + 1),
        r"seqused_k\[1\] = \d+: expected 0\.\.\d+, the keys cu_seqlens_k gives",
        seqused=True,
    ),
    VarlenBad("negative seqused_k", 0, _set("used", 0, -1), r"seqused_k\[0\] = -1", seqused=True),
]


def check_bad_varlen(
    kernel,
    spec,
    lengths_q,
    lengths_k,
    case: VarlenBad | None,
    *,
    seed,
    device,
    max_seqlen_q=None,
    seqused=False,
    watch=NO_WATCH,
    bad=None,
):
    """Packed q/k/v in guard regions, one sequence broken by `case` (or `bad` sequences
    longer than `max_seqlen_q` allows): NaN rows for it, the others per the reference."""
    q, k, v, slopes = packed_inputs(spec, lengths_q, lengths_k, seed, pad=0)
    q, k, v = (guarded(t.to(device))[0] for t in (q, k, v))
    slopes = None if slopes is None else slopes.to(device)
    seqused = seqused or (case is not None and case.seqused)
    args = {
        "cu_q": cu_seqlens(lengths_q),
        "cu_k": cu_seqlens(lengths_k),
        "used": torch.tensor(lengths_k, dtype=torch.int32) if seqused else None,
        "rows_q": q.shape[0],
        "rows_k": k.shape[0],
    }
    if case is not None:
        case.change(args)
        bad = case.bad
    max_q = max(lengths_q) if max_seqlen_q is None else max_seqlen_q
    with watch():
        out, lse = kernel.attention_varlen(
            q,
            k,
            v,
            args["cu_q"].to(device),
            args["cu_k"].to(device),
            max_q,
            max(lengths_k),
            alibi_slopes=slopes,
            return_lse=True,
            seqused_k=None if args["used"] is None else args["used"].to(device),
        )
    out, lse = out.cpu(), lse.cpu()
    cu_q, cu_k = args["cu_q"].tolist(), args["cu_k"].tolist()
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    if bad is not None:
        first, end = (min(max(x, 0), q.shape[0]) for x in (cu_q[bad], cu_q[bad + 1]))
        assert end > first, "the bad sequence must have rows inside q for the check to see"
        assert out[first:end].isnan().all() and lse[:, first:end].isnan().all()
        covered[first:end] = True
    for b in range(len(lengths_q)):
        if b == bad:
            continue
        used = args["used"][b].item() if seqused else cu_k[b + 1] - cu_k[b]
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b] + used)
        covered[rows_q] = True

        def heads_first(t):
            return t.cpu().transpose(0, 1)[None]

        problems = compare_to_reference(
            spec,
            heads_first(out[rows_q]),
            lse[:, rows_q][None],
            heads_first(q[rows_q]),
            heads_first(k[rows_k]),
            heads_first(v[rows_k]),
            alibi_slopes=None if slopes is None else slopes.cpu(),
        )
        assert not problems, f"sequence {b}: " + "; ".join(problems)
    assert torch.all(out[~covered] == 0) and torch.all(lse[:, ~covered] == float("-inf"))
