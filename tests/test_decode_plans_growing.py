"""decode()'s call plans over caches whose size changes from call to call, on the CPU.

transformers' DynamicCache hands decode() new caches [B, HKV, L, D] one key longer at each
step (torch.cat), so a plan keyed on the caches' shapes and strides would miss at every step.
The key leaves out the caches' varying dimension (positions; a paged pool's pages) and their
strides; the plan derives the capacity, the strides, the split count, the ints and the
partials from each call's caches. These tests hold it to the full path: the same compiled
kernels, grids and ints for every size, one plan for all of them, the same outputs from the
kernels themselves, and the checks that depend on the size still made."""

from __future__ import annotations

import pytest
import torch

from tests.decode_harness import count_plan_hits, load_decode
from tests.test_decode_plans import PAGED, log_runs, planned_module
from tests.test_fast_launch import DECODE, fp16

# Contiguous: positions, across split counts and key-block boundaries, then shorter again.
POSITIONS = [*range(60, 70), 127, 128, 129, 255, 256, 257, 511, 512, 513, 1100, 2048, 700, 64]
POOL_PAGES = [*range(8, 20), 31, 32, 33, 16, 9]  # paged: the pool's pages (block_table fixed)
PAGED_TABLE = torch.tensor([[3, 0, 5, 7, 0, 0, 0, 0], [1, 6, 2, 4, 0, 0, 0, 0]], dtype=torch.int32)


def sizes(spec):
    return POSITIONS if spec.kv_layout.value == "contiguous" else POOL_PAGES


def call_at(module, spec, size, num_new=0, **kwargs):
    """decode() on new caches of `size` positions (contiguous) or pages (paged), as a
    DynamicCache step makes them: random contents, fresh tensors, contiguous."""
    gen = torch.Generator().manual_seed(size)
    if spec.kv_layout.value == "contiguous":
        shape, table = (2, 2, size, 64), None
        lengths = [size - num_new, (size - num_new) // 2]
    else:
        shape, table = (size, 16, 2, 64), PAGED_TABLE
        lengths = [5, 40]
    k, v = (torch.randn(shape, generator=gen).half() for _ in range(2))
    q = torch.randn(2, 4, 2, 64, generator=gen).half()
    new = {}
    if num_new:
        new = {f"{n}_new": torch.randn(2, 2, num_new, 64, generator=gen).half() for n in "kv"}
    seqlens = torch.tensor(lengths, dtype=torch.int32)

    def call():
        return module.decode(q, k, v, seqlens, block_table=table, **new, **kwargs)

    return call


@pytest.mark.parametrize("num_new", [0, 2], ids=["read", "append"])
@pytest.mark.parametrize("spec", [DECODE, PAGED], ids=["contiguous", "paged"])
def test_a_growing_cache_runs_from_one_plan_with_the_full_paths_launches(
    monkeypatch, spec, num_new
):
    """At every size the plan launches the full path's compiled kernels with its grids and
    ints (strides, split count, keys per split, capacity, pages); one plan serves every size,
    and only the first call of each launch class (split count, the size ints' classes) takes
    the full path."""
    module = planned_module(monkeypatch, spec)
    log = log_runs(monkeypatch)
    hits = count_plan_hits(monkeypatch, module)
    counts = []
    for size in sizes(spec):
        call = call_at(module, spec, size, num_new)
        with monkeypatch.context() as unplanned:
            unplanned.setattr(module, "_call_key", lambda *args, **keywords: None)
            call()  # compiles what this size needs; the second call launches directly
            start = len(log)
            call()
            expected = log[start:]
        start = len(log)
        call()
        assert log[start:] == expected, size
        counts.append(module.LAST_NUM_SPLITS)
    (plan,) = module._CALL_PLANS.values()
    assert hits.count(False) == len(plan.launches) - 1
    assert hits.count(True) >= len(sizes(spec)) - len(plan.launches)
    if spec is DECODE:
        assert len(set(counts)) >= 4  # the sizes cross split counts


@pytest.mark.parametrize("spec", [DECODE, PAGED], ids=["contiguous", "paged"])
def test_planned_outputs_over_a_growing_cache_equal_the_full_paths(monkeypatch, spec):
    """The kernels themselves (the interpreter, through `kernel[grid]`) with the plan's ints:
    the same outputs, LSEs and appended caches as the full path's, size after size."""
    module = load_decode(spec)
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)  # plans on
    monkeypatch.setattr(module, "_runs_directly", lambda kernel: False)  # launches bind
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    hits = count_plan_hits(monkeypatch, module)
    steps = [60, 61, 129, 130, 64] if spec is DECODE else [8, 9, 10, 9]
    for size in steps:
        call = call_at(module, spec, size, 2, return_lse=True, num_splits=3)
        with monkeypatch.context() as unplanned:
            unplanned.setattr(module, "_call_key", lambda *args, **keywords: None)
            expected = call()
        got = call()
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), size
    assert len(module._CALL_PLANS) == 1 and any(hits)


def test_a_plan_still_makes_the_checks_the_caches_size_decides(monkeypatch):
    """k and v of one length, the new keys within the capacity, cos/sin's rows covering it:
    a call of a planned layout that fails one raises as the full path does."""
    module = planned_module(monkeypatch, DECODE)
    q, lengths = fp16(2, 4, 1, 64), torch.tensor([0, 0], dtype=torch.int32)
    new = {"k_new": fp16(2, 2, 2, 64), "v_new": fp16(2, 2, 2, 64)}
    cos = sin = fp16(64, 16)
    for _ in range(2):
        module.decode(q, fp16(2, 2, 40, 64), fp16(2, 2, 40, 64), lengths, **new)
        module.decode(q, fp16(2, 2, 40, 64), fp16(2, 2, 40, 64), lengths, **new, rotary_cos=cos,
                      rotary_sin=sin)  # fmt: skip
    assert len(module._CALL_PLANS) == 2
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        module.decode(q, fp16(2, 2, 40, 64), fp16(2, 2, 41, 64), lengths, **new)
    with pytest.raises(ValueError, match="k_new: 2 new keys"):
        module.decode(q, fp16(2, 2, 1, 64), fp16(2, 2, 1, 64), lengths, **new)
    with pytest.raises(ValueError, match="rotary_cos"):
        module.decode(q, fp16(2, 2, 65, 64), fp16(2, 2, 65, 64), lengths, **new, rotary_cos=cos,
                      rotary_sin=sin)  # fmt: skip


def test_the_key_leaves_out_the_caches_length_and_strides_only(monkeypatch):
    module = planned_module(monkeypatch, DECODE)
    q, lengths = fp16(2, 4, 1, 64), torch.tensor([3, 7], dtype=torch.int32)

    def key(k_cache, v_cache):
        return module._call_key(
            q, k_cache, v_cache, lengths, None, None, None, None, None, False, None, 0, None,
            None, True, True,
        )  # fmt: skip

    base = key(fp16(2, 2, 64, 64), fp16(2, 2, 64, 64))
    assert base == key(fp16(2, 2, 65, 64), fp16(2, 2, 65, 64))
    assert base == key(fp16(2, 64, 2, 64).transpose(1, 2), fp16(2, 2, 64, 64))  # strides
    assert base != key(fp16(2, 1, 64, 64), fp16(2, 1, 64, 64))  # KV heads
    assert base != key(fp16(2, 2, 64, 64).float(), fp16(2, 2, 64, 64))  # dtype


def test_the_remembered_split_rule_answers_as_the_rule(monkeypatch):
    """_splits_for remembers answers under the span's key blocks: the same (splits, keys per
    split) as _num_splits for every span, growing and shrinking."""
    module = load_decode(DECODE)
    monkeypatch.setattr(module, "_SPLITS", {})
    spans = [*range(0, 1500, 7), *range(1500, 0, -13)]
    for programs in (1, 4, 64):
        for requested in (0, 3):
            for span in spans:
                got = module._splits_for(programs, span, 64, 132, requested)
                assert got == module._num_splits(programs, span, 64, 132, requested), span


@pytest.mark.parametrize("spec", [DECODE, PAGED], ids=["contiguous", "paged"])
def test_a_repeated_size_reuses_its_derivation_and_new_strides_do_not(monkeypatch, spec):
    """The plan keeps the latest size's derivation (split count, strides, ints, steps): caches
    of the same size but other strides (a [B, L, HKV, D] or [pages, HKV, slot, D] storage)
    launch with their own strides, as the full path does, and the size before them again
    with its own."""
    module = planned_module(monkeypatch, spec)
    log = log_runs(monkeypatch)
    size = 130 if spec is DECODE else 12
    plain = call_at(module, spec, size, 2)
    if spec is DECODE:
        other = (fp16(2, size, 2, 64).transpose(1, 2) for _ in range(2))
    else:
        other = (fp16(size, 2, 16, 64).transpose(1, 2) for _ in range(2))
    k_other, v_other = other
    q = fp16(2, 4, 2, 64)
    lengths = torch.tensor([5, 40], dtype=torch.int32)
    new = {f"{n}_new": fp16(2, 2, 2, 64) for n in "kv"}
    table = None if spec is DECODE else PAGED_TABLE

    def strided():
        return module.decode(q, k_other, v_other, lengths, block_table=table, **new)

    for call in (plain, strided, plain, plain, strided):
        with monkeypatch.context() as unplanned:
            unplanned.setattr(module, "_call_key", lambda *args, **keywords: None)
            call()
            start = len(log)
            call()
            expected = log[start:]
        start = len(log)
        call()
        assert log[start:] == expected
    (plan,) = module._CALL_PLANS.values()
    assert plan.last is not None and plan.last[0][2] == k_other.stride()
