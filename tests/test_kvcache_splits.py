"""flash_attn_with_kvcache's num_splits: the decode kind splits the keys in the count asked
for (clamped: at most one split per key block of the call's span, MAX_SPLITS in all), the
varlen route takes it as a hint (it has no split), and a planned call never runs another
count's plan. Modules built on demand (fp32, d16) under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.runtime import plans
from attngen.runtime.registry import current_registry
from tests.ondemand_harness import on_demand  # noqa: F401

B, HQ, HKV, D = 3, 4, 2, 16
CAPACITY = 700  # 6 key blocks of the module's BLOCK_N = 128 (asserted below)
PAGE = 16
# (requested, used): 4 and 5 even out to 3 splits of 2 blocks; 100 is more than 6 blocks
SPLITS = {
    "contiguous": ((1, 1), (2, 2), (4, 3), (5, 3), (6, 6), (100, 6)),
    "paged": ((2, 2), (5, 3), (100, 6)),
}


OUT_TOLERANCE = dict(atol=2e-6, rtol=0)  # four fp32 ulps at |out| < 4 (see the test)
LSE_TOLERANCE = dict(atol=4e-6, rtol=0)  # four fp32 ulps at |lse| < 8


def _caches(paged: bool):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (
        torch.randn(B, CAPACITY + 4, HKV, D, generator=gen)[:, :CAPACITY] for _ in range(2)
    )
    q = torch.randn(B, 1, HQ, D, generator=gen)
    lengths = torch.tensor([1, 300, CAPACITY], dtype=torch.int32)
    if not paged:
        return q, k_cache, v_cache, lengths, {}
    pages = CAPACITY // PAGE + 1  # the capacity rounded up to whole pages
    order = torch.randperm(B * pages, generator=gen)  # pages scattered over the pool
    table = order.view(B, pages).to(torch.int32)
    pool_k, pool_v = (torch.zeros(B * pages, PAGE, HKV, D) for _ in range(2))
    for b in range(B):
        for p in range(pages):
            rows = slice(p * PAGE, min((p + 1) * PAGE, CAPACITY))
            pool_k[table[b, p], : rows.stop - rows.start] = k_cache[b, rows]
            pool_v[table[b, p], : rows.stop - rows.start] = v_cache[b, rows]
    return q, pool_k, pool_v, lengths, {"block_table": table}


def _expected_splits(requested: int, blocks: int, most: int) -> int:
    """The documented clamp: min(requested, most) splits of ceil(blocks / that) blocks."""
    per_split = -(-blocks // min(requested, most))
    return -(-blocks // per_split)


def _decode_module():
    dispatch = attngen.last_dispatch()
    assert dispatch.need.kind.value == "decode", dispatch
    return current_registry().module(dispatch.key)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_num_splits_splits_the_keys_that_many_ways(on_demand, layout):  # noqa: F811
    paged = layout == "paged"
    q, k_cache, v_cache, lengths, extra = _caches(paged)
    kwargs = dict(cache_seqlens=lengths, causal=True, return_softmax_lse=True, **extra)
    out0, lse0 = attngen.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    module = _decode_module()
    capacity = (extra["block_table"].shape[1] * PAGE) if paged else CAPACITY
    blocks = -(-capacity // module.CONFIG["BLOCK_N"])
    assert blocks == 6 and module.LAST_NUM_SPLITS == 1  # the rule: too few blocks to split
    used = []
    for requested, _ in SPLITS[layout]:
        out, lse = attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, num_splits=requested, **kwargs
        )
        assert _decode_module() is module
        used.append(module.LAST_NUM_SPLITS)
        # fp32 throughout (the interpreter's fp32 dot is exact): splitting changes only the
        # order of the sums, and adds each split's normalisation and the combine's exp2
        # rescale: a few fp32 ulps of |out| < 4 and |lse| < 8 (ulps 4.8e-7 and 9.5e-7; seen:
        # 5e-8 and one ulp of lse); the tolerances allow four.
        torch.testing.assert_close(out, out0, **OUT_TOLERANCE)
        torch.testing.assert_close(lse, lse0, **LSE_TOLERANCE)
    assert used == [_expected_splits(s, blocks, module.MAX_SPLITS) for s, _ in SPLITS[layout]]
    assert used == [count for _, count in SPLITS[layout]]


def test_the_clamp_to_max_splits():
    """More blocks than MAX_SPLITS: a request past it gets at most MAX_SPLITS splits, evened
    out (the module's rule, integers only; the interpreter run above covers a launch)."""
    from tests.kernel_harness import load_kernel, make_spec

    module = load_kernel(
        make_spec(kernels=["decode"], dtype="fp32", head_dim=16, kv_layout="contiguous"),
        arch="sm80",
        kind="decode",
    )
    most = module.MAX_SPLITS
    for blocks, requested in ((100, 100), (200, 1000), (64, 64), (65, 64), (7, 3)):
        splits, keys = module._num_splits(1, blocks * 64, 64, 132, requested)
        assert splits == _expected_splits(requested, blocks, most) <= min(most, blocks)
        assert splits * keys >= blocks * 64 > (splits - 1) * keys  # no empty split


def test_a_plan_runs_only_its_own_split_count(on_demand):  # noqa: F811
    q, k_cache, v_cache, lengths, _ = _caches(paged=False)

    def step(num_splits):
        out = attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, causal=True, num_splits=num_splits
        )
        return out, _decode_module().LAST_NUM_SPLITS

    first = {s: step(s) for s in (2, 0, 6)}  # the full path, each leaving its plan
    planned = {
        key[-1] for key in plans.planned(current_registry()) if key[0] == "flash_attn_with_kvcache"
    }
    assert planned == {0, 2, 6}
    for s in (6, 2, 0, 2):  # from the plans: each its own count, the same bytes
        out, used = step(s)
        assert used == first[s][1] == {0: 1, 2: 2, 6: 6}[s]
        assert torch.equal(out, first[s][0])


def test_the_varlen_route_takes_num_splits_as_a_hint(on_demand):  # noqa: F811
    """cache_batch_idx sends the call to the varlen kind, which has no split of the keys."""
    q, k_cache, v_cache, lengths, _ = _caches(paged=False)
    rows = torch.tensor([2, 0, 1], dtype=torch.int32)
    kwargs = dict(cache_seqlens=lengths, cache_batch_idx=rows, causal=True)
    unsplit = attngen.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    for requested in (1, 4):
        out = attngen.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=requested, **kwargs)
        assert attngen.last_dispatch().need.kind.value == "varlen"
        assert torch.equal(out, unsplit)


def test_a_sequence_that_does_not_fit_gets_nan_whatever_the_split(on_demand):  # noqa: F811
    q, k_cache, v_cache, lengths, _ = _caches(paged=False)
    bad = torch.tensor([1, CAPACITY + 5, CAPACITY], dtype=torch.int32)
    good = attngen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    for requested in (3, 100):
        out = attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=bad, causal=True, num_splits=requested
        )
        assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
        # fp32, another split count than `good`'s one (see OUT_TOLERANCE)
        torch.testing.assert_close(out[[0, 2]], good[[0, 2]], **OUT_TOLERANCE)


@pytest.mark.parametrize("value", [-1, 2.0, True])
def test_a_bad_num_splits_is_named(on_demand, value):  # noqa: F811
    q, k_cache, v_cache, lengths, _ = _caches(paged=False)
    with pytest.raises(ValueError, match=f"num_splits: got {value!r}; allowed: an int >= 0"):
        attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, num_splits=value
        )
