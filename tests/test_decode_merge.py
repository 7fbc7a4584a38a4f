"""The decode split kernel's merge (_decode_merge.py.jinja), on the CPU: with several splits the
last split program of each tile merges the tile's partials, as the separate combine kernel did,
and the tile counters it counts on are per stream, zero between launches, and the capture's own
in a CUDA graph. The interpreter runs one program at a time, so races cannot show here: the GPU
side (concurrent splits, two streams, graph replays) is tests/test_decode_gpu.py."""

from __future__ import annotations

import pytest
import torch

from attngen.reference import random_sinks
from tests.decode_harness import (
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
)

# fp32 throughout: the interpreter's fp32 math is exact, so the merge's rounding is all that
# differs from the combine's.
CONTIGUOUS = make_decode_spec(
    "contiguous", None, name="mrg", dtype="fp32", head_dim=24, num_q_heads=6, num_kv_heads=2,
    max_query_tokens=2,
)  # fmt: skip
SINKS = make_decode_spec(
    "paged", 16, name="mrgs", dtype="fp32", head_dim=24, num_q_heads=4, num_kv_heads=2,
    sinks=True, max_query_tokens=2,
)  # fmt: skip
BLOCK_N = 16
LOG2E = 1.4426950408889634


def combine_as_before(module, kept, sinks=None, num_q_tokens=1):
    """The removed combine kernel's arithmetic in torch on the partials the split programs
    stored (`kept`: what spy_partials saw): per row, w_s = exp2(lse_s - max), the sink one
    more term, out = sum_s w_s o_s / sum_s w_s, LSE in the natural log."""
    part_out, part_lse, rows, splits = kept
    width = module._BLOCK_DV.value
    o = part_out[: rows * splits * width].view(rows, splits, width)[..., : module.HEAD_DIM_V]
    lse = part_lse.view(rows, splits)
    m = lse.max(dim=1).values
    sink_log2 = None
    if sinks is not None:  # rows are (b, h, t): head h's sink for each
        per_row = sinks.repeat_interleave(num_q_tokens).repeat(
            rows // (sinks.numel() * num_q_tokens)
        )
        sink_log2 = per_row * LOG2E
        m = torch.maximum(m, sink_log2)
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.exp2(lse - m_ref[:, None])
    total = w.sum(dim=1)
    if sink_log2 is not None:
        total = total + torch.exp2(sink_log2 - m_ref)
    safe = torch.where(total == 0, torch.ones_like(total), total)
    out = (o * w[..., None]).sum(dim=1) / safe[:, None]
    lse_out = torch.where(total == 0, float("-inf"), m_ref + torch.log2(safe))
    return out, lse_out / LOG2E


def spy_partials(monkeypatch, module):
    """Keeps every partials buffer the launcher allocates, with its rows and split count."""
    kept = []
    original = module._partials

    def kept_partials(q, rows, splits):
        part_out, part_lse = original(q, rows, splits)
        kept.append((part_out, part_lse, rows, splits))
        return part_out, part_lse

    monkeypatch.setattr(module, "_partials", kept_partials)
    return kept


def fresh(monkeypatch, spec):
    module = load_decode(spec, BLOCK_N)
    monkeypatch.setattr(module, "_COUNTERS", {})
    return module


@pytest.mark.parametrize(
    ("spec", "lengths", "splits"),
    [
        (CONTIGUOUS, [1, 0, 700, 1023], 64),  # MAX_SPLITS of one block each at the longest
        (CONTIGUOUS, [300, 17], 7),
        (SINKS, [0, 37, 5, 250], 16),  # an empty cache: only the sink
    ],
    ids=["64 splits", "7 splits", "sinks, 16 splits"],
)
def test_many_splits_merge_as_the_combine_did(monkeypatch, spec, lengths, splits):
    """The kernel's merged rows against the old combine's arithmetic on the same partials, and
    against the float64 reference. The merge sums the splits one after another (and divides
    after a multiply-add) where the combine summed a [splits] vector as a tree: fp32 rounding
    only, seen up to 1 ulp; the bound allows 2 ulps of |out| and |lse| (atol 2 * 2^-23 * max)."""
    module = fresh(monkeypatch, spec)
    kept = spy_partials(monkeypatch, module)
    num_q_tokens = spec.max_query_tokens
    cache = make_cache(spec, lengths, seed=splits, extra_capacity=1024 - max(lengths))
    q, _, _, _ = make_queries(spec, len(lengths), num_q_tokens, seed=splits)
    sinks = random_sinks(spec.num_q_heads, seed=splits) if spec.sinks else None
    extra = {"sinks": sinks} if spec.sinks else {}
    out, lse = run_decode(module, cache, q, num_splits=splits, **extra)
    assert module.LAST_NUM_SPLITS == splits and len(kept) == 1
    assert not decode_problems(spec, cache, out, lse, q, sinks=sinks)
    expected_out, expected_lse = combine_as_before(module, kept[0], sinks, num_q_tokens)
    out_rows, lse_rows = out.reshape(-1, module.HEAD_DIM_V), lse.reshape(-1)
    ulp = 2.0**-23
    torch.testing.assert_close(
        out_rows, expected_out, rtol=0, atol=2 * ulp * expected_out.abs().max().item()
    )
    finite = expected_lse.isfinite()
    assert torch.equal(lse_rows.isfinite(), finite)
    assert torch.equal(lse_rows[~finite], expected_lse[~finite])  # -inf where no key
    torch.testing.assert_close(
        lse_rows[finite], expected_lse[finite], rtol=0,
        atol=2 * ulp * expected_lse[finite].abs().max().item(),
    )  # fmt: skip
    if 0 in lengths:  # a sequence with no key: output 0, LSE -inf (or the sink's)
        empty = lengths.index(0)
        assert torch.all(out[empty] == 0)
        if sinks is None:
            assert torch.all(lse[empty] == float("-inf"))


def test_a_request_that_does_not_fit_is_nan_through_the_merge(monkeypatch):
    """A sequence whose cache_seqlens exceeds the capacity reads nothing and gets NaN from every
    split; the merge keeps it NaN and leaves its neighbours exact."""
    module = fresh(monkeypatch, CONTIGUOUS)
    cache = make_cache(CONTIGUOUS, [200, 90], seed=3, extra_capacity=60)
    q, _, _, _ = make_queries(CONTIGUOUS, 2, 1, seed=3)
    good, _ = run_decode(module, cache, q, num_splits=5)
    cache.lengths[1] = 10_000
    out, lse = run_decode(module, cache, q, num_splits=5)
    assert module.LAST_NUM_SPLITS == 5
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.equal(out[0], good[0])


def test_the_counters_are_zero_after_a_call(monkeypatch):
    """The full path and a plan: after each call every tile counter is back to 0 (the last
    split of each tile resets its own), and the buffer holds at least the call's tiles."""
    module = fresh(monkeypatch, CONTIGUOUS)
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)  # plans on
    monkeypatch.setattr(module, "_runs_directly", lambda kernel: False)  # launches bind
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    cache = make_cache(CONTIGUOUS, [100, 250, 3], seed=4)
    q, _, _, _ = make_queries(CONTIGUOUS, 3, 1, seed=4)
    outs = []
    for _ in range(3):  # the full path, then twice from the layout's plan
        outs.append(run_decode(module, cache, q, num_splits=6)[0])
        assert module.LAST_NUM_SPLITS == 6
        (counters,) = module._COUNTERS.values()
        assert counters.dtype == torch.int32 and counters.numel() >= 3 * 2  # B x HKV tiles
        assert torch.all(counters == 0)
    assert len(module._CALL_PLANS) == 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_larger_launch_grows_the_buffer(monkeypatch):
    module = fresh(monkeypatch, CONTIGUOUS)
    first = module._tile_counters(torch.empty(0), -1, 10)
    assert first.numel() >= 10 and module._tile_counters(torch.empty(0), -1, 10) is first
    grown = module._tile_counters(torch.empty(0), -1, first.numel() + 1)
    assert grown.numel() > first.numel() and torch.all(grown == 0)
    assert module._COUNTERS[None] is grown


def test_two_streams_get_their_own_counters(monkeypatch):
    """Decode on two streams at once must not count on one buffer: the counters are keyed by
    the current stream (faked here: the CPU has none), and a stream keeps its buffer."""
    module = fresh(monkeypatch, CONTIGUOUS)
    stream = ["A"]
    monkeypatch.setattr(module, "_stream_key", lambda device: (device, stream[0]))
    seen = spy_counters(monkeypatch, module)
    cache = make_cache(CONTIGUOUS, [100, 250], seed=5)
    q, _, _, _ = make_queries(CONTIGUOUS, 2, 1, seed=5)
    results = []
    for name in ("A", "B", "A"):
        stream[0] = name
        results.append(run_decode(module, cache, q, num_splits=4)[0])
    assert set(module._COUNTERS) == {(-1, "A"), (-1, "B")}
    a, b = module._COUNTERS[(-1, "A")], module._COUNTERS[(-1, "B")]
    assert a.data_ptr() != b.data_ptr()
    assert [t.data_ptr() for t in seen] == [a.data_ptr(), b.data_ptr(), a.data_ptr()]
    assert torch.all(a == 0) and torch.all(b == 0)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_a_graph_capture_gets_counters_of_its_own_per_call(monkeypatch):
    """While a CUDA graph captures (faked: the CPU cannot), each launch gets fresh zeros that the
    graph owns, never the stream's buffer, which its replays would share with eager calls."""
    module = fresh(monkeypatch, CONTIGUOUS)
    monkeypatch.setattr(module, "_stream_capturing", lambda device: True)

    def no_stream_buffer(device):
        raise AssertionError("a capture must not use the stream's counters")

    monkeypatch.setattr(module, "_stream_key", no_stream_buffer)
    seen = spy_counters(monkeypatch, module)
    cache = make_cache(CONTIGUOUS, [100, 250], seed=6)
    q, _, _, _ = make_queries(CONTIGUOUS, 2, 1, seed=6)
    first = run_decode(module, cache, q, num_splits=4)[0]
    second = run_decode(module, cache, q, num_splits=4)[0]
    assert module._COUNTERS == {}
    assert len(seen) == 2 and seen[0].data_ptr() != seen[1].data_ptr()
    assert all(t.numel() == 2 * 2 and torch.all(t == 0) for t in seen)  # B x HKV tiles
    assert torch.equal(first, second)


def test_one_split_takes_no_counters(monkeypatch):
    module = fresh(monkeypatch, CONTIGUOUS)
    seen = spy_counters(monkeypatch, module)
    cache = make_cache(CONTIGUOUS, [30, 9], seed=7)
    q, _, _, _ = make_queries(CONTIGUOUS, 2, 1, seed=7)
    out, lse = run_decode(module, cache, q, num_splits=1)
    assert module.LAST_NUM_SPLITS == 1 and seen == [] and module._COUNTERS == {}
    assert not decode_problems(CONTIGUOUS, cache, out, lse, q)


def spy_counters(monkeypatch, module):
    """Keeps the counters every split launch of `module` is given."""
    seen = []
    original = module._tile_counters

    def kept(q, device, tiles):
        counters = original(q, device, tiles)
        seen.append(counters)
        return counters

    monkeypatch.setattr(module, "_tile_counters", kept)
    return seen
