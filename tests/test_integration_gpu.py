"""Generated kernels in a real model on the H200 (`pytest -m gpu`, tools/gpu_integrate.sh).

- a Llama-3-8B-shaped model (2 layers, random bf16 weights) generates through the committed
  generated/sm90 llama3_8b modules, prefill and decode, padded and unpadded, and agrees
  with SDPA;
- torch.compile(fullgraph=True) with Inductor traces through the attngen ops;
- a CUDA graph captures an attngen call (prefill, and a KV-cache decode step) and replays it;
- with transformers' static cache the decode steps run on a contiguous decode module, eager
  and as generate()'s compiled CUDA-graph replays (mode "reduce-overhead", no cudagraph
  skip), and so do a DynamicCache's, and agree with SDPA;
- the model's loss.backward() through the module's gradient kernels gives every parameter's
  gradient within the bf16 yardstick of SDPA's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attngen
from attngen.runtime import ops
from attngen.runtime.registry import load_kernels
from attngen.spec import load_spec_file
from attngen.tuning.database import NOT_TUNED_ON

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


@pytest.fixture(scope="module", autouse=True)
def repo_kernels():
    load_kernels()  # the committed generated/ (or $ATTNGEN_KERNELS)


def llama_config(layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        dtype="bfloat16",
    )


@pytest.fixture(scope="module")
def llama():
    import transformers

    config = llama_config(2)
    # the model's attention is the example's, so the committed llama3_8b modules serve it
    spec = attngen.spec_from_config(config)[0].canonical()
    example = load_spec_file(ROOT / "examples" / "llama3_8b.yaml")[0].canonical()
    assert {k: v for k, v in spec.items() if k not in NOT_TUNED_ON} == {
        k: v for k, v in example.items() if k not in NOT_TUNED_ON
    }
    attngen.register_transformers()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


@pytest.fixture(scope="module")
def llama32(llama):
    """The same weights in float32: the reference the bf16 runs are judged against."""
    import copy

    return copy.deepcopy(llama).float()


def _generate(model, impl, ids, mask, new_tokens=16, **options):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **options,
        )


@pytest.mark.parametrize("padded", [False, True])
def test_llama_generate_agrees_with_sdpa(llama, llama32, padded):
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, 128256, (4, 300), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        for row, pad in enumerate((0, 17, 128, 299)):
            ids[row, :pad], mask[row, :pad] = 0, 0
    expected = _generate(llama, "sdpa", ids, mask)
    ops.reset_run_counts()
    with attngen.dispatch_log() as log:
        got = _generate(llama, "attngen", ids, mask)
    kind = "varlen" if padded else "prefill"
    prefill = f"sm90/llama3_8b_{kind}_bf16_d128_causal_br_bwd"
    assert log[:2] and all(d.module == prefill for d in log[:2])  # 2 layers
    if padded:
        assert all(d.module == prefill for d in log[2:])
    else:  # a DynamicCache's steps: on a contiguous decode module (bundled: any heads)
        assert all(d.need.kind.value == "decode" and d.fallback is None for d in log[2:])
    assert sum(ops.run_counts().values()) == len(log) == 2 * 16
    # bf16 logits through a bf16 model differ from the exact ones by the rounding of every
    # layer (|logit| reaches ~2.3 here, where a bf16 ulp is 2**-6): judge attngen as
    # RELIABILITY.md judges a kernel, against a float32 copy of the model run with SDPA, with
    # SDPA's own bf16 error as the yardstick (2x, plus a floor of two bf16 ulps at the
    # logits' magnitude). Greedy tokens may part at a near-tie after some steps: compare the
    # steps up to the first token on which the three runs differ (the first step, the
    # prefill's logits, always counts).
    reference = _generate(llama32, "sdpa", ids, mask)
    _judge(got, expected, reference, ids.shape[1])


def _judge(got, expected, reference, prompt):
    """attngen's logits (got) against SDPA's (expected), both bf16, with a float32 copy of the
    model (reference) as the yardstick; see test_llama_generate_agrees_with_sdpa."""
    runs = [r.sequences[:, prompt:] for r in (got, expected, reference)]
    same = ((runs[0] == runs[1]) & (runs[1] == runs[2])).all(0).int().cumprod(0)
    steps = max(1, int(same.sum()))
    for a, b, exact in zip(
        got.logits[:steps], expected.logits[:steps], reference.logits[:steps], strict=True
    ):
        exact = exact.float()
        ours, sdpa = (a.float() - exact).abs().max().item(), (b.float() - exact).abs().max().item()
        floor = 2 * 2.0 ** (torch.frexp(exact.abs().max()).exponent.item() - 8)
        assert ours <= 2 * sdpa + floor, (ours, sdpa, floor)


def test_compile_fullgraph_inductor():
    q = torch.randn(2, 32, 1024, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def layer(q, k, v):
        return attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    eager = layer(q, k, v)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")(q, k, v)
    assert torch.equal(compiled, eager)


def test_cuda_graph_capture_of_attngen_calls():
    q = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(8, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(8, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    seqlens = torch.randint(1, 1000, (8,), device="cuda", dtype=torch.int32)

    def step():
        return attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True
        )

    expected = step()  # warm-up: compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.copy_(torch.randn_like(q))
    eager = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and not torch.equal(out, expected)


@pytest.mark.parametrize("mode", ["static", "graph", "dynamic"])
def test_llama_cache_decode_module(llama, llama32, tmp_path, mode):
    """generate()'s decode steps run on a contiguous decode module (built from the config here:
    the committed llama3_8b one is paged) with a static cache, eager or in generate()'s
    compiled forward (CUDA graphs, none skipped), and with a DynamicCache, and agree with
    SDPA."""
    import transformers
    from torch._dynamo.utils import counters

    from attngen.build import plan_build, write_build
    from attngen.spec import specs_from_data
    from attngen.spec.hf import spec_data_from_config

    data = spec_data_from_config(llama.config, archs=["sm90"], name="llama_static")
    data.update(kernels=["decode"], kv_layout="contiguous")
    write_build(plan_build(specs_from_data(data)), tmp_path)
    load_kernels(tmp_path)
    compiled = mode == "graph"
    if compiled:
        options = {"compile_config": transformers.CompileConfig(mode="reduce-overhead")}
    else:
        options = {"disable_compile": True}
    if mode != "dynamic":
        options["cache_implementation"] = "static"
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(1, 128256, (4, 300), device="cuda", generator=gen)
        mask = torch.ones_like(ids)
        expected = _generate(llama, "sdpa", ids, mask, **options)
        torch._dynamo.reset()
        counters.clear()
        with attngen.dispatch_log() as log:
            got = _generate(llama, "attngen", ids, mask, **options)
        decode = "sm90/llama_static_decode_bf16_d128_causal_br_contig"
        # the prefill: a static cache's on the varlen kind (its unwritten keys dropped)
        prefill_kind = "prefill" if mode == "dynamic" else "varlen"
        assert log and all(d.need.kind.value == prefill_kind for d in log[:2])
        assert {d.module for d in log[2:]} == {decode}  # 2 layers: the prefill's 2 calls
        if compiled:
            assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        else:
            assert len(log) == 2 * 16
        reference = _generate(llama32, "sdpa", ids, mask)
        _judge(got, expected, reference, ids.shape[1])
    finally:
        load_kernels()
        torch._dynamo.reset()


def parameter_gradients(model, implementation: str, ids) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the causal-LM loss on ids (fp32 copies); the model's own
    gradients are cleared before and after."""
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        return {name: p.grad.float().clone() for name, p in model.named_parameters()}
    finally:
        model.zero_grad(set_to_none=True)


def test_llama_training_gradients_agree_with_sdpa(llama, llama32):
    """loss.backward() of a Llama-3-8B-shaped 2-layer model through the committed llama3_8b
    module's gradient kernels (backward: true): every parameter's gradient against the float32
    copy's (SDPA), with SDPA's own bf16 gradients as the yardstick (RELIABILITY.md's rule for
    gradients: max error within 3x SDPA's plus a floor of two bf16 ulps at the gradient's
    magnitude, mean error within 1.5x plus the same floor)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, 128256, (2, 1024), device="cuda", generator=gen)
    ops.reset_run_counts()
    with attngen.dispatch_log() as log:
        ours = parameter_gradients(llama, "attngen", ids)
    assert log and all(
        d.module == "sm90/llama3_8b_prefill_bf16_d128_causal_br_bwd" and d.fallback is None
        for d in log
    )
    assert sum(ops.run_counts().values()) >= 2  # the forward of both layers ran on the module
    sdpa = parameter_gradients(llama, "sdpa", ids)
    exact = parameter_gradients(llama32, "sdpa", ids)
    assert ours.keys() == exact.keys()
    for name, want in exact.items():
        floor = 2 * 2.0 ** (torch.frexp(want.abs().max()).exponent.item() - 8)
        error, yardstick = (ours[name] - want).abs(), (sdpa[name] - want).abs()
        assert error.max() <= 3 * yardstick.max() + floor, (name, error.max(), yardstick.max())
        assert error.mean() <= 1.5 * yardstick.mean() + floor, (name, error.mean())
