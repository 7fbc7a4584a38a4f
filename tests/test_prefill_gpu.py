"""The numerical tests at real sizes on a CUDA GPU (the H200): `pytest -m gpu`.

Runs the committed generated/sm90 modules (bf16, as the examples specify) and fp16 renders of
the same specs, with the derived tile configs (not the small test blocks of the CPU suite),
against the float64 reference computed on the GPU. tools/gpu_check.sh runs this file.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from attngen.build import load_specs
from attngen.reference import random_sinks, visible_mask
from attngen.spec import KernelKind
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GENERATED = ROOT / "generated"


def _example_specs():
    return [
        spec
        for spec in load_specs(EXAMPLES)
        if "sm90" in spec.archs and KernelKind.prefill in spec.kernels
    ]


def _sinks(spec, num_q_heads=None):
    """{"sinks": [HQ] fp32 on the GPU} for a spec with sinks, else {}."""
    if not spec.sinks:
        return {}
    return {"sinks": random_sinks(num_q_heads or spec.num_q_heads, seed=0, device="cuda")}


def _load_generated(spec, kind="prefill"):
    index = json.loads((GENERATED / "index.json").read_text())
    entry = next(
        e
        for e in index["modules"]
        if e["arch"] == "sm90" and e["kind"] == kind and e["spec_hash"] == spec.spec_hash()
    )
    path = GENERATED / entry["path"]
    name = f"generated_{entry['module']}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("spec", _example_specs(), ids=lambda s: s.name)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1024, 1024), (1000, 1000), (257, 1500), (1, 777)])
def test_generated_example_modules_bf16(spec, seqlen_q, seqlen_k):
    kernel = _load_generated(spec)
    q, k, v, slopes = make_inputs(spec, 2, seqlen_q, seqlen_k, seed=seqlen_q, device="cuda")
    extra = _sinks(spec)
    out, lse = kernel.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **extra)
    assert_matches_reference(spec, out, lse, q, k, v, slopes=slopes, **extra)


@pytest.mark.parametrize("spec", _example_specs(), ids=lambda s: s.name)
def test_fp16_renders_of_the_examples(spec):
    fields = spec.model_dump(mode="json")
    fields.update(dtype="fp16", archs=["sm90"], head_dim_v=None)
    fp16 = make_spec(**fields)
    q, k, v, slopes = make_inputs(fp16, 2, 2048, 2048, seed=9, device="cuda")
    extra = _sinks(fp16)
    out, lse = load_kernel(fp16).attention(q, k, v, alibi_slopes=slopes, return_lse=True, **extra)
    assert_matches_reference(fp16, out, lse, q, k, v, slopes=slopes, **extra)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize(
    "fields, seqlen_q, seqlen_k",
    [
        (dict(mask="causal", causal_align="bottom_right"), 700, 300),  # rows that see no key
        (dict(mask="causal", causal_align="top_left"), 129, 127),
        (
            dict(
                mask="sliding_window", causal_align="bottom_right", window_left=64, window_right=0
            ),
            1031,
            1031,
        ),
        (dict(mask="none"), 5, 0),
    ],
)
def test_edge_cases(dtype, fields, seqlen_q, seqlen_k):
    spec = make_spec(dtype=dtype, num_q_heads=14, num_kv_heads=2, head_dim=128, **fields)
    q, k, v, _ = make_inputs(spec, 2, seqlen_q, seqlen_k, seed=1, device="cuda")
    out, lse = load_kernel(spec).attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v)


@pytest.mark.parametrize("head_dim", [40, 80, 96, 200])
def test_odd_head_dims(head_dim):
    spec = make_spec(dtype="bf16", head_dim=head_dim, mask="causal", causal_align="bottom_right")
    q, k, v, _ = make_inputs(spec, 2, 1500, 1500, seed=head_dim, device="cuda")
    out, lse = load_kernel(spec).attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v)


def test_large_logits_nan_padding_determinism_and_strides():
    spec = make_spec(
        dtype="bf16",
        head_dim=128,
        num_q_heads=8,
        num_kv_heads=1,
        mask="causal",
        causal_align="top_left",
    )
    kernel = load_kernel(spec)
    q, k, v, _ = make_inputs(spec, 2, 1000, 1100, seed=4, device="cuda")
    q_big = (q.float() * 60).to(q.dtype)  # scores of order 1e4
    out, lse = kernel.attention(q_big, k, v, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_matches_reference(spec, out, lse, q_big, k, v)
    clean = kernel.attention(q, k, v, return_lse=True)
    for _ in range(3):  # bitwise deterministic
        again = kernel.attention(q, k, v, return_lse=True)
        assert torch.equal(clean[0], again[0]) and torch.equal(clean[1], again[1])
    # NaN beyond the logical length and in keys no query may see: bitwise the same output.
    k_pad = torch.full((2, 1, 1200, 128), float("nan"), dtype=k.dtype, device="cuda")
    v_pad = k_pad.clone()
    k_pad[:, :, :1100], v_pad[:, :, :1100] = k, v
    unseen = ~visible_mask(spec, 1000, 1100, "cuda").any(dim=0)
    k_pad[:, :, :1100][:, :, unseen] = float("nan")
    v_pad[:, :, :1100][:, :, unseen] = float("inf")
    padded = kernel.attention(q, k_pad[:, :, :1100], v_pad[:, :, :1100], return_lse=True)
    assert torch.equal(clean[0], padded[0]) and torch.equal(clean[1], padded[1])
    # [B, N, H, D] storage, transposed views.
    strided = kernel.attention(
        *(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)), return_lse=True
    )
    assert torch.equal(clean[0], strided[0]) and torch.equal(clean[1], strided[1])


def test_offsets_do_not_wrap_past_2_31_elements():
    # K/V of 2**31 + elements per tensor: the last head's rows sit past 2**31.
    spec = make_spec(dtype="bf16", head_dim=128, num_q_heads=8, num_kv_heads=8, mask="none")
    kernel = load_kernel(spec)
    seqlen = (2**31 // (8 * 128)) + 64
    k = torch.randn(1, 8, seqlen, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, 8, 64, 128, device="cuda", dtype=torch.bfloat16)
    assert k.numel() > 2**31
    out = kernel.attention(q, k[:, :, -256:], v[:, :, -256:])
    expected = kernel.attention(q, k[:, :, -256:].clone(), v[:, :, -256:].clone())
    assert torch.equal(out, expected)


def test_query_and_output_offsets_do_not_wrap_past_2_31_elements():
    # Q read from, and the output written into, views of [1, 16, 2**21, 128] tensors (2**32
    # elements each): the last head's rows sit past 2**31 elements from the base, as in a
    # context-parallel rank's q and out at long N.
    spec = make_spec(
        dtype="bf16",
        head_dim=128,
        num_q_heads=16,
        num_kv_heads=16,
        mask="causal",
        causal_align="bottom_right",
    )
    kernel = load_kernel(spec)
    big_q = torch.empty(1, 16, 2**21, 128, device="cuda", dtype=torch.bfloat16)
    big_out = torch.full_like(big_q, float("nan"))
    q = big_q[:, :, -256:]
    q.normal_()
    k, v = (torch.randn(1, 16, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    assert 15 * q.stride(1) > 2**31  # the last head's offset, computed in the kernel
    out, lse = kernel.attention(q, k, v, return_lse=True, out=big_out[:, :, -256:])
    expected, expected_lse = kernel.attention(q.clone(), k, v, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert torch.equal(big_out[:, :, -256:], expected)  # written where out= says
    assert big_out[:, :, :-256].isnan().all()  # and nowhere else


@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k", [(0, 128, 128), (2, 0, 128), (0, 0, 0), (2, 64, 0)]
)
def test_empty_batch_and_sequences(batch, seqlen_q, seqlen_k):
    spec = make_spec(dtype="bf16", head_dim=128, mask="causal", causal_align="bottom_right")
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=0, device="cuda")
    out, lse = load_kernel(spec).attention(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == (batch, 4, seqlen_q, 128) and lse.shape == (batch, 4, seqlen_q)
    if out.numel():  # no keys: every row sees nothing
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("seqlen", [127, 128, 129])
def test_lengths_at_the_tuned_block_size(seqlen):
    spec = make_spec(
        dtype="fp16",
        head_dim=64,
        num_q_heads=8,
        num_kv_heads=1,
        mask="causal",
        causal_align="bottom_right",
    )
    q, k, v, _ = make_inputs(spec, 2, seqlen, seqlen, seed=seqlen, device="cuda")
    out, lse = load_kernel(spec).attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v)


def test_llama4_chunks_at_the_real_chunk_size():
    """The generated Llama-4-Scout chunked module across a chunk boundary (8192), 10/2 heads
    (any head counts; the float64 reference's scores stay ~6 GB)."""
    spec = next(s for s in _example_specs() if s.name == "llama4_scout_chunked")
    kernel = _load_generated(spec)
    q, k, v, _ = make_inputs(
        spec, 1, 8192 + 700, 8192 + 700, seed=5, num_q_heads=10, num_kv_heads=2, device="cuda"
    )
    out, lse = kernel.attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v)


@pytest.mark.parametrize("spec", _example_specs(), ids=lambda s: s.name)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(64, 64), (1, 200), (130, 130)])
def test_small_launches_by_pointers_equal_tma(spec, seqlen_q, seqlen_k, monkeypatch):
    """A launch of at most POINTER_LOADS_UP_TO (program, key block) pairs reads K/V by
    pointers (no descriptors to encode); the outputs and LSE are bitwise those of the TMA
    path (the same products and sums), and match the reference."""
    kernel = _load_generated(spec)
    assert kernel.POINTER_LOADS_UP_TO > 0
    q, k, v, slopes = make_inputs(spec, 1, seqlen_q, seqlen_k, seed=seqlen_k, device="cuda")
    extra = _sinks(spec)
    by_pointers = kernel.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **extra)
    assert_matches_reference(spec, *by_pointers, q, k, v, slopes=slopes, **extra)
    monkeypatch.setattr(kernel, "POINTER_LOADS_UP_TO", 0)
    by_tma = kernel.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **extra)
    assert torch.equal(by_pointers[0], by_tma[0]) and torch.equal(by_pointers[1], by_tma[1])
