"""The backward at real sizes on a CUDA GPU (the H200): `pytest -m gpu`.

The derived tile configs (not the CPU suite's 16-row blocks), compiled kernels (bf16 numerics,
FMA contraction, Triton's integer specialization), against the float64 golden (computed on the
CPU from the same inputs) by the rule of shared/RELIABILITY.md; bitwise determinism; dropout's
keep rate; the committed example modules with backward (llama3_8b, gpt-oss-20b, Llama-4-Scout);
and the newer models' fields (sinks and d sinks, chunked masks, sink tokens).
tools/gpu_backward.sh runs this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attngen.reference.backward import (
    compare_gradients,
    golden_backward,
    gradient_problems,
    lowp_backward,
)
from tests.backward_harness import backward_spec, cu_seqlens, packed_inputs, padded_inputs
from tests.kernel_harness import load_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "causal-bf16-d128-gqa4": dict(dtype="bf16", head_dim=128, num_q_heads=8, num_kv_heads=2),
    "none-fp16-d64": dict(dtype="fp16", head_dim=64, mask="none", num_q_heads=4, num_kv_heads=4),
    "window-cap-bf16-d256": dict(
        dtype="bf16",
        head_dim=256,
        mask="sliding_window",
        window_left=200,
        window_right=0,
        softcap=30.0,
        num_q_heads=4,
        num_kv_heads=1,
    ),
    "alibi-tl-fp16-d96-dv64": dict(
        dtype="fp16",
        head_dim=96,
        head_dim_v=64,
        alibi=True,
        causal_align="top_left",
        num_q_heads=7,
        num_kv_heads=1,
    ),
    "causal-fp32-d80": dict(dtype="fp32", head_dim=80, num_q_heads=2, num_kv_heads=1),
}


def _grads(module, q, k, v, dout, slopes, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module.attention(*leaves, alibi_slopes=slopes, **options)
    out.backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1000), (257, 700), (700, 257)])
def test_gradients_at_real_sizes(name, seqlen_q, seqlen_k):
    fields = CASES[name]
    spec = backward_spec(**fields)
    module = load_kernel(spec)
    q, k, v, dout, slopes = padded_inputs(
        spec, 2, fields["num_q_heads"], fields["num_kv_heads"], seqlen_q, seqlen_k, seed=1
    )
    cuda = [t.cuda() for t in (q, k, v, dout)]
    grads = _grads(module, *cuda, None if slopes is None else slopes.cuda())
    problems = compare_gradients(spec, [g.cpu() for g in grads], q, k, v, dout, alibi_slopes=slopes)
    assert not problems, "; ".join(problems)


def test_backward_is_bitwise_deterministic_on_the_gpu():
    spec = backward_spec(dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8, dropout=True)
    module = load_kernel(spec)
    inputs = [t.cuda() for t in padded_inputs(spec, 2, 32, 8, 2048, 2048, seed=2)[:4]]
    state = torch.tensor([5, 0], dtype=torch.int64, device="cuda")
    first = _grads(module, *inputs, None, dropout_p=0.1, rng_state=state)
    second = _grads(module, *inputs, None, dropout_p=0.1, rng_state=state)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_dropout_keeps_one_minus_p():
    """The forward's output with v = ones is keep_scale x the kept share of P per row: its
    mean over many rows is 1 within a binomial bound."""
    spec = backward_spec(
        dtype="fp32", head_dim=64, mask="none", dropout=True, num_q_heads=4, num_kv_heads=4
    )
    module = load_kernel(spec)
    q = torch.zeros(1, 4, 512, 64, device="cuda")  # uniform P = 1 / N
    v = torch.ones(1, 4, 512, 64, device="cuda")
    out = module.attention(q, q.clone(), v, dropout_p=0.3)
    kept = out[..., 0] * 0.7  # fraction of the 512 keys each row keeps
    assert abs(kept.mean().item() - 0.7) < 5 * (0.7 * 0.3 / kept.numel() / 512) ** 0.5


# The example specs with `backward: true` whose committed sm90 prefill module trains here.
COMMITTED = (
    "llama3_8b",
    "gpt_oss_20b_local",
    "gpt_oss_20b_global",
    "llama4_scout_chunked",
    "llama4_scout_global",
)


@pytest.mark.parametrize("name", COMMITTED)
def test_committed_example_module_trains(name):
    """The committed module (generated/sm90, its derived or tuned backward tiles) at the
    example's head counts: dQ, dK, dV (and d sinks for gpt-oss) by the rule."""
    from attngen.build import load_specs

    spec = next(s for s in load_specs(sorted((ROOT / "examples").glob("*.yaml"))) if s.name == name)
    index = json.loads((ROOT / "generated" / "index.json").read_text())
    entry = next(
        e
        for e in index["modules"]
        if e["arch"] == "sm90" and e["kind"] == "prefill" and e["spec"]["name"] == name
    )
    assert spec.backward and entry["module"].endswith("_bwd")
    import importlib.util

    module_spec = importlib.util.spec_from_file_location(
        f"{name}_bwd", ROOT / "generated" / entry["path"]
    )
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    hq, hkv = spec.num_q_heads, spec.num_kv_heads
    q, k, v, dout, _ = padded_inputs(spec, 1, hq, hkv, 600, 600, seed=3)
    problems = _gradient_problems(module, spec, hq, q, k, v, dout)
    assert not problems, "; ".join(problems)


def test_runtime_dropout_draws_from_the_cuda_generator(tmp_path):
    """flash_attn_func with dropout_p on CUDA: served by the `_bwd_drop` module, a fresh seed
    per call from torch.cuda's generator (two calls differ, torch.manual_seed repeats them
    bitwise), and the module's own attention() with that state gives the same bytes, forward
    and gradients."""
    import attngen
    from attngen.build import plan_build, write_build
    from attngen.runtime.arguments import dropout_rng_state
    from attngen.runtime.registry import current_registry, load_kernels, use_registry

    spec = backward_spec(dtype="bf16", head_dim=128, num_q_heads=8, num_kv_heads=2, dropout=True)
    write_build(plan_build([spec]), tmp_path)
    q, k, v, dout = (t.cuda() for t in padded_inputs(spec, 2, 8, 2, 700, 900, seed=4)[:4])
    flash = [t.transpose(1, 2) for t in (q, k, v)]

    def step(seed):
        torch.manual_seed(seed)
        leaves = [t.detach().clone().requires_grad_() for t in flash]
        out = attngen.flash_attn_func(*leaves, dropout_p=0.2, causal=True)
        out.backward(dout.transpose(1, 2))
        return [out.detach(), *(t.grad for t in leaves)]

    saved = current_registry()
    try:
        load_kernels(tmp_path, replace=True)
        first, again, other = step(1), step(1), step(2)
        assert attngen.last_dispatch().module.endswith("_bwd_drop")
        module = current_registry().module(attngen.last_dispatch().key)
    finally:
        use_registry(saved)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    torch.manual_seed(1)
    state = dropout_rng_state(q)
    grads = _grads(module, q, k, v, dout, None, dropout_p=0.2, rng_state=state)
    direct = module.attention(q, k, v, dropout_p=0.2, rng_state=state)
    assert torch.equal(direct, first[0].transpose(1, 2))
    for got, expected in zip(first[1:], grads, strict=True):
        assert torch.equal(got.transpose(1, 2), expected)


# -- the newer models' fields: sinks (with d sinks), chunked masks, sink tokens ---------------

MODEL_CASES = {
    "gptoss-local-sinks-bf16-d64": dict(
        dtype="bf16",
        head_dim=64,
        mask="sliding_window",
        window_left=127,
        window_right=0,
        sinks=True,
        num_q_heads=8,
        num_kv_heads=1,
    ),
    "gptoss-global-sinks-bf16-d64": dict(
        dtype="bf16", head_dim=64, sinks=True, num_q_heads=8, num_kv_heads=1
    ),
    "chunked-bf16-d128": dict(
        dtype="bf16", head_dim=128, mask="chunked", chunk_size=256, num_q_heads=8, num_kv_heads=2
    ),
    "chunked-sinks-fp16-d64-odd": dict(
        dtype="fp16",
        head_dim=64,
        mask="chunked",
        chunk_size=200,
        sinks=True,
        causal_align="top_left",
        num_q_heads=4,
        num_kv_heads=4,
    ),
    "sink-tokens-bf16-d128": dict(
        dtype="bf16",
        head_dim=128,
        mask="sliding_window",
        window_left=100,
        window_right=0,
        sink_tokens=4,
        num_q_heads=8,
        num_kv_heads=2,
    ),
    "sink-tokens-sinks-fp32-d64": dict(
        dtype="fp32",
        head_dim=64,
        mask="sliding_window",
        window_left=64,
        window_right=16,
        sink_tokens=70,
        sinks=True,
        num_q_heads=2,
        num_kv_heads=1,
    ),
}


def _sink_logits(heads):
    return torch.randn(heads, generator=torch.Generator().manual_seed(17)) * 2.0


def _grads_with_sinks(module, q, k, v, dout, sinks):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    module.attention(*leaves[:3], sinks=leaves[3]).backward(dout)
    return [t.grad for t in leaves]


def _gradient_problems(module, spec, hq, q, k, v, dout) -> list[str]:
    """The module's dQ, dK, dV (and d sinks with the spec's sinks) on the GPU against the
    rule, from CPU inputs."""
    sinks = _sink_logits(hq) if spec.sinks else None
    cuda = [t.cuda() for t in (q, k, v, dout)]
    if sinks is None:
        grads = _grads(module, *cuda, None)
    else:
        grads = _grads_with_sinks(module, *cuda, sinks.cuda())
    return compare_gradients(spec, [g.cpu() for g in grads], q, k, v, dout, sinks=sinks)


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1000), (257, 700), (700, 257)])
def test_model_field_gradients_at_real_sizes(name, seqlen_q, seqlen_k):
    """dQ, dK, dV (and d sinks) by the rule at the derived tiles; 700 queries on 257 keys
    bottom-right leave 443 rows that see no key (zero gradients, LSE = the sink)."""
    fields = MODEL_CASES[name]
    spec = backward_spec(**fields)
    module = load_kernel(spec)
    hq, hkv = fields["num_q_heads"], fields["num_kv_heads"]
    q, k, v, dout, _ = padded_inputs(spec, 2, hq, hkv, seqlen_q, seqlen_k, seed=5)
    problems = _gradient_problems(module, spec, hq, q, k, v, dout)
    assert not problems, "; ".join(problems)


def test_sinks_backward_is_bitwise_deterministic_on_the_gpu():
    """d sinks is one fp32 share per dQ program summed in torch: the same bytes every run."""
    spec = backward_spec(**MODEL_CASES["gptoss-local-sinks-bf16-d64"])
    module = load_kernel(spec)
    inputs = [t.cuda() for t in padded_inputs(spec, 2, 8, 1, 2048, 2048, seed=6)[:4]]
    sinks = _sink_logits(8).cuda()
    first = _grads_with_sinks(module, *inputs, sinks)
    second = _grads_with_sinks(module, *inputs, sinks)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_varlen_model_fields_with_an_empty_sequence():
    """Packed sequences [700, 0, 333] on a chunked module with sinks: each sequence's
    gradients by the rule, d sinks (a sum over every sequence) against the sums of the
    sequences' golden and yardstick."""
    spec = backward_spec(**MODEL_CASES["chunked-sinks-fp16-d64-odd"])
    lengths = [700, 0, 333]
    q, k, v, dout, _ = packed_inputs(spec, lengths, lengths, 4, 4, seed=7, pad=0)
    module = load_kernel(spec, kind="varlen")
    sinks = _sink_logits(4)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v, sinks)]
    cu = cu_seqlens(lengths).cuda()
    out = module.attention_varlen(*leaves[:3], cu, cu, 700, 700, sinks=leaves[3])
    out.backward(dout.cuda())
    grads = [t.grad.cpu() for t in leaves]
    starts = cu_seqlens(lengths).tolist()
    problems, golden_dsinks, lowp_dsinks = [], 0, 0
    for b in range(len(lengths)):
        rows = slice(starts[b], starts[b + 1])
        seq = [t[rows].transpose(0, 1)[None] for t in (q, k, v, dout)]
        mine = [g[rows].transpose(0, 1)[None] for g in grads[:3]]
        problems += [f"sequence {b}: {p}" for p in compare_gradients(spec, mine, *seq, sinks=sinks)]
        golden_dsinks = golden_dsinks + golden_backward(spec, *seq, sinks=sinks)[5]
        lowp_dsinks = lowp_dsinks + lowp_backward(spec, *seq, sinks=sinks)[4]
    problems += gradient_problems("dsinks", grads[3], golden_dsinks, lowp_dsinks)
    assert not problems, "; ".join(problems)
