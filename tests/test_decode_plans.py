"""decode()'s call plans (attngen/host/decode_plans.py), on the CPU: from a layout's second
call the module launches from the layout's plan; its launches are the full path's, a new
layout gets its own plan, and what depends on the call's data (out= sharing memory,
ATTNGEN_CHECKS' validation of the index tensors) is still checked at every call."""

from __future__ import annotations

import pytest
import torch

from tests.decode_harness import load_decode, make_cache, make_decode_spec, make_queries
from tests.test_fast_launch import DECODE, FakeCompiled, described, fast, fp16

PAGED = make_decode_spec(
    "paged",
    16,
    name="fldp",
    dtype="fp16",
    head_dim=64,
    num_q_heads=4,
    num_kv_heads=2,
    max_query_tokens=2,
)
KERNELS = ("_append_kernel", "_decode_split_kernel", "_decode_combine_kernel")


def planned_module(monkeypatch, spec):
    module = load_decode(spec)
    fast(monkeypatch, module, *KERNELS)
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    return module


def log_runs(monkeypatch):
    """Every direct launch, as (compiled kernel, grid, described arguments)."""
    log, run = [], FakeCompiled.run

    def logged(self, *args):
        run(self, *args)
        log.append((self, self.runs[-1][0], described(self.runs[-1][1])))

    monkeypatch.setattr(FakeCompiled, "run", logged)
    return log


def decode_calls(module, spec):
    """name -> a call of decode() at one layout (each call appends to fresh caches)."""
    cache = make_cache(spec, [5, 9], seed=1, room=2, extra_capacity=300)
    q, k_new, v_new, _ = make_queries(spec, 2, 2, seed=2, num_new=2)

    def call(q=q, append=False, **kwargs):
        k, v = cache.k.clone(), cache.v.clone()
        new = {"k_new": k_new, "v_new": v_new} if append else {}
        return module.decode(q, k, v, cache.lengths, block_table=cache.block_table, **new, **kwargs)

    out = fp16(2, 2, 4, 64).transpose(1, 2)
    return {
        "base": lambda: call(),
        "append": lambda: call(append=True),
        "append, scale, lse": lambda: call(append=True, sm_scale=0.5, return_lse=True),
        "one split": lambda: call(num_splits=1, return_lse=True),
        "three splits": lambda: call(append=True, num_splits=3),
        "out=": lambda: call(out=out),
        "misaligned q": lambda: call(q=fp16(2, 4, 2, 64, offset=1)),
    }


@pytest.mark.parametrize("spec", [DECODE, PAGED], ids=["contiguous", "paged"])
def test_decode_plans_launch_what_the_full_path_launches(monkeypatch, spec):
    """Append, split and combine: the same compiled kernels, grids and arguments, in the same
    order, from the plan as from the full path, for every option and alignment."""
    module = planned_module(monkeypatch, spec)
    log = log_runs(monkeypatch)
    for name, call in decode_calls(module, spec).items():
        with monkeypatch.context() as unplanned:
            unplanned.setattr(module, "_call_key", lambda *args, **keywords: None)
            call(), call()  # the second launches directly: its launches are the expected ones
            start = len(log)
            call()
            expected = log[start:]
        assert expected, name
        for _ in range(3):  # the plan's first launches through _launch, then its own
            start = len(log)
            call()
            assert log[start:] == expected, name
    # misaligned q is the base call's layout: one plan serves both alignments
    assert len(module._CALL_PLANS) == len(decode_calls(module, spec)) - 1
    for plan in module._CALL_PLANS.values():
        assert all(split.compiled for _, split, _ in plan.launches.values())


def test_a_longer_cache_is_the_same_plan_with_its_own_split_count(monkeypatch):
    """The split count follows the cache's capacity, not cache_seqlens' values: a longer cache
    is the same layout, whose plan derives the count at each call; LAST_NUM_SPLITS follows."""
    module = planned_module(monkeypatch, DECODE)
    counts = []
    for capacity in (64, 64, 2048, 2048, 64):
        q = fp16(2, 4, 1, 64)
        cache = fp16(2, 2, capacity, 64)
        module.decode(q, cache, cache, torch.tensor([3, 60], dtype=torch.int32))
        counts.append(module.LAST_NUM_SPLITS)
    (plan,) = module._CALL_PLANS.values()
    assert len(plan.launches) == 2  # one split count each
    assert counts[0] == counts[1] == counts[4] and counts[2] == counts[3] > counts[0]


def test_a_planned_layout_still_validates_indices_in_checked_mode(monkeypatch):
    module = planned_module(monkeypatch, PAGED)
    cache = make_cache(PAGED, [5, 9], seed=1, extra_capacity=40)
    q = make_queries(PAGED, 2, 1, seed=2)[0]
    for _ in range(2):
        module.decode(q, cache.k, cache.v, cache.lengths, block_table=cache.block_table)
    assert len(module._CALL_PLANS) == 1
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    too_long = torch.tensor([5, 10_000], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        module.decode(q, cache.k, cache.v, too_long, block_table=cache.block_table)
    bad_table = cache.block_table.clone()
    bad_table[1, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        module.decode(q, cache.k, cache.v, cache.lengths, block_table=bad_table)


def test_a_planned_layout_still_refuses_out_sharing_memory(monkeypatch):
    module = planned_module(monkeypatch, DECODE)
    q, lengths = fp16(2, 4, 1, 64), torch.tensor([3, 7], dtype=torch.int32)
    storage = fp16(2 * 2 * 16 * 64 + 2 * 4 * 64)
    k_cache = storage[: 2 * 2 * 16 * 64].view(2, 2, 16, 64)
    out_shared = storage[2 * 2 * 16 * 64 :].view(2, 4, 1, 64)
    for _ in range(2):
        module.decode(q, k_cache.clone(), k_cache.clone(), lengths, out=fp16(2, 4, 1, 64))
    assert len(module._CALL_PLANS) == 1
    with pytest.raises(ValueError, match="out: shares memory with k_cache"):
        module.decode(q, k_cache, k_cache.clone(), lengths, out=out_shared)


@pytest.mark.parametrize("spec", [DECODE, PAGED], ids=["contiguous", "paged"])
def test_planned_outputs_and_appends_equal_the_full_paths(monkeypatch, spec):
    """The kernels themselves (the interpreter, through `kernel[grid]`) from a plan: the same
    output, LSE and appended caches as without plans."""
    module = load_decode(spec)
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)  # plans on
    monkeypatch.setattr(module, "_runs_directly", lambda kernel: False)  # launches bind
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    monkeypatch.setattr(module, "FORCE_NUM_SPLITS", 2)  # the combine runs too
    cache = make_cache(spec, [5, 9], seed=1, room=2, extra_capacity=40)
    q, k_new, v_new, _ = make_queries(spec, 2, 2, seed=2, num_new=2)

    def step():
        k, v = cache.k.clone(), cache.v.clone()
        out, lse = module.decode(
            q,
            k,
            v,
            cache.lengths,
            block_table=cache.block_table,
            k_new=k_new,
            v_new=v_new,
            return_lse=True,
        )
        return out, lse, k, v

    full = step()
    assert len(module._CALL_PLANS) == 1
    planned = step()
    for a, b in zip(full, planned, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_a_changed_config_leaves_the_plan(monkeypatch):
    """Autotune replaces CONFIG: the next call of a planned layout takes the full path and
    launches with the new BLOCK_N (and plans again)."""
    module = planned_module(monkeypatch, DECODE)
    split_kernel = module._decode_split_kernel
    block_n = [p.name for p in split_kernel.params].index("BLOCK_N")
    q, cache = fp16(2, 4, 1, 64), fp16(2, 2, 64, 64)
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    for _ in range(2):
        module.decode(q, cache, cache, lengths)
    monkeypatch.setattr(module, "CONFIG", dict(module.CONFIG, BLOCK_N=16))
    module.decode(q, cache, cache, lengths)
    assert split_kernel.bound[-1][1][block_n] == 16
    (plan,) = module._CALL_PLANS.values()
    assert plan.config["BLOCK_N"] == 16


# Modules whose planned launch takes more than the plain one (attngen/host/decode_plans.py
# `_run_plan`): fp8 caches (the descales' pointers, the unit descale for None), the absorbed
# MLA decode (two configs in the plan's config), a score_mod (the block state's stand-in q),
# and a tree mask (its uint8 view): each planned step against its full path, the kernels run
# by the interpreter through `kernel[grid]` (a missing or misplaced argument fails to bind).
FP8 = dict(kv_dtype="fp8_e4m3", dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)
VARIANTS = {
    "fp8 contiguous": make_decode_spec("contiguous", None, name="fldq", **FP8),
    "fp8 paged": make_decode_spec("paged", 16, name="fldr", max_query_tokens=2, **FP8),
    "MLA paged": make_decode_spec(
        "paged",
        64,
        name="fldm",
        dtype="fp16",
        head_dim=576,
        head_dim_v=512,
        num_q_heads=16,
        num_kv_heads=1,
        kernels=["decode"],
    ),
    "score_mod": make_decode_spec(
        "paged",
        16,
        name="fldt",
        dtype="fp16",
        head_dim=64,
        num_q_heads=4,
        num_kv_heads=2,
        score_mod="20 * tanh(score / 20)",
        kernels=["decode"],
    ),
    "tree mask": PAGED,
}


def variant_step(spec, name):
    """One step's call (append where the cache takes one) and its results, in fresh caches."""
    cache = make_cache(spec, [5, 9], seed=1, room=2, extra_capacity=40)
    tokens = 2 if name in ("fp8 paged", "tree mask") else 1
    q, k_new, v_new, _ = make_queries(spec, 2, tokens, seed=2, num_new=tokens)
    options = {"return_lse": True}
    if name.startswith("fp8"):
        descale = torch.rand(2, 2, generator=torch.Generator().manual_seed(3)) + 0.5
        options |= {"k_descale": descale, "v_descale": None}
    if name == "tree mask":
        options["tree_mask"] = torch.tensor([[True, False], [True, True]])
    if name == "MLA paged":
        k_new = v_new = None  # the latent cache: values are the keys' first 512 dims

    def step(module):
        k = cache.k.clone()
        if name.startswith("fp8"):
            k = k.nan_to_num().to(torch.float8_e4m3fn)
        v = k[..., :512] if name == "MLA paged" else k.clone()
        new = {} if k_new is None else {"k_new": k_new, "v_new": v_new}
        out, lse = module.decode(
            q, k, v, cache.lengths, block_table=cache.block_table, **new, **options
        )
        return out, lse, k.float()

    return step


@pytest.mark.parametrize("name", list(VARIANTS))
def test_planned_variants_equal_their_full_paths(monkeypatch, name):
    spec = VARIANTS[name]
    module = load_decode(spec)
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)  # plans on
    monkeypatch.setattr(module, "_runs_directly", lambda kernel: False)  # launches bind
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    monkeypatch.setattr(module, "FORCE_NUM_SPLITS", 2)  # the combine runs too
    step = variant_step(spec, name)
    full = step(module)
    assert len(module._CALL_PLANS) == 1
    (plan,) = module._CALL_PLANS.values()
    planned_launches = []
    run_plan = module._run_plan
    monkeypatch.setattr(module, "_run_plan", lambda *a: planned_launches.append(1) or run_plan(*a))
    planned = step(module)
    assert planned_launches and plan.last is not None  # the plan ran, not the full path
    for a, b in zip(full, planned, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
