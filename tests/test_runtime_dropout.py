"""dropout_p through the runtime: flash_attn_func, flash_attn_varlen_func and
scaled_dot_product_attention dispatch a module built with dropout: true (`*_bwd_drop`), draw a
fresh Philox seed per call from the default generator of q's device, and hand the same state to
the backward. Output and gradients match the float64 reference given the kernels' own mask
(read back through the module's RNG helper); torch.manual_seed reproduces a call bitwise; with
no dropout module loaded the call is refused, naming dropout_p and the spec field."""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.build import plan_build, write_build
from attngen.reference.backward import (
    compare_gradients,
    golden_backward,
    gradient_problems,
    lowp_backward,
)
from attngen.runtime import dispatch, launch, plans
from attngen.runtime.arguments import dropout_rng_state
from attngen.runtime.hf import attngen_attention
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import specs_from_data
from tests.backward_harness import cu_seqlens, dropout_of, padded_inputs
from tests.ondemand_harness import on_demand  # noqa: F401

FIELDS = dict(
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
DROPPED = dict(name="toy_drop", dropout=True, **FIELDS)
PLAIN = dict(name="toy_plain", **FIELDS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Build folders: one with the dropout module, one with only the plain backward module."""
    built = {}
    for label, fields in (("dropout", DROPPED), ("plain", PLAIN)):
        folder = tmp_path_factory.mktemp(label)
        write_build(plan_build([specs_from_data(fields)[0]]), folder)
        built[label] = folder
    return built


@pytest.fixture
def dropout_kernels(folders):
    saved = current_registry()
    load_kernels(folders["dropout"], replace=True)
    yield specs_from_data(DROPPED)[0]
    use_registry(saved)


@pytest.fixture
def plain_kernels(folders):
    saved = current_registry()
    load_kernels(folders["plain"], replace=True)
    yield specs_from_data(PLAIN)[0]
    use_registry(saved)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _check_out_and_grads(spec, out, grads, q, k, v, dout, dropout):
    """[B, H, N, D] tensors: out by the forward rule (2x), gradients by the backward's."""
    golden = golden_backward(spec, q, k, v, dout, dropout=dropout)
    lowp = lowp_backward(spec, q, k, v, dout, dropout=dropout)
    problems = gradient_problems("out", out, golden[0], lowp[0], factor=2.0)
    return problems + compare_gradients(spec, grads, q, k, v, dout, dropout=dropout)


def test_flash_attn_func_trains_with_dropout(dropout_kernels):
    spec, p = dropout_kernels, 0.3
    q, k, v, dout, _ = padded_inputs(spec, 2, 4, 2, 17, 23, seed=1)
    leaves = _leaves(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.manual_seed(11)
    out = attngen.flash_attn_func(*leaves, dropout_p=p, causal=True)
    out.backward(dout.transpose(1, 2))
    assert attngen.last_dispatch().module.endswith("toy_drop_prefill_fp32_d16_causal_br_bwd_drop")
    torch.manual_seed(11)  # the state the call drew
    dropout = dropout_of(dropout_rng_state(q), p, 2, 4, 17, 23)
    problems = _check_out_and_grads(
        spec,
        out.detach().transpose(1, 2),
        [t.grad.transpose(1, 2) for t in leaves],
        q,
        k,
        v,
        dout,
        dropout,
    )
    assert not problems, "; ".join(problems)
    # the mask really dropped something: without it the output differs
    assert gradient_problems(
        "out",
        out.detach().transpose(1, 2),
        *[r[0] for r in (golden_backward(spec, q, k, v, dout), lowp_backward(spec, q, k, v, dout))],
        factor=2.0,
    )


def test_flash_attn_varlen_func_trains_with_dropout(dropout_kernels):
    """Sequence b draws its mask as batch b of a padded call."""
    spec, p = dropout_kernels, 0.25
    lengths_q, lengths_k = [9, 0, 17], [12, 3, 17]
    q, k, v, dout, _ = padded_inputs(spec, 1, 4, 2, sum(lengths_q), sum(lengths_k), seed=2)
    packed = [t[0].transpose(0, 1) for t in (q, k, v, dout)]
    leaves = _leaves(*packed[:3])
    torch.manual_seed(12)
    out = attngen.flash_attn_varlen_func(
        *leaves,
        cu_seqlens(lengths_q),
        cu_seqlens(lengths_k),
        max(lengths_q),
        max(lengths_k),
        dropout_p=p,
        causal=True,
    )
    out.backward(packed[3])
    assert attngen.last_dispatch().module.endswith("_varlen_fp32_d16_causal_br_bwd_drop")
    torch.manual_seed(12)
    state = dropout_rng_state(q)
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
        dropout = dropout_of(state, p, 1, 4, lengths_q[b], lengths_k[b], batch_head0=b * 4)
        problems = _check_out_and_grads(
            spec, out.detach()[rq].transpose(0, 1)[None], grads, *seq, dropout
        )
        assert not problems, f"sequence {b}: " + "; ".join(problems)


def test_sdpa_dropout_forward_without_grad(dropout_kernels):
    """Dropout applies whenever dropout_p is given (as in torch's SDPA), also without grad."""
    spec, p = dropout_kernels, 0.5
    q, k, v, dout, _ = padded_inputs(spec, 1, 4, 2, 20, 20, seed=3)
    torch.manual_seed(13)
    out = attngen.scaled_dot_product_attention(
        q, k, v, dropout_p=p, is_causal=True, enable_gqa=True
    )
    torch.manual_seed(13)
    dropout = dropout_of(dropout_rng_state(q), p, 1, 4, 20, 20)
    golden = golden_backward(spec, q, k, v, dout, dropout=dropout)
    lowp = lowp_backward(spec, q, k, v, dout, dropout=dropout)
    assert not gradient_problems("out", out, golden[0], lowp[0], factor=2.0)
    # flash_attn_func's layout, written in place through the module's out=, the same draw
    torch.manual_seed(13)
    flash = attngen.flash_attn_func(
        *(t.transpose(1, 2) for t in (q, k, v)), dropout_p=p, causal=True
    )
    assert torch.equal(flash.transpose(1, 2), out)


def _sdpa_step(q, k, v, dout, p):
    leaves = _leaves(q, k, v)
    out = attngen.scaled_dot_product_attention(
        *leaves, dropout_p=p, is_causal=True, enable_gqa=True
    )
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


def test_a_fresh_seed_per_call_reproducible_under_manual_seed(dropout_kernels):
    q, k, v, dout, _ = padded_inputs(dropout_kernels, 1, 4, 2, 16, 16, seed=4)
    torch.manual_seed(5)
    first, second = _sdpa_step(q, k, v, dout, 0.4), _sdpa_step(q, k, v, dout, 0.4)
    torch.manual_seed(5)
    again = _sdpa_step(q, k, v, dout, 0.4)
    assert not torch.equal(first[0], second[0])  # two calls, two masks
    for a, b in zip(first, again, strict=True):  # out, dq, dk, dv: bitwise
        assert torch.equal(a, b)


def test_compiled_training_step_draws_what_eager_draws(dropout_kernels):
    """torch.compile(fullgraph=True) traces the seed draw and both ops (aot_eager: no code
    generation on the CPU): under one manual_seed, the eager step's bytes."""
    q, k, v, dout, _ = padded_inputs(dropout_kernels, 1, 4, 2, 16, 16, seed=6)

    def loss(q, k, v):
        out = attngen.scaled_dot_product_attention(
            q, k, v, dropout_p=0.2, is_causal=True, enable_gqa=True
        )
        return (out * dout).sum()

    grads = []
    for step in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaves = _leaves(q, k, v)
        torch.manual_seed(7)
        step(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_no_dropout_module_refuses_naming_dropout_p(plain_kernels):
    q, k, v, _, _ = padded_inputs(plain_kernels, 1, 4, 2, 8, 8, seed=7)
    flash = [t.transpose(1, 2) for t in (q, k, v)]
    with pytest.raises(attngen.NoKernelError) as info:
        attngen.flash_attn_func(*flash, dropout_p=0.1, causal=True)
    text = str(info.value)
    assert "dropout_p>0" in text and "dropout_p: needs a module built with dropout: true" in text
    assert "toy_plain" in text  # the nearest module, and why it does not serve
    with pytest.raises(attngen.NoKernelError, match="dropout_p: needs a module"):
        attngen.scaled_dot_product_attention(
            q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True
        )
    # without dropout the plain module serves the same call
    attngen.flash_attn_func(*flash, causal=True)
    assert attngen.last_dispatch().module.endswith("toy_plain_prefill_fp32_d16_causal_br_bwd")


def test_dropout_argument_errors(dropout_kernels):
    q, k, v, _, _ = padded_inputs(dropout_kernels, 1, 4, 2, 8, 8, seed=8)
    flash = [t.transpose(1, 2) for t in (q, k, v)]
    for bad in (1.0, -0.5, float("nan"), "0.1", True):
        for probs in (False, True):  # return_attn_probs draws its state only for a valid p
            with pytest.raises(ValueError, match="dropout_p: expected a float in \\[0, 1\\)"):
                attngen.flash_attn_func(*flash, dropout_p=bad, causal=True, return_attn_probs=probs)
    # dropout_p = 0 runs on the dropout module too (its kernels without the RNG); S_dmask is
    # flash-attn's empty tensor there (tests/test_attn_probs.py: with dropout)
    out, lse, probs = attngen.flash_attn_func(*flash, causal=True, return_attn_probs=True)
    assert probs.shape == (0,) and attngen.last_dispatch().module.endswith("_bwd_drop")


def test_on_demand_builds_a_dropout_module(on_demand):  # noqa: F811
    """With on-demand builds on, a dropout call no loaded module serves gets a module built
    with backward: true and dropout: true, which trains."""
    spec, p = specs_from_data(DROPPED)[0], 0.3
    q, k, v, dout, _ = padded_inputs(spec, 1, 4, 2, 9, 12, seed=9)
    leaves = _leaves(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.manual_seed(14)
    out = attngen.flash_attn_func(*leaves, dropout_p=p, causal=True)
    out.backward(dout.transpose(1, 2))
    built = attngen.last_dispatch()
    assert built.built and built.module == "sm80/auto_h4kv2_prefill_fp32_d16_causal_br_bwd_drop"
    torch.manual_seed(14)
    dropout = dropout_of(dropout_rng_state(q), p, 1, 4, 9, 12)
    problems = _check_out_and_grads(
        spec,
        out.detach().transpose(1, 2),
        [t.grad.transpose(1, 2) for t in leaves],
        q,
        k,
        v,
        dout,
        dropout,
    )
    assert not problems, "; ".join(problems)


def test_transformers_function_applies_the_layers_dropout(folders):
    """attention_dropout in training reaches the kernels as flash_attn_func's dropout_p: the
    same draw gives the same bytes; without a dropout module it is refused by name."""
    layer = torch.nn.Module()
    layer.is_causal, layer.layer_idx = True, 0
    q, k, v, _, _ = padded_inputs(specs_from_data(DROPPED)[0], 1, 4, 2, 12, 12, seed=10)
    saved = current_registry()
    try:
        load_kernels(folders["dropout"], replace=True)
        torch.manual_seed(15)
        out, _ = attngen_attention(layer, q, k, v, None, dropout=0.2)
        assert attngen.last_dispatch().module.endswith("_bwd_drop")
        torch.manual_seed(15)
        flash = attngen.flash_attn_func(
            *(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.2, causal=True
        )
        assert torch.equal(out, flash)
        load_kernels(folders["plain"], replace=True)
        with pytest.raises(attngen.NoKernelError, match="dropout_p: needs a module built"):
            attngen_attention(layer, q, k, v, None, dropout=0.2)
    finally:
        use_registry(saved)


def _entry_points(spec):
    """Eager no-grad calls of one signature each, by dropout_p: the public functions (and the
    transformers function) whose signatures plans.py plans."""
    q, k, v, _, _ = padded_inputs(spec, 1, 4, 2, 12, 12, seed=11)
    flash_qkv = [t.transpose(1, 2) for t in (q, k, v)]
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = cu_seqlens([5, 7])
    layer = torch.nn.Module()
    layer.is_causal, layer.layer_idx = True, 0
    return {
        "sdpa": lambda p: attngen.scaled_dot_product_attention(
            q, k, v, dropout_p=p, is_causal=True, enable_gqa=True
        ),
        "flash": lambda p: attngen.flash_attn_func(*flash_qkv, dropout_p=p, causal=True),
        "varlen": lambda p: attngen.flash_attn_varlen_func(
            *packed, cu, cu, 7, 7, dropout_p=p, causal=True
        ),
        "transformers": lambda p: attngen_attention(layer, q, k, v, None, dropout=p)[0],
    }


@pytest.mark.parametrize("name", ["sdpa", "flash", "varlen", "transformers"])
def test_dropout_calls_are_never_planned(dropout_kernels, monkeypatch, name):
    """A signature planned at dropout_p=0 (its second call skips the full path) still draws a
    fresh seed on every dropout call: each one takes the full path, two calls drop differently,
    and no plan is left for them (a plan would run the module without drawing a seed)."""
    seeds, full_path = [], []
    real_need, real_draw = dispatch.need_for, launch.dropout_rng_state
    monkeypatch.setattr(  # the Call's Need (dispatch.Call.need)
        dispatch, "need_for", lambda *a, **kw: full_path.append(1) or real_need(*a, **kw)
    )
    monkeypatch.setattr(
        launch, "dropout_rng_state", lambda q: seeds.append(real_draw(q)) or seeds[-1]
    )
    call = _entry_points(dropout_kernels)[name]
    with torch.no_grad():
        plain = call(0.0)
        assert torch.equal(call(0.0), plain) and len(full_path) == 1  # the second was planned
        planned = plans.planned(current_registry())
        dropped = [call(0.4) for _ in range(3)]
        assert torch.equal(call(0.0), plain) and len(full_path) == 4  # still planned
    assert len(seeds) == 3 and len({int(s[0]) for s in seeds}) == 3  # a fresh seed per call
    assert not torch.equal(dropped[0], dropped[1]) and not torch.equal(dropped[1], dropped[2])
    assert all(not torch.equal(d, plain) for d in dropped)
    assert plans.planned(current_registry()) == planned  # the dropout calls left no plan
