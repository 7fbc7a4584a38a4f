"""Kernels on demand on a CUDA GPU (`pytest -m gpu tests/test_ondemand_gpu.py` on the H200):
the CPU tests' calls at real sizes, compiled by Triton, against the float64 reference; the
cold start, phase by phase (tools/ondemand_cold_start.py); warmup() leaving nothing to compile
for the first real call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attngen
from attngen.reference import compare_to_reference
from attngen.runtime import registry
from tests.kernel_harness import make_spec
from tests.ondemand_harness import on_demand  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]
ROOT = Path(__file__).resolve().parent.parent

CASES = [  # (head dim, dtype, heads, mask, window, softcap)
    (59, torch.float16, (6, 2), "causal", None, 0.0),
    (72, torch.bfloat16, (6, 6), "sliding_window", (255, 0), 0.0),
    (111, torch.float16, (6, 3), "none", None, 30.0),
    (200, torch.bfloat16, (6, 6), "causal", None, 50.0),
    (1, torch.float16, (6, 6), "causal", None, 0.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}_{c[1]}_{c[3]}")
@pytest.mark.parametrize("seqlen", [1000, 4096])
def test_calls_build_on_demand_and_match_on_the_gpu(case, seqlen, on_demand):  # noqa: F811
    dim, dtype, (hq, hkv), mask, window, softcap = case
    gen = torch.Generator(device="cuda").manual_seed(dim)
    q, k, v = (
        torch.randn(2, seqlen, h, dim, device="cuda", dtype=dtype, generator=gen)
        for h in (hq, hkv, hkv)
    )
    kwargs = dict(
        causal=mask == "causal",
        window_size=window or (-1, -1),
        softcap=softcap,
        return_attn_probs=True,
    )
    renders = registry.render_count()
    out, lse, _ = attngen.flash_attn_func(q, k, v, **kwargs)
    assert attngen.last_dispatch().source == "cache"
    fields = dict(
        dtype={torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype],
        head_dim=dim,
        num_q_heads=hq,
        num_kv_heads=hkv,
        mask=mask,
        softcap=softcap,
    )
    if window:
        fields.update(window_left=window[0], window_right=window[1])
    problems = compare_to_reference(
        make_spec(**fields),
        out.transpose(1, 2),
        lse,
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
    )
    assert not problems, problems
    attngen.flash_attn_func(q, k, v, **kwargs)
    assert not attngen.last_dispatch().built and registry.render_count() <= renders + 1


def test_decode_with_odd_head_dims_on_the_gpu(on_demand):  # noqa: F811
    gen = torch.Generator(device="cuda").manual_seed(5)
    cache_k, cache_v = (
        torch.randn(4, 4096, 2, 59, device="cuda", dtype=torch.float16, generator=gen)
        for _ in range(2)
    )
    q = torch.randn(4, 1, 8, 59, device="cuda", dtype=torch.float16, generator=gen)
    lengths = torch.tensor([1, 100, 2000, 4095], dtype=torch.int32, device="cuda")
    out = attngen.flash_attn_with_kvcache(q, cache_k, cache_v, cache_seqlens=lengths, causal=True)
    assert "_decode_fp16_d59_causal_br_contig" in attngen.last_dispatch().module
    for b, n in enumerate(lengths.tolist()):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1].transpose(1, 2).double(),
            cache_k[b : b + 1, :n].transpose(1, 2).double(),
            cache_v[b : b + 1, :n].transpose(1, 2).double(),
            enable_gqa=True,
        ).transpose(1, 2)
        # fp16 kernel against float64: P rounded to fp16 before P @ V (relative 2**-11 a term)
        # and the output rounded to fp16 (half an ulp, 2.4e-4 at |out| < 0.5): under 1e-3; 2e-3
        # leaves a factor of two.
        torch.testing.assert_close(out[b : b + 1].double(), ref, atol=2e-3, rtol=0)


def test_num_splits_on_the_gpu(on_demand):  # noqa: F811
    """flash_attn_with_kvcache's num_splits through a decode module built on demand: the count
    used is the documented clamp, and every count gives the rule's result."""
    from attngen.runtime.registry import current_registry

    gen = torch.Generator(device="cuda").manual_seed(7)
    cache_k, cache_v = (
        torch.randn(2, 4096, 2, 64, device="cuda", dtype=torch.float16, generator=gen)
        for _ in range(2)
    )
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16, generator=gen)
    lengths = torch.tensor([100, 4096], dtype=torch.int32, device="cuda")
    kwargs = dict(cache_seqlens=lengths, causal=True, return_softmax_lse=True)
    out0, lse0 = attngen.flash_attn_with_kvcache(q, cache_k, cache_v, **kwargs)
    module = current_registry().module(attngen.last_dispatch().key)
    blocks = -(-4096 // module.CONFIG["BLOCK_N"])
    for requested in (1, 3, 17, 64, 1000):
        out, lse = attngen.flash_attn_with_kvcache(
            q, cache_k, cache_v, num_splits=requested, **kwargs
        )
        per_split = -(-blocks // min(requested, module.MAX_SPLITS))
        assert module.LAST_NUM_SPLITS == -(-blocks // per_split), (requested, blocks)
        # fp32 partials and combine, rounded to fp16 once: another split count moves |out| < 1
        # by at most an fp16 rounding (2**-11 = 4.9e-4 below 1) plus fp32 noise; 1e-3 is two.
        torch.testing.assert_close(out, out0, atol=1e-3, rtol=0)
        # fp32 LSE, |lse| < 16: another order of the sums and the exp2 rescales moves it by a
        # few ulps (1.9e-6 at 16) and the fp16 inputs' scores alike; 1e-4 leaves room for
        # GPU exp2 approximations (a few ulps each).
        torch.testing.assert_close(lse, lse0, atol=1e-4, rtol=0)


def test_warmup_leaves_nothing_to_compile(on_demand):  # noqa: F811
    spec = make_spec(head_dim=111, dtype="fp16", num_q_heads=6, num_kv_heads=2, mask="causal")
    warmed = attngen.warmup(spec)
    print("warmup:", warmed)
    assert [w.kind for w in warmed] == ["prefill"] and warmed[0].ran
    q = torch.randn(1, 4096, 6, 111, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 4096, 2, 111, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    attngen.flash_attn_func(q, k, k, causal=True)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    print(f"first call after warmup: {first * 1e3:.1f} ms")
    assert first < 0.5  # a compile takes seconds; a launch of this size milliseconds


def test_cold_start_phases(tmp_path):
    out = Path(os.environ.get("ATTNGEN_GPU_OUT", tmp_path)) / "ondemand_cold_start.json"
    proc = subprocess.run(
        [sys.executable, "tools/ondemand_cold_start.py", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    # Render + write, what a new spec costs once the tiling model is loaded, stays under
    # 100 ms. The derivation is not held to it: the first spec of each code path (pointer
    # loads, TMA) compiles that path's model functions once per process (about 0.1-0.2 s on
    # the H200 host, seen for the first TMA head dim after two pointer-path ones).
    # The first render of the process compiles the templates into Jinja's bytecode cache of
    # the run's empty cache root (`templates` says where; 0.1-0.3 s on a 2-core CPU), once per
    # template change on a user's machine; the later renders load them from memory.
    runs = result["phases"]["runs"]
    assert runs[0]["render_s"] + runs[0]["write_s"] < 0.5, (result["phases"]["templates"], runs)
    assert all(run["render_s"] + run["write_s"] < 0.1 for run in runs[1:]), (
        result["phases"]["templates"],
        runs,
    )
    assert result["first_call_new_process_same_caches"]["renders"] == 0


@pytest.mark.parametrize("dim,dtype", [(128, torch.bfloat16), (59, torch.float16)])
def test_training_from_an_empty_cache_on_the_gpu(dim, dtype, on_demand):  # noqa: F811
    """flash_attn_func with inputs that require grad and nothing built: the module is built
    with gradient kernels and its gradients pass the rule against float64."""
    from attngen.reference.backward import compare_gradients

    gen = torch.Generator(device="cuda").manual_seed(dim)
    q, k, v, dout = (
        torch.randn(2, n, h, dim, device="cuda", dtype=dtype, generator=gen)
        for n, h in ((1000, 6), (1100, 2), (1100, 2), (1000, 6))
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attngen.flash_attn_func(*leaves, causal=True).backward(dout)
    served = attngen.last_dispatch()  # built now, or a bundled module with gradient kernels
    assert served.module.endswith("_bwd"), served.reason
    spec = make_spec(
        dtype={torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype],
        head_dim=dim,
        num_q_heads=6,
        num_kv_heads=2,
        mask="causal",
        causal_align="bottom_right",
        backward=True,
    )
    heads_first = [t.transpose(1, 2).cpu() for t in (q, k, v, dout)]  # float64 on the CPU
    grads = [t.grad.transpose(1, 2).cpu() for t in leaves]
    problems = compare_gradients(spec, grads, *heads_first)
    assert not problems, "; ".join(problems)
