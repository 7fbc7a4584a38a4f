"""Training through kernels built on demand: a call whose inputs require grad (grad mode on)
needs gradient kernels from its forward on, so from an empty cache it builds a module with
`backward: true` and trains; a module that cannot serve the backward never serves such a
call, whatever was built or loaded before; and a cache hit says it was built earlier."""

from __future__ import annotations

import pytest
import torch
import transformers

import attngen
from attngen.build import plan_build, write_build
from attngen.reference.backward import compare_gradients
from attngen.runtime import registry
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import specs_from_data
from tests.backward_harness import cu_seqlens, padded_inputs
from tests.kernel_harness import make_spec
from tests.ondemand_harness import on_demand  # noqa: F401

# A head dim and head counts no bundled module has, so every call below is built on demand.
FIELDS = dict(dtype="fp16", head_dim=59, num_q_heads=6, num_kv_heads=2, mask="causal")


def _spec(align: str):
    return make_spec(**FIELDS, causal_align=align, backward=True)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _flash(q, k, v):
    return attngen.flash_attn_func(q, k, v, causal=True)


def _train_flash(seed: int):
    """flash_attn_func's gradients from [B, N, H, D] leaves, judged in [B, H, N, D]."""
    spec = _spec("bottom_right")
    q, k, v, dout, _ = padded_inputs(spec, 2, 6, 2, 13, 21, seed=seed)
    leaves = _leaves(*(t.transpose(1, 2) for t in (q, k, v)))
    _flash(*leaves).backward(dout.transpose(1, 2))
    grads = [t.grad.transpose(1, 2) for t in leaves]
    return compare_gradients(spec, grads, q, k, v, dout)


def test_flash_attn_func_trains_from_an_empty_cache(on_demand):  # noqa: F811
    problems = _train_flash(seed=1)
    assert not problems, "; ".join(problems)
    served = attngen.last_dispatch()
    assert served.built and served.module.endswith("_bwd"), served.reason
    assert "backward=True" in served.reason


def test_sdpa_trains_from_an_empty_cache(on_demand):  # noqa: F811
    spec = _spec("top_left")
    q, k, v, dout, _ = padded_inputs(spec, 1, 6, 2, 17, 17, seed=2)
    leaves = _leaves(q, k, v)
    out = attngen.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(dout)
    problems = compare_gradients(spec, [t.grad for t in leaves], q, k, v, dout)
    assert not problems, "; ".join(problems)
    assert attngen.last_dispatch().module.endswith("_causal_tl_bwd")


def test_flash_attn_varlen_func_trains_from_an_empty_cache(on_demand):  # noqa: F811
    spec = _spec("bottom_right")
    lengths_q, lengths_k = [9, 0, 14], [12, 3, 14]
    q, k, v, dout, _ = padded_inputs(spec, 1, 6, 2, sum(lengths_q), sum(lengths_k), seed=3)
    packed = [t[0].transpose(0, 1) for t in (q, k, v, dout)]
    leaves = _leaves(*packed[:3])
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    out = attngen.flash_attn_varlen_func(
        *leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True
    )
    out.backward(packed[3])
    assert attngen.last_dispatch().module.split("/")[-1].startswith("auto_h6kv2_varlen")
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rq, rk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        pieces = ((packed[0], rq), (packed[1], rk), (packed[2], rk), (packed[3], rq))
        seq = [t[r].transpose(0, 1)[None] for t, r in pieces]
        grads = [t.grad[r].transpose(0, 1)[None] for t, r in zip(leaves, (rq, rk, rk), strict=True)]
        problems = compare_gradients(spec, grads, *seq)
        assert not problems, f"sequence {b}: " + "; ".join(problems)


def test_transformers_trains_from_an_empty_cache(on_demand):  # noqa: F811
    """A tiny Llama's loss.backward() with attn_implementation="attngen" and nothing built:
    the layers' modules are built with gradient kernels, and every parameter's gradient is
    SDPA's."""
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
    assert attngen.last_dispatch().module.endswith("_bwd")
    for name, expected in grads["sdpa"].items():
        # fp32 evaluations of the same math in different summation orders: a few fp32 ulps
        # of each gradient after two layers and the loss (as test_backward_runtime's).
        torch.testing.assert_close(grads["attngen"][name], expected, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------- cache history, load order


def test_an_evaluation_call_first_does_not_stop_training(on_demand):  # noqa: F811
    """The evaluation call caches a forward-only module; the training call after it, with the
    same shapes, builds and runs the module with gradient kernels."""
    spec = _spec("bottom_right")
    q, k, v, _, _ = padded_inputs(spec, 2, 6, 2, 13, 21, seed=1)
    with torch.no_grad():
        _flash(*(t.transpose(1, 2) for t in (q, k, v)))
    evaluated = attngen.last_dispatch().module
    assert not evaluated.endswith("_bwd")
    problems = _train_flash(seed=1)
    assert not problems, "; ".join(problems)
    assert attngen.last_dispatch().module == evaluated + "_bwd"
    with torch.no_grad():  # evaluation keeps whichever module serves it: both do
        _flash(*(t.transpose(1, 2) for t in (q, k, v)))
    assert attngen.last_dispatch().module in (evaluated, evaluated + "_bwd")


def test_a_dropout_call_first_and_a_training_call_after(on_demand):  # noqa: F811
    spec = _spec("bottom_right")
    q, k, v, _, _ = padded_inputs(spec, 2, 6, 2, 13, 21, seed=1)
    with torch.no_grad():
        attngen.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), 0.25, causal=True)
    assert attngen.last_dispatch().module.endswith("_bwd_drop")
    problems = _train_flash(seed=1)
    assert not problems, "; ".join(problems)
    assert attngen.last_dispatch().module.endswith(("_bwd", "_bwd_drop"))


def _twins(tmp_path):
    """Two folders: a forward-only module and its `backward: true` twin (one name apart)."""
    data = dict(
        name="twin", archs=["sm90"], causal_align="bottom_right", kernels=["prefill"], **FIELDS
    )
    folders = []
    for backward in (False, True):
        folder = tmp_path / f"backward_{backward}"
        write_build(plan_build(specs_from_data({**data, "backward": backward})), folder)
        folders.append(folder)
    return folders


@pytest.mark.parametrize("order", ["forward_only_first", "backward_first"])
def test_the_twin_with_gradient_kernels_serves_a_training_call(tmp_path, order):
    """Whatever the load order, a call that needs gradients runs the module that has them,
    and one that needs none may run either."""
    forward_only, with_backward = _twins(tmp_path)
    folders = [forward_only, with_backward]
    if order == "backward_first":
        folders.reverse()
    saved = current_registry()  # on-demand builds are off in the suite (conftest.py)
    try:
        load_kernels(*folders, replace=True)
        problems = _train_flash(seed=4)
        assert not problems, "; ".join(problems)
        assert attngen.last_dispatch().module == "sm90/twin_prefill_fp16_d59_causal_br_bwd"
    finally:
        use_registry(saved)


def test_a_cache_hit_says_the_module_was_built_earlier(on_demand):  # noqa: F811
    spec = _spec("bottom_right")
    q, k, v, _, _ = padded_inputs(spec, 2, 6, 2, 13, 21, seed=1)
    args = [t.transpose(1, 2) for t in (q, k, v)]
    with torch.no_grad():
        _flash(*args)
        first = attngen.last_dispatch()
        renders = registry.render_count()
        _flash(*(t.clone() for t in args))  # a new call: the plan's and dispatch's caches
        again = attngen.last_dispatch()
        _flash(args[0][:, :10], *args[1:])  # another shape: the same module, from the cache
        other = attngen.last_dispatch()
    assert "built on demand now into" in first.reason and first.built
    assert registry.render_count() == renders
    for later in (again, other):
        if later is first:
            continue  # a planned call records nothing new
        assert not later.built
        assert "built on demand earlier, from the cache" in later.reason, later.reason
        assert "built on demand now" not in later.reason
