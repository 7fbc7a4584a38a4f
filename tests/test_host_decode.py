"""attngen/host's decode parts as ordinary Python, on the CPU without a kernel: the split rule,
the checks every decode module shares (paged and contiguous, 16-bit and fp8 caches), the tree
mask's arguments, the caches' size and strides, the partials' allocation, flash-attn's
layouts, and the call plans' bookkeeping. The generated modules run the same text
(tests/test_host.py: copied verbatim); their kernels are tested in tests/test_decode_*.py."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from attngen.host import decode, decode_plans, plans

D, PAGE = 64, 16


@pytest.fixture
def module(monkeypatch):
    """host/decode.py with a module's constants: a paged fp16 cache, D 64, 4 query tokens."""
    constants = dict(
        INTERPRETER_SM_COUNT=132, MAX_SPLITS=64, MIN_BLOCKS_PER_SPLIT=4, SPLIT_WAVES=2,
        KV_LAYOUT="paged", PAGE_SIZE=PAGE, ALIBI=False, _BLOCK_DV=tl.constexpr(D),
        DTYPE=torch.float16, KV_DTYPE=torch.float16, HEAD_DIM=D, HEAD_DIM_V=D,
        MAX_QUERY_TOKENS=4, _INTERPRET=True, _KEEPS_PLANS=False,
    )  # fmt: skip
    for name, value in constants.items():
        monkeypatch.setattr(decode, name, value)
    monkeypatch.setattr(decode, "_SPLITS", {})
    return decode


def paged(batch=2, pages=8, hq=4, hkv=2, nq=1, dtype=torch.float16):
    q = torch.zeros(batch, hq, nq, D, dtype=torch.float16)
    cache = torch.zeros(pages, PAGE, hkv, D, dtype=dtype)
    lengths = torch.zeros(batch, dtype=torch.int32)
    table = torch.zeros(batch, 4, dtype=torch.int32)
    return q, cache, cache.clone(), lengths, table


def test_requested_splits_stay_within_the_key_blocks_and_max_splits(module) -> None:
    assert module._num_splits(8, 1000, 64, 132, requested=3) == (3, 384)
    assert module._num_splits(8, 100, 64, 132, requested=50) == (2, 64)  # 2 key blocks
    splits, per_split = module._num_splits(8, 10**6, 64, 132, requested=1000)
    assert splits <= 64 and splits * per_split >= 10**6


def test_split_rule_fills_the_waves_and_is_remembered(module) -> None:
    # 1024 key blocks, 8 programs: 33 splits fill two waves of 132 SMs exactly; 1024 blocks in
    # 33 splits are 32 blocks a split, so 32 splits hold them all
    splits, per_split = module._num_splits(8, 65536, 64, 132)
    assert (splits, per_split) == (32, 32 * 64)
    assert module._splits_for(8, 65536, 64, 132, 0) == (splits, per_split)
    assert len(module._SPLITS) == 1
    assert module._num_splits(8, 64, 64, 132) == (1, 64)  # one key block: one split


def test_checks_pass_a_paged_call_and_name_what_fails(module) -> None:
    q, k, v, lengths, table = paged()
    assert module._inputs_ok(q, k, v, lengths, table, None, None)
    module._check_inputs(q, k, v, lengths, table, None, None)
    assert not module._inputs_ok(q, k, v, lengths, None, None, None)
    with pytest.raises(ValueError, match=r"^block_table: expected int32 \[B, max_pages\]"):
        module._check_inputs(q, k, v, lengths, None, None, None)
    q5 = torch.zeros(2, 4, 5, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="at most max_query_tokens=4 query tokens"):
        module._check_inputs(q5, k, v, lengths, table, None, None)
    with pytest.raises(ValueError, match="^k_new, v_new: expected both or neither"):
        module._check_inputs(q, k, v, lengths, table, torch.zeros(2, 2, 1, D), None)
    fp8 = k.to(torch.float8_e4m3fn)
    assert not module._inputs_ok(q, fp8, fp8, lengths, table, None, None)
    with pytest.raises(ValueError, match="k_cache: got an fp8 cache .* kv_dtype: fp8_e4m3"):
        module._check_inputs(q, fp8, fp8, lengths, table, None, None)


def test_an_fp8_module_takes_fp8_caches_only(module, monkeypatch) -> None:
    monkeypatch.setattr(module, "KV_DTYPE", torch.float8_e4m3fn)
    q, k, v, lengths, table = paged(dtype=torch.float8_e4m3fn)
    assert module._inputs_ok(q, k, v, lengths, table, None, None)
    k16 = k.to(torch.float16)
    with pytest.raises(ValueError, match="k_cache: expected an fp8 cache"):
        module._check_inputs(q, k16, k16, lengths, table, None, None)


def test_contiguous_checks_in_both_layouts(module, monkeypatch) -> None:
    monkeypatch.setattr(module, "KV_LAYOUT", "contiguous")
    q = torch.zeros(2, 4, 1, D, dtype=torch.float16)
    cache = torch.zeros(2, 2, 32, D, dtype=torch.float16)  # [B, HKV, Lmax, D]
    lengths = torch.zeros(2, dtype=torch.int32)
    assert module._inputs_ok(q, cache, cache, lengths, None, None, None)
    with pytest.raises(ValueError, match="^block_table: expected None for a contiguous cache"):
        module._check_inputs(q, cache, cache, lengths, torch.zeros(2, 1), None, None)
    flash = cache.transpose(1, 2).contiguous()  # [B, Lmax, HKV, D]
    module._check_inputs(q.transpose(1, 2), flash, flash, lengths, None, None, None, flash=True)
    assert module._cache_size(flash, None, 1) == (32, 0)
    assert module._cache_strides(cache) == cache.stride()


def test_paged_size_strides_and_partials(module) -> None:
    _, k, _, _, table = paged()
    assert module._cache_size(k, table) == (4 * PAGE, 8)
    s = k.stride()
    assert module._cache_strides(k) == (s[0], s[2], s[1], s[3])  # page, head, slot, dim
    q = torch.zeros(1, dtype=torch.float16)
    part_out, part_lse = module._partials(q, rows=6, splits=3)
    assert part_out.dtype == torch.float32 and part_lse.numel() >= 6 * 3
    offset = part_lse.data_ptr() - part_out.data_ptr()
    assert offset == 6 * 3 * D * 4 and offset % 64 == 0
    assert module._ints_around(((1,), (2,), (3,)), (9, 9), (5,)) == (1, 9, 9, 2, 5, 3)


def test_tree_mask_arguments_and_refusals(module, monkeypatch) -> None:
    q = torch.zeros(2, 4, 3, D, dtype=torch.float16)
    assert module._tree_args(None, 2, 3, q, None) == (None, (0, 0, 0))
    tree, strides = module._tree_args(torch.ones(3, 3, dtype=torch.bool), 2, 3, q, None)
    assert tree.dtype == torch.uint8 and strides == (0, 3, 1)  # one tree for every sequence
    with pytest.raises(ValueError, match=r"^tree_mask: expected a torch.bool tensor \[2, 3, 3\]"):
        module._tree_args(torch.ones(2, 3, 4, dtype=torch.bool), 2, 3, q, None)
    with pytest.raises(ValueError, match="^tree_mask: not with rotary_cos"):
        module._tree_args(torch.ones(3, 3, dtype=torch.bool), 2, 3, q, torch.zeros(8, 8))
    monkeypatch.setattr(module, "ALIBI", True)
    with pytest.raises(ValueError, match=r"^tree_mask: not in an ALiBi module"):
        module._tree_args(torch.ones(3, 3, dtype=torch.bool), 2, 3, q, None)


def test_flash_layout_views_and_capacity(module) -> None:
    q, k, v, lengths, table = paged()
    views = module._heads_first(True, q.transpose(1, 2), k, v, lengths, table, None, None)
    assert views[0].shape == q.shape and views[1] is k and views[2] is v  # pages as they are
    k_new = torch.zeros(2, 65, 2, D, dtype=torch.float16)  # [B, NNEW, HKV, D]
    with pytest.raises(ValueError, match=r"^k_new: 65 new keys \(dim 1\) exceed .* 64 \(max_p"):
        module._heads_first(True, q.transpose(1, 2), k, v, lengths, table, k_new, k_new)
    with pytest.raises(ValueError, match=r"^q: expected a tensor \[B, NQ, HQ, 64\], got \[2, 4\]"):
        module._heads_first(True, q[:, :, 0, 0], k, v, lengths, table, None, None)
    assert module._heads_first(False, q, k, v, lengths, table, None, None)[0] is q


def test_plans_keep_launches_per_class_and_leave_a_changed_config(monkeypatch) -> None:
    monkeypatch.setattr(plans, "_CALL_PLANS", {})
    monkeypatch.setattr(decode_plans, "_CALL_PLANS", plans._CALL_PLANS)
    fields = dict(config={"BLOCK_N": 64}, out_shape=(1,), lse_shape=None, num_new=0,
                  num_q_tokens=1, programs=2, block_n=64, sm_count=132, requested=0, rows=4,
                  append_parts=None, split_parts=((), (), ()))  # fmt: skip
    decode_plans._remember_launches("key", (1, (0,)), ("a", "s", None), **fields)
    decode_plans._remember_launches("key", (2, (0,)), ("a", "s", "c"), **fields)
    plan = plans._CALL_PLANS["key"]
    assert set(plan.launches) == {(1, (0,)), (2, (0,))}
    decode_plans._remember_launches("key", (1, (0,)), ("b", "s", None), **{**fields, "config": {}})
    assert plans._CALL_PLANS["key"] is not plan and len(plans._CALL_PLANS["key"].launches) == 1
    monkeypatch.setattr(decode_plans, "_plan_config", lambda: {"BLOCK_N": 128})
    assert decode_plans._run_plan(plan, *[None] * 10) is None  # autotune changed the config
    flash = plan.heads_last(1, (1, 1, 4, D))
    assert flash.length_dim == 1 and flash.launches is plan.launches and flash.last is None
