"""attention_varlen()'s call plans (attngen/host/varlen_plans.py), on the CPU: from a
layout's second call the module launches from the layout's plan; its launch is the full
path's, a new layout gets its own plan, and what depends on the call's data (out= sharing
memory and its zero fill, ATTNGEN_CHECKS' validation of the index tensors) is still done at
every call."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_harness import load_kernel
from tests.test_decode_plans import log_runs
from tests.test_fast_launch import VARLEN, fast, fp16

CU = torch.tensor([0, 17, 40], dtype=torch.int32)


def planned_module(monkeypatch):
    module = load_kernel(VARLEN, kind="varlen")
    fast(monkeypatch, module, "_attn_fwd_kernel")
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    return module


def test_varlen_plans_launch_what_the_full_path_launches(monkeypatch):
    module = planned_module(monkeypatch)
    log = log_runs(monkeypatch)
    q, k = fp16(48, 4, 64), fp16(48, 2, 64)
    out = fp16(4, 48, 64).transpose(0, 1)
    used = torch.tensor([10, 20], dtype=torch.int32)
    calls = {
        "base": lambda: module.attention_varlen(q, k, k, CU, CU, 23, 23),
        "scale, lse": lambda: module.attention_varlen(
            q, k, k, CU, CU, 23, 23, sm_scale=0.5, return_lse=True
        ),
        "seqused_k": lambda: module.attention_varlen(q, k, k, CU, CU, 23, 23, seqused_k=used),
        "out=": lambda: module.attention_varlen(q, k, k, CU, CU, 23, 23, out=out),
        "another max_seqlen_q": lambda: module.attention_varlen(q, k, k, CU, CU, 40, 23),
        "misaligned q": lambda: module.attention_varlen(
            fp16(48, 4, 64, offset=1), k, k, CU, CU, 23, 23
        ),
    }
    for name, call in calls.items():
        with monkeypatch.context() as unplanned:
            unplanned.setattr(module, "_call_key", lambda *args: None)
            call(), call()
            expected = log[-1]
        for _ in range(3):  # the plan's first launch through _launch, then its own
            call()
            assert log[-1] == expected, name
    # misaligned q is the base call's layout: one plan serves both alignments
    assert len(module._CALL_PLANS) == len(calls) - 1
    assert all(plan[4].compiled for plan in module._CALL_PLANS.values())  # (.., its _Step, why)
    monkeypatch.setattr(module._FORWARD, "path", "stale")  # a plan says why it is not Gluon's
    calls["base"]()
    assert module.forward_path() == "tile-level: " + module._INTERPRETED


def test_a_planned_layout_still_validates_indices_and_refuses_shared_out(monkeypatch):
    module = planned_module(monkeypatch)
    q, k = fp16(48, 4, 64), fp16(48, 2, 64)
    for _ in range(2):
        module.attention_varlen(q, k, k, CU, CU, 23, 23)
    assert len(module._CALL_PLANS) == 1
    with monkeypatch.context() as checked:
        checked.setenv("ATTNGEN_CHECKS", "1")
        bad = torch.tensor([0, 17, 99], dtype=torch.int32)
        with pytest.raises(ValueError, match="cu_seqlens_k"):
            module.attention_varlen(q, k, k, CU, bad, 23, 23)
    storage = fp16(q.numel() * 2)
    q_shared, out_shared = storage[: q.numel()].view(q.shape), storage[q.numel() :].view(q.shape)
    module.attention_varlen(q, k, k, CU, CU, 23, 23, out=fp16(48, 4, 64))  # plans this layout
    with pytest.raises(ValueError, match="out: shares memory with q"):
        module.attention_varlen(q_shared, k, k, CU, CU, 23, 23, out=out_shared)


def test_planned_outputs_equal_the_full_paths_and_out_is_zeroed(monkeypatch):
    """The kernel itself (the interpreter, through `kernel[grid]`) from a plan: the same output
    and LSE as without plans, and rows no sequence covers zeroed in a reused out=."""
    module = load_kernel(VARLEN, kind="varlen")
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)  # plans on
    monkeypatch.setattr(module, "_runs_directly", lambda kernel: False)  # launches bind
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    q, k = fp16(48, 4, 64), fp16(48, 2, 64)
    out = fp16(48, 4, 64)
    full = module.attention_varlen(q, k, k, CU, CU, 23, 23, return_lse=True, out=out)
    full = [t.clone() for t in full]
    assert len(module._CALL_PLANS) == 1
    out.fill_(float("nan"))
    planned = module.attention_varlen(q, k, k, CU, CU, 23, 23, return_lse=True, out=out)
    assert all(torch.equal(a, b) for a, b in zip(full, planned, strict=True))
    assert torch.equal(out[40:], torch.zeros_like(out[40:]))


EVERY_ROW_CASES = [
    [5, 17, 40],  # rows before the first sequence and after the last
    [0, 30, 12, 40],  # a sequence that ends before it starts (NaN, its rows none)
    [20, 3, 9],  # the first sequence backwards, the last one before the first's start
    [-4, 10, 60],  # bounds outside q: both sequences NaN where they lie inside q
    [12, 12],  # one empty sequence
]


def check_every_row_written(module, cu: list[int], device: str) -> None:
    """The output and LSE are allocated unfilled: the kernel writes every row of q (rows no
    sequence covers 0 and LSE -inf, a sequence that does not fit NaN). A sentinel in out= never
    survives. (With cu_seqlens not ascending two sequences' rows may overlap; which one's
    values land there is not defined.)"""
    q, k = (fp16(48, heads, 64).to(device) for heads in (4, 2))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    out = torch.full((48, 4, 64), 7.0, dtype=torch.float16, device=device)
    _, lse = module.attention_varlen(
        q, k, k, cu_seqlens, cu_seqlens, 64, 64, return_lse=True, out=out
    )
    out, lse = out.cpu(), lse.cpu()
    assert not (out == 7.0).any()
    covered = torch.zeros(48, dtype=torch.bool)
    for first, end in zip(cu[:-1], cu[1:], strict=True):
        covered[max(first, 0) : max(min(end, 48), 0)] = True
    assert torch.equal(out[~covered], torch.zeros_like(out[~covered]))
    assert bool((lse[:, ~covered] == float("-inf")).all())
    if cu == EVERY_ROW_CASES[0]:  # valid sequences: the output is the sequences' attention
        expected = module.attention_varlen(q, k, k, cu_seqlens, cu_seqlens, 23, 23).cpu()
        assert torch.equal(out[5:40], expected[5:40])


@pytest.mark.parametrize("cu", EVERY_ROW_CASES)
def test_the_kernel_writes_every_row_whatever_cu_seqlens_holds(cu):
    check_every_row_written(load_kernel(VARLEN, kind="varlen"), cu, "cpu")


def test_a_changed_config_leaves_the_plan(monkeypatch):
    """Autotune replaces CONFIG: the next call of a planned layout takes the full path and
    launches with the new BLOCK_N (and plans again)."""
    module = planned_module(monkeypatch)
    kernel = module._attn_fwd_kernel
    block_n = [p.name for p in kernel.params].index("BLOCK_N")
    q, k = fp16(48, 4, 64), fp16(48, 2, 64)
    for _ in range(2):
        module.attention_varlen(q, k, k, CU, CU, 23, 23)
    assert module.config_for(48) is module.CONFIG, "no shorter configs: CONFIG is the config"
    monkeypatch.setattr(module, "CONFIG", dict(module.CONFIG, BLOCK_N=16))
    module.attention_varlen(q, k, k, CU, CU, 23, 23)
    assert kernel.bound[-1][1][block_n] == 16
    (plan,) = module._CALL_PLANS.values()
    assert plan[0]["BLOCK_N"] == 16  # (config, ...)
