"""The prefill modules' entry point in flash-attn's layout, `attention_flash`, on the CPU: bit
for bit attention() on the [B, H, N, D] views (the same kernel launch, from its plan too, on
the pointer and the TMA paths), its out= and errors; and the public functions that reach it
(flash_attn_func, the transformers function) with no view, no output view and no copy of
their own on a planned call."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import attngen
from attngen.runtime.hf import attngen_attention
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import routes
from attngen.tiling.code_paths import POINTER_LOADS_UP_TO
from tests.kernel_harness import load_kernel, make_spec
from tests.test_fast_launch import Address, FakeCompiled, fast, fp16
from tests.test_runtime_fast_path import flash_qkv

PREFILL = make_spec(name="flash", dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)
ROOT = Path(__file__).resolve().parent.parent
BACKWARD = make_spec(
    name="flashb", dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2, backward=True
)


def views(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def strided_inputs(batch=2, seqlen_q=24, seqlen_k=40):
    """q [B, M, 4, 64], k/v [B, N, 2, 64], none contiguous: q a slice of a wider head dim,
    k and v halves of one packed tensor."""
    q = fp16(batch, seqlen_q, 4, 128)[..., ::2]
    kv = fp16(batch, seqlen_k, 4, 64)
    return q, kv[:, :, :2], kv[:, :, 2:]


# ------------------------------------------------------------ the entry point itself


@pytest.mark.parametrize("spec", [PREFILL, BACKWARD], ids=["forward", "backward"])
def test_attention_flash_is_attention_on_the_views_bit_for_bit(spec):
    """Real kernels under the interpreter: strided inputs, with and without the LSE and out=
    (a strided one), equal attention() on the transposed views exactly; the output is
    [B, M, HQ, DV], contiguous, or the out= given."""
    module = load_kernel(spec)
    q, k, v = strided_inputs()
    expected, expected_lse = module.attention(*views(q, k, v), return_lse=True)
    out, lse = module.attention_flash(q, k, v, return_lse=True)
    assert out.shape == (2, 24, 4, 64) and out.is_contiguous()
    assert torch.equal(out, expected.transpose(1, 2)) and torch.equal(lse, expected_lse)
    out, lse = module.attention_flash_out(*views(q, k, v), return_lse=True)
    assert out.shape == (2, 24, 4, 64) and out.is_contiguous()
    assert torch.equal(out, expected.transpose(1, 2)) and torch.equal(lse, expected_lse)
    given = fp16(2, 24, 4, 96)[..., :64]
    assert module.attention_flash(q, k, v, out=given, sm_scale=0.3) is given
    assert torch.equal(given, module.attention(*views(q, k, v), sm_scale=0.3).transpose(1, 2))


def test_attention_flash_with_grad_is_attention_on_the_views():
    module = load_kernel(BACKWARD)
    q, k, v = (t.clone().requires_grad_() for t in strided_inputs(1, 16, 16))
    out = module.attention_flash(q, k, v)
    assert out.shape == (1, 16, 4, 64) and out.requires_grad
    expected = module.attention(*views(q, k, v)).transpose(1, 2)
    assert torch.equal(out, expected)
    (grad,) = torch.autograd.grad(out.float().sum(), q)
    (expected_grad,) = torch.autograd.grad(expected.float().sum(), q)
    assert torch.equal(grad, expected_grad)
    with pytest.raises(ValueError, match="out: not supported when q, k or v requires grad"):
        module.attention_flash(q, k, v, out=torch.empty_like(out))


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda q, k, v: (q[0], k, v, {}), r"q: expected rank 4 \[B, N, H, D\], got \(24, 4, 64\)"),
        (lambda q, k, v: (q, k, "v", {}), "v: expected a torch.Tensor, got str"),
        (
            lambda q, k, v: (q, k, v, {"out": fp16(2, 4, 24, 64)}),
            r"out: expected shape \(2, 24, 4, 64\)",
        ),
        (
            lambda q, k, v: (q, k, v, {"out": q}),
            "out: shares memory with q",
        ),
    ],
    ids=["rank", "type", "out shape", "out shares q"],
)
def test_attention_flash_refuses_with_the_flash_layout_named(make_call, message):
    module = load_kernel(PREFILL)
    q, k, v = (t.contiguous() for t in strided_inputs())
    *args, kwargs = make_call(q, k, v)
    with pytest.raises(ValueError, match=message):
        module.attention_flash(*args, **kwargs)


# ------------------------------------------------------------ its plan (launches faked)


def known(*tensors):
    return {t.data_ptr() for t in tensors}


def launched(args, inputs):
    """A launch's arguments as comparable values: the inputs' pointers as they are (the same
    tensors at every call), a new output by its alignment, TMA descriptors by their fields."""

    def one(a):
        if isinstance(a, (torch.Tensor, Address)):  # (a direct launch passes addresses)
            ptr = a.data_ptr()
            return ("tensor", a.dtype, ptr if ptr in inputs else ("new", ptr % 16 == 0))
        if isinstance(a, TensorDescriptor):
            base = a.base
            return ("desc", one(base), tuple(base.shape), base.stride(), list(a.shape),
                    list(a.strides), list(a.block_shape))  # fmt: skip
        return a

    return [one(a) for a in args]


def test_flash_plans_launch_what_attention_launches_for_the_views(monkeypatch):
    """attention_flash's calls from its plan launch what attention() launches for the views
    with an out= view (the route of flash_attn_func before attention_flash): the same
    compiled kernel, grid, pointers, ints, scale and TMA descriptors (of the views), on the
    pointer path and the TMA path, for strided and misaligned inputs, the LSE and out=."""
    module = load_kernel(PREFILL)
    fast(monkeypatch, module, "_attn_fwd_kernel")
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    monkeypatch.setattr(module, "_FLASH_PLANS", ({}, {}))
    log, run = [], FakeCompiled.run

    def logged(self, *args):
        run(self, *args)
        log.append((self, self.runs[-1][0], self.runs[-1][1]))

    monkeypatch.setattr(FakeCompiled, "run", logged)
    q, k, v = strided_inputs()
    out = fp16(2, 24, 4, 64)
    misaligned = fp16(2, 24, 4, 64, offset=1)
    cases = {
        "base": (q, k, v, {}),
        "scale, lse": (q, k, v, {"sm_scale": 0.5, "return_lse": True}),
        "out=": (q, k, v, {"out": out}),
        "misaligned q": (misaligned, k, v, {}),
        "contiguous": (q.contiguous(), k.contiguous(), v.contiguous(), {}),
    }
    for threshold in (0, POINTER_LOADS_UP_TO):
        monkeypatch.setattr(module, "POINTER_LOADS_UP_TO", threshold)
        for name, (q_, k_, v_, kwargs) in cases.items():
            inputs = known(q_, k_, v_, out)

            for _ in range(2):  # the views' plan made, then run from it
                given = kwargs.get("out", torch.empty(2, 24, 4, 64, dtype=torch.float16))
                module.attention(*views(q_, k_, v_), **dict(kwargs, out=given.transpose(1, 2)))
            expected = log[-1]
            entries = {
                "attention_flash": (module.attention_flash, (q_, k_, v_)),
                "attention_flash_out": (module.attention_flash_out, views(q_, k_, v_)),
            }
            for entry, (call, args) in entries.items():
                for _ in range(3):  # the full path (which keeps the plan), then the plan's runs
                    result = call(*args, **kwargs)
                    got = log[-1]
                    assert got[:2] == expected[:2], f"{entry}: {name}, threshold {threshold}"
                    assert launched(got[2], inputs) == launched(expected[2], inputs), name
                    out_ = result[0] if kwargs.get("return_lse") else result
                    assert out_.shape == (2, 24, 4, 64) and got[2][3].data_ptr() == out_.data_ptr()
    flash_plans, heads_first_plans = module._FLASH_PLANS[True], module._FLASH_PLANS[False]
    assert flash_plans and all(p.flash and p.compiled for p in flash_plans.values())
    assert heads_first_plans and all(not p.flash and p.compiled for p in heads_first_plans.values())


def test_a_planned_flash_layout_still_checks_its_out(monkeypatch):
    module = load_kernel(PREFILL)
    fast(monkeypatch, module, "_attn_fwd_kernel")
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    monkeypatch.setattr(module, "_FLASH_PLANS", ({}, {}))
    storage = fp16(2 * 2 * 24 * 4 * 64)
    q_shared, out_shared = storage.view(2, 2, 24, 4, 64)
    k, v = strided_inputs()[1:]
    q = fp16(2, 24, 4, 64)
    for _ in range(3):
        module.attention_flash(q, k, v, out=fp16(2, 24, 4, 64))
    (plan,) = module._FLASH_PLANS[True].values()
    assert plan.compiled and plan.out_shape == (2, 24, 4, 64)
    with pytest.raises(ValueError, match="out: shares memory with q"):
        module.attention_flash(q_shared, k, v, out=out_shared)


# ------------------------------------------------------------ the public functions


def count_flash_calls(monkeypatch, module, entry="attention_flash"):
    calls = []
    real = getattr(module, entry)

    def counted(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, entry, counted)
    return calls


def test_flash_attn_func_hands_its_tensors_to_attention_flash(toy_kernels, monkeypatch):
    """A planned flash_attn_func call gives the module q, k, v as they are (no view) and no
    out=, and returns the tensor attention_flash allocated: bit for bit the output of
    attention() on the views, for several query lengths (one row among them)."""
    for seqlen_q in (5, 1):
        q, k, v = flash_qkv(2, seqlen_q, 9, seed=seqlen_q)
        first = attngen.flash_attn_func(q, k, v, causal=True)
        module = current_registry().module(attngen.last_dispatch().key)
        calls = count_flash_calls(monkeypatch, module)
        routes(current_registry()).clear()  # plans bind the entry point: made after the count
        first = attngen.flash_attn_func(q, k, v, causal=True)  # each signature's plan
        attngen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert calls == []  # the full path calls attention_flash_out on [B, H, N, D] views
        out, lse, _ = attngen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        again = attngen.flash_attn_func(q, k, v, causal=True)
        assert len(calls) == 2 and all(a[0] is q and a[1] is k and a[2] is v for a, _ in calls)
        assert all("out" not in kwargs for _, kwargs in calls)
        expected, expected_lse = module.attention(*views(q, k, v), return_lse=True)
        assert out.shape == (2, seqlen_q, 4, 16) and out.is_contiguous()
        assert torch.equal(out, expected.transpose(1, 2)) and torch.equal(lse, expected_lse)
        assert torch.equal(again, out) and torch.equal(first, out)
        monkeypatch.undo()


def test_transformers_function_reaches_attention_flash(toy_kernels, monkeypatch):
    q, k, v = views(*flash_qkv(2, 6, 6))  # [B, H, N, D] views, as transformers passes
    layer = SimpleNamespace(is_causal=True)
    attngen_attention(layer, q, k, v, None)
    module = current_registry().module(attngen.last_dispatch().key)
    calls = count_flash_calls(monkeypatch, module, "attention_flash_out")
    routes(current_registry()).clear()  # plans bind the entry point: made after the count
    attngen_attention(layer, q, k, v, None)  # the full path, which leaves the plan
    out, _ = attngen_attention(layer, q, k, v, None)
    assert len(calls) == 2 and out.shape == (2, 6, 4, 16) and out.is_contiguous()
    assert all(a is b for call in calls for a, b in zip(call[0], (q, k, v), strict=True))
    expected = module.attention(q, k, v)
    assert torch.equal(out, expected.transpose(1, 2))


def test_every_module_the_templates_render_has_the_flash_entry_points():
    """The runtime calls attention_flash / attention_flash_out and decode_flash /
    decode_flash_out without asking whether a module has them: every prefill and decode module
    of the running attngen's templates defines them (generated/ holds one per example spec;
    the registry's header check refuses modules of any other attngen), and varlen modules
    have none (by kind)."""
    want = {
        "prefill": {"attention", "attention_flash", "attention_flash_out"},
        "decode": {"decode", "decode_flash", "decode_flash_out"},
        "varlen": {"attention_varlen"},
    }
    index = json.loads((ROOT / "generated" / "index.json").read_text())["modules"]
    assert {item["kind"] for item in index} == set(want)
    for item in index:
        tree = ast.parse((ROOT / "generated" / item["path"]).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert want[item["kind"]] <= defined, item["path"]
        if item["kind"] == "varlen":
            assert not {"attention_flash", "attention_flash_out"} & defined, item["path"]
