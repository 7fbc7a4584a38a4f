"""The decode tests at real sizes on a CUDA GPU (the H200): `pytest -m gpu`.

The committed generated/sm90 decode modules (bf16) on the examples' shapes, fp16 renders,
long caches (32k), the split path forced and natural, NaN-poisoned caches, the append, and a
CUDA graph capturing decode with append and replaying it. tools/gpu_decode.sh runs this file.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from attngen.build import load_specs
from attngen.spec import KernelKind
from tests.decode_harness import (
    decode_problems,
    expected_cache_after_append,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
    same_bits,
)
from tests.test_decode_properties import check_case, decode_case
from tests.test_prefill_gpu import EXAMPLES, _load_generated, _sinks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


def _decode_examples():
    return [s for s in load_specs(EXAMPLES) if KernelKind.decode in s.kernels and "sm90" in s.archs]


def _to_cuda(cache):
    return cache.to("cuda")


def _queries(spec, batch, tokens, seed, num_new=0):
    q, k_new, v_new, slopes = make_queries(spec, batch, tokens, seed=seed, num_new=num_new)
    return tuple(None if t is None else t.cuda() for t in (q, k_new, v_new, slopes))


def _problems(spec, cache_cpu, out, lse, q, k_new=None, v_new=None, slopes=None, sinks=None):
    def cpu(t):
        return None if t is None else t.cpu()

    return decode_problems(
        spec,
        cache_cpu,
        out.cpu(),
        lse.cpu(),
        q.cpu(),
        cpu(k_new),
        cpu(v_new),
        cpu(slopes),
        sinks=cpu(sinks),
    )


@pytest.mark.parametrize("spec", _decode_examples(), ids=lambda s: s.name)
@pytest.mark.parametrize(
    "lengths, num_new", [([4096], 0), ([1, 777, 4095, 0], 1), ([32768, 1000], 0), ([0, 0], 0)]
)
def test_generated_decode_modules_bf16(spec, lengths, num_new):
    if spec.num_q_heads // spec.num_kv_heads > 32 and max(lengths) > 4096:
        pytest.skip(
            "MLA's 128 query heads over 32k keys: the float64 reference's repeated "
            "K/V would take ~40 GB of host memory; the 4096-key cases cover it"
        )
    kernel = _load_generated(spec, "decode")
    cache_cpu = make_cache(spec, lengths, seed=len(lengths), room=num_new, fill=float("nan"))
    cache = _to_cuda(cache_cpu.clone())
    tokens = spec.query_tokens
    q, k_new, v_new, slopes = _queries(spec, len(lengths), tokens, seed=3, num_new=num_new)
    extra = _sinks(spec)
    out, lse = run_decode(kernel, cache, q, k_new, v_new, slopes, **extra)
    problems = _problems(spec, cache_cpu, out, lse, q, k_new, v_new, slopes, **extra)
    assert not problems, "; ".join(problems)
    if num_new:
        k_expected, v_expected = expected_cache_after_append(cache_cpu, k_new.cpu(), v_new.cpu())
        assert same_bits(cache.k.cpu(), k_expected) and same_bits(cache.v.cpu(), v_expected)


@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("lengths, num_new", [([4096], 0), ([1, 777, 4095, 0], 1), ([70], 0)])
def test_deepseek_latent_cache_values_from_keys(lengths, num_new, splits):
    """DeepSeek-V3's absorbed decode as served: v_cache = k_cache[..., :512] (the values are
    the latent keys), so the generated module runs its V_FROM_K kernel (CONFIG: 64 head rows,
    q.k as a 512 + 64 split dot); the append writes v_new = k_new[..., :512] into the same
    memory."""
    (spec,) = [s for s in _decode_examples() if s.name == "deepseek_v3_absorbed"]
    latent = spec.value_head_dim
    kernel = _load_generated(spec, "decode")
    cache_cpu = make_cache(spec, lengths, seed=len(lengths), room=num_new, fill=float("nan"))
    cache_cpu.dense_v = [k[..., :latent] for k in cache_cpu.dense_k]
    cache = _to_cuda(cache_cpu.clone())
    cache.v = cache.k[..., :latent]
    assert kernel._values_are_latent_keys(cache.k, cache.v)
    q, k_new, _, _ = _queries(spec, len(lengths), 1, seed=3, num_new=num_new)
    v_new = None if k_new is None else k_new[..., :latent]
    kernel.FORCE_NUM_SPLITS = splits
    try:
        out, lse = run_decode(kernel, cache, q, k_new, v_new)
    finally:
        kernel.FORCE_NUM_SPLITS = None
    problems = _problems(spec, cache_cpu, out, lse, q, k_new, v_new)
    assert not problems, "; ".join(problems)
    assert kernel.CONFIG["BLOCK_M"] == 64


@pytest.mark.parametrize(
    "layout, page_size", [("contiguous", None), ("paged", 16), ("paged", 64), ("paged", 1)]
)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_renders_at_the_derived_tiles(layout, page_size, dtype):
    spec = make_decode_spec(
        layout,
        page_size,
        dtype=dtype,
        head_dim=128,
        num_q_heads=32,
        num_kv_heads=8,
        mask="causal",
        causal_align="bottom_right",
        max_query_tokens=4,
    )
    kernel = load_decode(spec)
    cache_cpu = make_cache(spec, [5000, 63, 64, 65, 1], seed=1, room=3)
    for tokens, num_new, splits in ((1, 0, None), (4, 3, None), (2, 1, 1), (1, 0, 7)):
        cache = _to_cuda(cache_cpu.clone())
        q, k_new, v_new, _ = _queries(spec, 5, tokens, seed=tokens, num_new=num_new)
        kernel.FORCE_NUM_SPLITS = splits
        try:
            out, lse = run_decode(kernel, cache, q, k_new, v_new)
        finally:
            kernel.FORCE_NUM_SPLITS = None
        problems = _problems(spec, cache_cpu, out, lse, q, k_new, v_new)
        assert not problems, "; ".join(problems)


def test_nan_poisoning_determinism_and_forced_splits_at_32k():
    spec = make_decode_spec(
        "paged",
        16,
        dtype="bf16",
        head_dim=128,
        num_q_heads=32,
        num_kv_heads=8,
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=4095,
        softcap=50.0,
    )
    kernel = load_decode(spec)
    lengths = [32768, 4100, 17]
    poisoned = _to_cuda(make_cache(spec, lengths, seed=2, fill=float("nan")))
    clean = _to_cuda(make_cache(spec, lengths, seed=2, fill=0.0))
    q, *_ = _queries(spec, 3, 1, seed=2)
    expected = run_decode(kernel, clean, q)
    for _ in range(3):
        got = run_decode(kernel, poisoned, q)
        assert same_bits(expected[0], got[0]) and same_bits(expected[1], got[1])
    for splits in (1, 3, 64):
        kernel.FORCE_NUM_SPLITS = splits
        try:
            out, lse = run_decode(kernel, poisoned, q)
        finally:
            kernel.FORCE_NUM_SPLITS = None
        # Other split counts merge the same fp32 partials in another order and round once to
        # bf16: at most one bf16 ulp of the output (|out| < 4 here, where an ulp is 2**-6 =
        # 0.0156), hence 2e-2. The fp32 LSE merge (max + log2 of a sum) differs by a few fp32
        # roundings at |lse| ~ 10 (ulp ~1e-6): 1e-5 is about ten ulps.
        assert (out.float() - expected[0].float()).abs().max().item() < 2e-2
        assert torch.allclose(lse, expected[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 16)])
def test_cuda_graph_capture_of_decode_with_append(layout, page_size):
    spec = make_decode_spec(
        layout,
        page_size,
        dtype="bf16",
        head_dim=128,
        num_q_heads=32,
        num_kv_heads=8,
        mask="causal",
        causal_align="bottom_right",
        max_query_tokens=2,
    )
    kernel = load_decode(spec)
    cache_cpu = make_cache(spec, [4000, 100, 0, 31], seed=5, room=2, fill=0.0)
    eager_cache = _to_cuda(cache_cpu.clone())
    graph_cache = _to_cuda(cache_cpu.clone())
    q, k_new, v_new, _ = _queries(spec, 4, 2, seed=5, num_new=2)
    eager = run_decode(kernel, eager_cache, q, k_new, v_new)
    # Static inputs: the graph replays on whatever these tensors hold.
    static_q, static_k, static_v = q.clone(), k_new.clone(), v_new.clone()
    run_decode(kernel, _to_cuda(cache_cpu.clone()), static_q, static_k, static_v)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run_decode(kernel, graph_cache, static_q, static_k, static_v)
    # Capture records, it does not run: restore the cache the append has not touched yet.
    graph_cache.k.copy_(cache_cpu.k)
    graph_cache.v.copy_(cache_cpu.v)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(static_out[0], eager[0]) and same_bits(static_out[1], eager[1])
    assert same_bits(graph_cache.k, eager_cache.k) and same_bits(graph_cache.v, eager_cache.v)
    # A second step through the same graph: new inputs copied into the static tensors.
    q2, k2, v2, _ = _queries(spec, 4, 2, seed=6, num_new=2)
    static_q.copy_(q2)
    static_k.copy_(k2)
    static_v.copy_(v2)
    graph.replay()
    again_cache = _to_cuda(cache_cpu.clone())
    again = run_decode(kernel, again_cache, q2, k2, v2)
    torch.cuda.synchronize()
    assert same_bits(static_out[0], again[0]) and same_bits(static_out[1], again[1])


@settings(max_examples=60, deadline=None)  # each new spec compiles three kernels
@given(decode_case())
def test_property_cases_on_the_gpu(case):
    check_case(*case, device="cuda")
