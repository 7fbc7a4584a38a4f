"""flash-attn's per-batch ALiBi slopes [B, HQ] served by the generated prefill and varlen
kernels (forward and backward) and the decode kernels: sequence b reads row b of the slopes,
[HQ] slopes still read one row for every sequence, and a wrong shape is refused naming
alibi_slopes."""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.reference import compare_to_reference
from attngen.runtime import registry as registry_module
from attngen.runtime.registry import current_registry, load_kernels
from tests.kernel_harness import make_spec
from tests.runtime_harness import build_folder

HQ, HKV, D = 4, 2, 16
FIELDS = dict(head_dim=D, num_q_heads=HQ, num_kv_heads=HKV, mask="none", alibi=True)
SPECS = [
    dict(name="alibi_bh", dtype=dtype, kernels=["prefill", "varlen"], backward=True, **FIELDS)
    for dtype in ("fp32", "fp16")
] + [
    dict(
        name="alibi_bh_dec",
        dtype="fp32",
        kernels=["decode"],
        kv_layout="contiguous",
        max_query_tokens=4,
        **{**FIELDS, "mask": "causal", "causal_align": "bottom_right"},
    )
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# CUDA on the H200 (tests/test_alibi_per_batch_gpu.py runs these tests there), else the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def alibi_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("alibi_bh"), SPECS)


@pytest.fixture()
def alibi_kernels(alibi_folder):
    saved = registry_module._current
    yield load_kernels(alibi_folder, replace=True)
    registry_module._current = saved


def per_batch_slopes(batch: int) -> torch.Tensor:
    """[batch, HQ] fp32, a different geometric series per sequence (steep enough that
    reading another sequence's row moves the output far beyond the tolerance)."""
    rows = [
        2.0 ** (-(b + 1) * torch.arange(1, HQ + 1, dtype=torch.float32) / 2) for b in range(batch)
    ]
    return torch.stack(rows).to(DEVICE)


def rand(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(DEVICE, dtype)


def assert_generated(prefix: str) -> None:
    dispatch = attngen.last_dispatch()
    assert dispatch.fallback is None and dispatch.module.startswith(prefix), dispatch


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_flash_attn_func_reads_each_sequences_slopes(alibi_kernels, dtype):
    spec = make_spec(dtype=dtype, **FIELDS)
    q = rand(2, 5, HQ, D, dtype=DTYPES[dtype], seed=1)
    k, v = (rand(2, 9, HKV, D, dtype=DTYPES[dtype], seed=s) for s in (2, 3))
    slopes = per_batch_slopes(2)
    out, lse, _ = attngen.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True)
    assert_generated(f"sm90/alibi_bh_prefill_{dtype}")
    for b in range(2):
        heads_first = [t[b : b + 1].transpose(1, 2) for t in (out, q, k, v)]
        problems = compare_to_reference(
            spec, heads_first[0], lse[b : b + 1], *heads_first[1:], alibi_slopes=slopes[b]
        )
        assert not problems, f"sequence {b}: " + "; ".join(problems)


def test_flash_attn_varlen_func_reads_each_sequences_slopes(alibi_kernels):
    spec = make_spec(dtype="fp32", **FIELDS)
    lengths_q, lengths_k = [3, 6], [7, 4]
    cu_q = torch.tensor([0, 3, 9], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 7, 11], dtype=torch.int32, device=DEVICE)
    q = rand(9, HQ, D, dtype=torch.float32, seed=4)
    k, v = (rand(11, HKV, D, dtype=torch.float32, seed=s) for s in (5, 6))
    slopes = per_batch_slopes(2)
    out, lse, _ = attngen.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 6, 7, alibi_slopes=slopes, return_attn_probs=True
    )
    assert_generated("sm90/alibi_bh_varlen_fp32")
    for b in range(2):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))

        def heads_first(t):
            return t.transpose(0, 1)[None]

        problems = compare_to_reference(
            spec,
            heads_first(out[rows_q]),
            lse[:, rows_q][None],
            heads_first(q[rows_q]),
            heads_first(k[rows_k]),
            heads_first(v[rows_k]),
            alibi_slopes=slopes[b],
        )
        assert not problems, f"sequence {b} ({lengths_q[b]}x{lengths_k[b]}): " + "; ".join(problems)


def loaded_module(kind: str, dtype: str = "fp32"):
    (entry,) = [
        e for e in current_registry().entries if e.kind == kind and e.spec["dtype"] == dtype
    ]
    return current_registry().module(entry.key)


def prefill_module():
    return loaded_module("prefill")


def bhnd_inputs(batch=2, seqlen_q=5, seqlen_k=9, seed=7):
    q = rand(batch, HQ, seqlen_q, D, dtype=torch.float32, seed=seed)
    k, v = (rand(batch, HKV, seqlen_k, D, dtype=torch.float32, seed=seed + s) for s in (1, 2))
    return q, k, v


def test_module_takes_per_batch_and_per_head_slopes(alibi_kernels):
    spec = make_spec(dtype="fp32", **FIELDS)
    module = prefill_module()
    q, k, v = bhnd_inputs()
    slopes = per_batch_slopes(2)
    out, lse = module.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    for b in range(2):
        one = (t[b : b + 1] for t in (q, k, v))
        assert not compare_to_reference(
            spec, out[b : b + 1], lse[b : b + 1], *one, alibi_slopes=slopes[b]
        )
    # [HQ] slopes: every sequence reads the same row (stride 0)
    out_h, lse_h = module.attention(q, k, v, alibi_slopes=slopes[1], return_lse=True)
    assert not compare_to_reference(spec, out_h, lse_h, q, k, v, alibi_slopes=slopes[1])
    # a [B, HQ] view with a row stride other than HQ is read at its own stride
    wide = torch.zeros(2, 2 * HQ, device=DEVICE)
    wide[:, :HQ] = slopes
    assert torch.equal(module.attention(q, k, v, alibi_slopes=wide[:, :HQ]), out)


def test_backward_reads_each_sequences_slopes(alibi_kernels):
    """The gradients with [B, HQ] slopes are those of each sequence run alone with its [HQ]
    row: the same kernels on the same data, so equal to the last bit."""
    module = prefill_module()
    q, k, v = bhnd_inputs(seed=11)
    slopes = per_batch_slopes(2)
    dout = rand(*q.shape, dtype=torch.float32, seed=20)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    module.attention(*leaves, alibi_slopes=slopes).backward(dout)
    for b in range(2):
        alone = [t[b : b + 1].clone().requires_grad_() for t in (q, k, v)]
        module.attention(*alone, alibi_slopes=slopes[b]).backward(dout[b : b + 1])
        for name, batched, single in zip("qkv", leaves, alone, strict=True):
            assert torch.equal(batched.grad[b : b + 1], single.grad), f"d{name}, sequence {b}"


def test_varlen_backward_reads_each_sequences_slopes(alibi_kernels):
    module = loaded_module("varlen")
    cu_q = torch.tensor([0, 3, 9], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 7, 11], dtype=torch.int32, device=DEVICE)
    q = rand(9, HQ, D, dtype=torch.float32, seed=30)
    k, v = (rand(11, HKV, D, dtype=torch.float32, seed=s) for s in (31, 32))
    dout = rand(9, HQ, D, dtype=torch.float32, seed=33)
    slopes = per_batch_slopes(2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    module.attention_varlen(*leaves, cu_q, cu_k, 6, 7, alibi_slopes=slopes).backward(dout)
    for b in range(2):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        alone = [t[r].clone().requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk))]
        cu_one_q = torch.tensor([0, rq.stop - rq.start], dtype=torch.int32, device=DEVICE)
        cu_one_k = torch.tensor([0, rk.stop - rk.start], dtype=torch.int32, device=DEVICE)
        module.attention_varlen(*alone, cu_one_q, cu_one_k, 6, 7, alibi_slopes=slopes[b]).backward(
            dout[rq]
        )
        for name, batched, single, rows in zip("qkv", leaves, alone, (rq, rk, rk), strict=True):
            same = torch.equal(batched.grad[rows], single.grad)
            assert same, f"d{name}, sequence {b}"


BAD_SLOPES = {
    "batch_plus_one": lambda s: per_batch_slopes(3),
    "heads_plus_one": lambda s: torch.ones(2, HQ + 1, device=DEVICE),
    "rank_3": lambda s: s[:, :, None],
    "float64": lambda s: s.double(),
    "strided_last_dim": lambda s: torch.stack([s, s], -1)[..., 0],
}


@pytest.mark.parametrize("mistake", sorted(BAD_SLOPES))
def test_wrong_slopes_are_refused_naming_alibi_slopes(alibi_kernels, mistake):
    q, k, v = bhnd_inputs()
    bad = BAD_SLOPES[mistake](per_batch_slopes(2))
    with pytest.raises(ValueError, match=r"alibi_slopes: expected") as info:
        prefill_module().attention(q, k, v, alibi_slopes=bad)
    assert "(4,) or (2, 4)" in str(info.value) or "strides" in str(info.value)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected"):
        attngen.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), alibi_slopes=bad)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device=DEVICE)
    packed = [t.transpose(1, 2).reshape(-1, t.shape[1], D) for t in (q, q[:, :HKV], q[:, :HKV])]
    with pytest.raises(ValueError, match=r"alibi_slopes: expected"):
        attngen.flash_attn_varlen_func(*packed, cu, cu, 5, 5, alibi_slopes=bad)


def test_flash_attn_with_kvcache_reads_each_sequences_slopes(alibi_kernels):
    spec = make_spec(dtype="fp32", **{**FIELDS, "mask": "causal", "causal_align": "bottom_right"})
    q = rand(2, 2, HQ, D, dtype=torch.float32, seed=40)
    k_cache, v_cache = (rand(2, 12, HKV, D, dtype=torch.float32, seed=s) for s in (41, 42))
    lengths = [5, 9]
    slopes = per_batch_slopes(2)
    out, lse = attngen.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        causal=True,
        alibi_slopes=slopes,
        return_softmax_lse=True,
    )
    assert_generated("sm90/alibi_bh_dec_decode_fp32")
    for b, length in enumerate(lengths):
        heads_first = [t[b : b + 1].transpose(1, 2) for t in (out, q)]
        keys = [t[b : b + 1, :length].transpose(1, 2) for t in (k_cache, v_cache)]
        problems = compare_to_reference(
            spec, heads_first[0], lse[b : b + 1], heads_first[1], *keys, alibi_slopes=slopes[b]
        )
        assert not problems, f"sequence {b}: " + "; ".join(problems)
