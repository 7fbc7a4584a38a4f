"""Bad index tensors never make a kernel touch memory it was not given (shared/RELIABILITY.md).

Decode (contiguous, and paged with pages smaller and larger than a key tile) and varlen, on
the CPU interpreter inside tests.memory_watch.watching (any access outside the tensor
arguments fails), with guard regions around the caller's tensors (tests/safety_harness.py):
the bad sequence gets NaN, the others stay right, nothing else changes. Then the opt-in
checked mode (ATTNGEN_CHECKS=1) that refuses the same inputs on the host, and the host checks
that need no device read. tests/test_safety_gpu.py runs the same cases on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.decode_harness import load_decode, make_cache, make_decode_spec, make_queries
from tests.kernel_harness import load_kernel, make_spec
from tests.memory_watch import watching
from tests.safety_harness import (
    DECODE_BAD,
    PAGE_BAD,
    VARLEN_BAD,
    DecodeBad,
    check_bad_decode,
    check_bad_varlen,
    decode_problem,
)

LAYOUTS = [("contiguous", None), ("paged", 4), ("paged", 16)]
DECODE_CASES = [
    (layout, page, case)
    for layout, page in LAYOUTS
    for case in DECODE_BAD + (PAGE_BAD if layout == "paged" else [])
]
LENGTHS = [5, 40, 20]  # sequence 1 is the one made bad


def _decode_spec(layout, page_size, **fields):
    fields = {"mask": "causal", "causal_align": "bottom_right", **fields}
    return make_decode_spec(
        layout,
        page_size,
        dtype="fp16",
        head_dim=16,
        num_q_heads=4,
        num_kv_heads=2,
        max_query_tokens=2,
        **fields,
    )


def _varlen_kernel():
    spec = make_spec(
        dtype="fp16",
        head_dim=16,
        num_q_heads=2,
        num_kv_heads=1,
        mask="causal",
        causal_align="bottom_right",
        kernels=["varlen"],
    )
    return spec, load_kernel(spec, 16, 16, kind="varlen")


@pytest.mark.parametrize(
    "layout, page_size, case",
    DECODE_CASES,
    ids=[f"{lay}{page or ''}-{c.name}" for lay, page, c in DECODE_CASES],
)
def test_bad_decode_indices_give_nan_and_touch_nothing_else(layout, page_size, case):
    spec = _decode_spec(layout, page_size)
    kernel = load_decode(spec, 16)
    for splits in (1, 2):  # one program per sequence, and split-KV with the combine
        problem = decode_problem(
            spec, LENGTHS, case, num_new=3, num_q_tokens=2, seed=11, device="cpu"
        )
        check_bad_decode(kernel, spec, problem, splits=splits, watch=watching)


NEW_MASKS = {
    "chunked": dict(mask="chunked", chunk_size=6),
    "sink_tokens": dict(mask="sliding_window", window_left=5, sink_tokens=3),
}


@pytest.mark.parametrize("mask", sorted(NEW_MASKS))
@pytest.mark.parametrize("case", DECODE_BAD + PAGE_BAD, ids=lambda c: c.name)
def test_bad_decode_indices_with_chunks_and_sink_tokens(mask, case):
    """Chunks and sink tokens read other keys than causal does (from the chunk's start; the
    first pages and the window's): the same bounds hold. A chunked step never reads page 0
    of the bad sequence (its queries sit in the chunk from key 36), so a bad entry there
    changes nothing, as a bad page left of a window does."""
    spec = _decode_spec("paged", 4, **NEW_MASKS[mask])
    kernel = load_decode(spec, 16)
    unread = mask == "chunked" and case.target == "block_table" and case.page != -1
    for splits in (1, 2):
        problem = decode_problem(
            spec, LENGTHS, case, num_new=3, num_q_tokens=2, seed=14, device="cpu"
        )
        check_bad_decode(
            kernel, spec, problem, splits=splits, watch=watching, expect_nan=not unread
        )


# Pages of the bad sequence (43 keys after the append, 4-key pages) that a key tile reaches
# but no row sees: with sink tokens, page 4 between the 3 sink tokens (page 0) and the window
# (keys from 36: pages 9 and 10); chunked, page 8, left of the queries' chunk (from key 36)
# in the 16-key tile that starts at key 32.
UNSEEN_PAGES = {"sink_tokens": 4, "chunked": 8}


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("mask", sorted(UNSEEN_PAGES))
def test_a_bad_page_no_row_sees_changes_nothing(monkeypatch, mask, checked):
    """A bad block-table entry of a page no row sees changes nothing: the step appends and
    attends as with a good one, in the kernels (the decode scan and the append's check agree
    on the pages read) and in the checked mode."""
    if checked:
        monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    spec = _decode_spec("paged", 4, **NEW_MASKS[mask])
    kernel = load_decode(spec, 16)
    unseen = DecodeBad(
        "a page no row sees",
        "block_table",
        lambda s: s.num_pages,
        r"never raised",
        page=UNSEEN_PAGES[mask],
    )
    for splits in (1, 2, 3):
        problem = decode_problem(
            spec, LENGTHS, unseen, num_new=3, num_q_tokens=2, seed=16, device="cpu"
        )
        check_bad_decode(kernel, spec, problem, splits=splits, watch=watching, expect_nan=False)


@pytest.mark.parametrize("mask", sorted(NEW_MASKS))
def test_checked_mode_agrees_on_chunks_and_sink_tokens(monkeypatch, mask):
    """The checked mode checks the pages the kernels read: a chunked step's page 0 is not
    one of them, a sink-token step's is."""
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    spec = _decode_spec("paged", 4, **NEW_MASKS[mask])
    problem = decode_problem(
        spec, LENGTHS, PAGE_BAD[0], num_new=0, num_q_tokens=1, seed=15, device="cpu"
    )
    kernel = load_decode(spec, 16)
    args = (problem.q, problem.k_view, problem.v_view, problem.lengths)
    if mask == "chunked":
        out, _ = kernel.decode(*args, block_table=problem.table, return_lse=True)
        assert not out.isnan().any()
    else:
        with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
            kernel.decode(*args, block_table=problem.table, return_lse=True)


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
def test_bad_length_without_new_keys_reads_nothing_past_the_capacity(layout, page_size):
    spec = _decode_spec(layout, page_size)
    problem = decode_problem(
        spec, LENGTHS, DECODE_BAD[2], num_new=0, num_q_tokens=1, seed=12, device="cpu", bad=2
    )
    check_bad_decode(load_decode(spec, 16), spec, problem, watch=watching)


def test_a_bad_page_left_of_every_window_is_not_needed():
    """A window's decode reads no key left of its queries' windows: a bad block-table entry
    there changes nothing (a cache may free those pages), and the checked mode agrees."""
    spec = _decode_spec("paged", 4, mask="sliding_window", window_left=5, window_right=0)
    problem = decode_problem(
        spec, LENGTHS, PAGE_BAD[0], num_new=3, num_q_tokens=2, seed=13, device="cpu"
    )
    check_bad_decode(load_decode(spec, 16), spec, problem, watch=watching, expect_nan=False)


@pytest.mark.parametrize("case", VARLEN_BAD, ids=lambda c: c.name)
def test_bad_varlen_indices_give_nan_and_touch_nothing_else(case):
    spec, kernel = _varlen_kernel()
    check_bad_varlen(
        kernel, spec, [5, 17, 3], [9, 20, 3], case, seed=14, device="cpu", watch=watching
    )


def test_a_sequence_longer_than_max_seqlen_q_is_nan_in_every_row():
    """max_seqlen_q sizes the grid; a longer sequence's rows past it would stay 0 unnoticed, so
    every row of it is NaN (33 rows, one BLOCK_M = 16 program per sequence)."""
    spec, kernel = _varlen_kernel()
    check_bad_varlen(
        kernel,
        spec,
        [5, 33, 3],
        [9, 20, 3],
        None,
        seed=15,
        device="cpu",
        max_seqlen_q=16,
        bad=1,
        watch=watching,
    )


@pytest.mark.parametrize(
    "layout, page_size, case",
    DECODE_CASES,
    ids=[f"{lay}{page or ''}-{c.name}" for lay, page, c in DECODE_CASES],
)
def test_checked_mode_refuses_bad_decode_indices(monkeypatch, layout, page_size, case):
    spec = _decode_spec(layout, page_size)
    problem = decode_problem(spec, LENGTHS, case, num_new=3, num_q_tokens=2, seed=11, device="cpu")
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    with pytest.raises(ValueError, match=case.error.format(b=1)), watching():
        problem.call(load_decode(spec, 16))


@pytest.mark.parametrize("case", VARLEN_BAD, ids=lambda c: c.name)
def test_checked_mode_refuses_bad_varlen_indices(monkeypatch, case):
    spec, kernel = _varlen_kernel()
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    with pytest.raises(ValueError, match=case.error):
        check_bad_varlen(
            kernel, spec, [5, 17, 3], [9, 20, 3], case, seed=14, device="cpu", watch=watching
        )


def test_checked_mode_refuses_a_sequence_longer_than_max_seqlen_q(monkeypatch):
    spec, kernel = _varlen_kernel()
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    with pytest.raises(
        ValueError, match="cu_seqlens_q: sequence 1 has 33 queries, more than max_seqlen_q = 16"
    ):
        check_bad_varlen(
            kernel,
            spec,
            [5, 33, 3],
            [9, 20, 3],
            None,
            seed=15,
            device="cpu",
            max_seqlen_q=16,
            bad=1,
            watch=watching,
        )


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
def test_checked_mode_passes_good_indices_unchanged(monkeypatch, layout, page_size):
    spec = _decode_spec(layout, page_size)
    kernel = load_decode(spec, 16)
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    problem = decode_problem(spec, LENGTHS, None, num_new=3, num_q_tokens=2, seed=16, device="cpu")
    check_bad_decode(kernel, spec, problem, expect_nan=False)
    window = _decode_spec("paged", 4, mask="sliding_window", window_left=5, window_right=0)
    problem = decode_problem(
        window, LENGTHS, PAGE_BAD[0], num_new=3, num_q_tokens=2, seed=13, device="cpu"
    )
    check_bad_decode(load_decode(window, 16), window, problem, expect_nan=False)
    varlen, varlen_kernel = _varlen_kernel()
    for seqused in (False, True):
        check_bad_varlen(
            varlen_kernel,
            varlen,
            [5, 17, 3],
            [9, 20, 3],
            None,
            seed=17,
            device="cpu",
            seqused=seqused,
            bad=None,
        )


def test_new_keys_beyond_the_capacity_are_refused_on_the_host():
    spec = _decode_spec("contiguous", None)
    cache = make_cache(spec, [0, 0], seed=0, extra_capacity=4)
    q, k_new, v_new, _ = make_queries(spec, 2, 1, seed=0, num_new=5)
    with (
        pytest.raises(
            ValueError,
            match=r"k_new: 5 new keys \(dim 2\) exceed the cache's "
            r"capacity 4",
        ),
        watching(),
    ):
        load_decode(spec, 16).decode(q, cache.k, cache.v, cache.lengths, k_new=k_new, v_new=v_new)


def test_checks_are_off_unless_asked(monkeypatch):
    """Without ATTNGEN_CHECKS=1 (and with another value) a bad index is the kernel's: NaN,
    no exception, no host read."""
    spec = _decode_spec("contiguous", None)
    kernel = load_decode(spec, 16)
    for value in (None, "0", "yes"):
        if value is None:
            monkeypatch.delenv("ATTNGEN_CHECKS", raising=False)
        else:
            monkeypatch.setenv("ATTNGEN_CHECKS", value)
        problem = decode_problem(
            spec, LENGTHS, DECODE_BAD[1], num_new=3, num_q_tokens=2, seed=18, device="cpu"
        )
        with watching():
            out, lse = problem.call(kernel)
        assert out[1].isnan().all() and lse[1].isnan().all()
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
