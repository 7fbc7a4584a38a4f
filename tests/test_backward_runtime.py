"""Training through the runtime: the torch.library ops' autograd formula calls the module's
backward, so flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention and the
transformers attention function train, and torch.compile(fullgraph=True) traces forward and
backward. A module built without backward refuses at the backward (test_runtime_refusals)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

import attngen
from attngen.build import plan_build, write_build
from attngen.reference.backward import compare_gradients, golden_backward
from attngen.runtime import backward_runs, ops, reset_backward_runs
from attngen.runtime.dispatch import Call
from attngen.runtime.launch import run_dense, run_varlen
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import CausalAlign, Mask, specs_from_data
from tests.backward_harness import cu_seqlens, padded_inputs

SPEC = dict(
    name="toy_bwd",
    archs=["sm90"],
    dtype="fp32",
    head_dim=16,
    num_q_heads=4,
    num_kv_heads=2,
    mask="causal",
    causal_align="bottom_right",
    kernels=["prefill", "varlen"],
    backward=True,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec = specs_from_data(SPEC)[0]
    folder = tmp_path_factory.mktemp("backward_kernels")
    write_build(plan_build([spec]), folder)
    saved = current_registry()
    load_kernels(folder, replace=True)
    yield spec
    use_registry(saved)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_flash_attn_func_trains(trained):
    q, k, v, dout, _ = padded_inputs(trained, 2, 4, 2, 17, 23, seed=1)
    leaves = _leaves(*(t.transpose(1, 2) for t in (q, k, v)))
    out = attngen.flash_attn_func(*leaves, causal=True, deterministic=True)
    out.backward(dout.transpose(1, 2))
    assert attngen.last_dispatch().module.endswith("toy_bwd_prefill_fp32_d16_causal_br_bwd")
    grads = [t.grad.transpose(1, 2) for t in leaves]
    problems = compare_gradients(trained, grads, q, k, v, dout)
    assert not problems, "; ".join(problems)


def test_a_planned_training_call_records_one_autograd_node(trained):
    """flash_attn_func from its plan, training: one autograd node on q, k, v themselves (no
    TransposeBackward for the module's [B, H, N, D] views: each costs a step host time)."""
    q, k, v, _, _ = padded_inputs(trained, 1, 4, 2, 11, 11, seed=7)
    leaves = _leaves(*(t.transpose(1, 2) for t in (q, k, v)))
    outs = [attngen.flash_attn_func(*leaves, causal=True) for _ in range(2)]  # then from a plan
    node = outs[1].grad_fn
    inputs = [type(fn).__name__ for fn, _ in node.next_functions if fn is not None]
    assert type(node).__name__ == "_EagerPrefillFlashBackward"
    assert inputs == ["AccumulateGrad"] * 3
    assert outs[1].shape == leaves[0].shape and outs[1].is_contiguous()
    assert torch.equal(outs[0], outs[1])


def test_a_call_with_grad_runs_from_its_plan_and_trains_alike(trained, monkeypatch):
    """flash_attn_func with grad: the first call takes the full path and leaves a plan, the
    second runs from it (the full path not entered) with bitwise the same gradients; the plan
    keeps `deterministic` (its backward path is recorded per call). SDPA's, the transformers
    function's and flash_attn_varlen_func's too."""
    from attngen.runtime import api, plans

    q, k, v, dout, _ = padded_inputs(trained, 1, 4, 2, 13, 13, seed=6)
    flash = [t.transpose(1, 2) for t in (q, k, v)]

    def train(deterministic):
        leaves = _leaves(*flash)
        out = attngen.flash_attn_func(*leaves, causal=True, deterministic=deterministic)
        out.backward(dout.transpose(1, 2))
        return [t.grad for t in leaves]

    first = train(True)
    full_paths = []
    real = api._flash
    monkeypatch.setattr(api, "_flash", lambda *a: full_paths.append(1) or real(*a))
    again = train(True)
    assert full_paths == [] and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(key[-1] is True for key in plans.planned(current_registry()))
    reset_backward_runs()
    train(False)  # another key: the full path, then its own plan
    assert full_paths == [1] and backward_runs()
    train(False)
    assert full_paths == [1]
    sdpa_full = []
    real_sdpa = api._sdpa
    monkeypatch.setattr(api, "_sdpa", lambda *a: sdpa_full.append(1) or real_sdpa(*a))
    grads = []
    for _ in range(2):  # the SDPA drop-in: the second call from its plan, alike
        leaves = _leaves(q, k, v)
        attngen.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(
            dout
        )
        grads.append([t.grad for t in leaves])
    assert sdpa_full == [1] and all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    from types import SimpleNamespace

    from attngen.runtime import hf

    hf_full = []
    real_dense = hf.run_dense
    monkeypatch.setattr(hf, "run_dense", lambda *a, **kw: hf_full.append(1) or real_dense(*a, **kw))
    grads = []
    for _ in range(2):  # the transformers function: the second call from its plan, alike
        leaves = _leaves(q, k, v)
        out, _ = hf.attngen_attention(SimpleNamespace(is_causal=True), *leaves, None)
        out.backward(dout.transpose(1, 2))
        grads.append([t.grad for t in leaves])
    assert hf_full == [1] and all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    varlen_full = []
    real_varlen = api._varlen
    monkeypatch.setattr(api, "_varlen", lambda *a: varlen_full.append(1) or real_varlen(*a))
    packed, cu = [t[0].transpose(0, 1) for t in (q, k, v, dout)], cu_seqlens([13])
    grads = []
    for _ in range(2):  # flash_attn_varlen_func: the second call from its plan, alike
        leaves = _leaves(*packed[:3])
        out = attngen.flash_attn_varlen_func(*leaves, cu, cu, 13, 13, causal=True)
        out.backward(packed[3])
        grads.append([t.grad for t in leaves])
    assert varlen_full == [1] and all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_flash_attn_varlen_func_trains(trained):
    lengths_q, lengths_k = [9, 0, 17], [12, 3, 17]
    q, k, v, dout, _ = padded_inputs(trained, 1, 4, 2, sum(lengths_q), sum(lengths_k), seed=2)
    packed = [t[0].transpose(0, 1) for t in (q, k, v, dout)]
    leaves = _leaves(*packed[:3])
    out = attngen.flash_attn_varlen_func(
        *leaves,
        cu_seqlens(lengths_q),
        cu_seqlens(lengths_k),
        max(lengths_q),
        max(lengths_k),
        causal=True,
    )
    out.backward(packed[3])
    starts_q, starts_k = cu_seqlens(lengths_q).tolist(), cu_seqlens(lengths_k).tolist()
    for b in range(3):
        rq, rk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        seq = [
            t[r].transpose(0, 1)[None]
            for t, r in ((packed[0], rq), (packed[1], rk), (packed[2], rk), (packed[3], rq))
        ]
        grads = [
            t.grad[r].transpose(0, 1)[None]
            for t, r in ((leaves[0], rq), (leaves[1], rk), (leaves[2], rk))
        ]
        problems = compare_gradients(trained, grads, *seq)
        assert not problems, f"sequence {b}: " + "; ".join(problems)


def test_sdpa_trains_and_compiles_forward_and_backward(trained):
    """SDPA's is_causal (Nq == Nk) with GQA; torch.compile(fullgraph=True) traces the forward
    and the backward through the ops (aot_eager: no code generation on the CPU), bitwise the
    eager gradients."""
    q, k, v, dout, _ = padded_inputs(trained, 1, 4, 2, 20, 20, seed=3)

    def loss(q, k, v):
        out = attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return (out * dout).sum()

    eager = _leaves(q, k, v)
    loss(*eager).backward()
    problems = compare_gradients(trained, [t.grad for t in eager], q, k, v, dout)
    assert not problems, "; ".join(problems)
    compiled = _leaves(q, k, v)
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*compiled).backward()
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_one_autograd_serves_the_module_and_the_runtime(trained, monkeypatch):
    """The runtime's op and the module's own attention() restore and differentiate through
    the module's one _gradients, bitwise alike; only the runtime's goes through its backward
    op's body (eager: without torch.library's dispatch), which counts the run and records the
    path (the module's own records nothing)."""
    q, k, v, dout, _ = padded_inputs(trained, 1, 4, 2, 20, 20, seed=4)
    attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    key = attngen.last_dispatch().key
    module = current_registry().module(key)
    calls = []
    real = module._gradients
    monkeypatch.setattr(module, "_gradients", lambda *a: calls.append(a[0].backward) or real(*a))
    reset_backward_runs()
    leaves = _leaves(q, k, v)
    module.attention(*leaves).backward(dout)
    assert calls == [module.attention_backward] and backward_runs() == {}
    through_runtime = _leaves(q, k, v)
    out = attngen.scaled_dot_product_attention(*through_runtime, is_causal=True, enable_gqa=True)
    out.backward(dout)
    assert len(calls) == 2 and calls[1].func is ops._prefill_grads
    assert calls[1].args == (key,)
    assert backward_runs() == {(key, "deterministic"): 1}
    for a, b in zip(leaves, through_runtime, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_tiny_llama_loss_backward_matches_sdpa(tmp_path):
    """A 2-layer random Llama's loss.backward() with attn_implementation="attngen" gives the
    parameter gradients SDPA gives (CPU, fp32)."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        dtype="float32",
    )
    specs = [
        s.model_copy(update={"backward": True})
        for s in attngen.spec_from_config(config, archs=["sm90"], name="tiny_llama")
    ]
    write_build(plan_build(specs), tmp_path)
    saved = current_registry()
    try:
        load_kernels(tmp_path, replace=True)
        assert attngen.register_transformers() == "attngen"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
        ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        grads = {}
        for implementation in ("sdpa", "attngen"):
            model.set_attn_implementation(implementation)
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            grads[implementation] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert attngen.last_dispatch().module.startswith("sm90/tiny_llama")
    finally:
        use_registry(saved)
    for name, expected in grads["sdpa"].items():
        # Both are fp32 evaluations of the same math in different summation orders; through
        # two layers and the loss their differences stay at a few fp32 ulps of each gradient.
        torch.testing.assert_close(grads["attngen"][name], expected, rtol=1e-4, atol=1e-6, msg=name)


SINKS_SPEC = dict(SPEC, name="toy_sinks", sinks=True, mask="chunked", chunk_size=8)


@pytest.fixture(scope="module")
def trained_sinks(tmp_path_factory):
    spec = specs_from_data(SINKS_SPEC)[0]
    folder = tmp_path_factory.mktemp("backward_sink_kernels")
    write_build(plan_build([spec]), folder)
    saved = current_registry()
    load_kernels(folder, replace=True)
    yield spec
    use_registry(saved)


def _sink_logits():
    return torch.randn(4, generator=torch.Generator().manual_seed(21)) * 2.0


def test_ops_return_the_sinks_gradient(trained_sinks):
    """The prefill op's autograd formula returns d sinks to sinks that require grad (a chunked
    module with sinks); torch.compile(fullgraph=True) traces it, bitwise the eager gradients."""
    q, k, v, dout, _ = padded_inputs(trained_sinks, 2, 4, 2, 20, 20, seed=4)
    options = Call(
        mask=Mask.chunked,
        align=CausalAlign.bottom_right,
        window=None,
        softcap=None,
        alibi_slopes=None,
        scale=None,
        return_lse=False,
        fallback=None,
        chunk_size=8,
    )

    def loss(q, k, v, sinks):
        return (run_dense("test", q, k, v, replace(options, sinks=sinks))[0] * dout).sum()

    eager = _leaves(q, k, v, _sink_logits())
    loss(*eager).backward()
    assert attngen.last_dispatch().module.endswith("toy_sinks_prefill_fp32_d16_chunk8_br_sinks_bwd")
    grads = [t.grad for t in eager]
    problems = compare_gradients(trained_sinks, grads, q, k, v, dout, sinks=_sink_logits())
    assert not problems, "; ".join(problems)
    compiled = _leaves(q, k, v, _sink_logits())
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*compiled).backward()
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_varlen_op_returns_the_sinks_gradient(trained_sinks):
    """The varlen op, sequences [9, 0, 17]: d sinks is the sum of the sequences' golden d
    sinks (one padded call with the sequences side by side in the batch would mix lengths)."""
    lengths = [9, 0, 17]
    q, k, v, dout, _ = padded_inputs(trained_sinks, 1, 4, 2, sum(lengths), sum(lengths), seed=5)
    packed = [t[0].transpose(0, 1) for t in (q, k, v, dout)]
    leaves = _leaves(*packed[:3], _sink_logits())
    cu = cu_seqlens(lengths)
    out, _ = run_varlen(
        "test",
        *leaves[:3],
        cu,
        cu,
        17,
        17,
        Call(mask=Mask.chunked, align=CausalAlign.bottom_right, sinks=leaves[3], chunk_size=8),
    )
    out.backward(packed[3])
    starts = cu.tolist()
    golden = 0
    for b in range(3):
        rows = slice(starts[b], starts[b + 1])
        seq = [t[rows].transpose(0, 1)[None] for t in packed]
        golden = golden + golden_backward(trained_sinks, *seq, sinks=_sink_logits())[5]
    # Note: an fp32 kernel's d sinks sums 26 rows' fp32 terms of O(1): a few fp32 ulps of
    # rounding, far below 1e-5 relative, while a missing row or sequence moves it by O(0.1).
    torch.testing.assert_close(leaves[3].grad.double(), golden, rtol=1e-5, atol=1e-6)
