"""Rotary fused into decode at real sizes on a CUDA GPU (the H200): `pytest -m gpu`.

The committed generated/sm90 decode modules (bf16) and fp16/bf16 renders at D 128, GQA 32:8,
contiguous and paged caches, the split path forced and natural, interleaved and not,
rotary_dim below and equal to the head dim. Each call against route 2's torch rotation
(kvcache_rotary.rotate): the cache holds bitwise the keys torch rotates (the append kernel
compiles without FMA contraction) and the values as they came; the output is judged against the
float64 reference over the torch-rotated q and keys (q rotated in the split kernel may differ
from torch's by an ulp where the compiler contracts a multiply-add; the RELIABILITY rule's
margin covers it); a query past cos/sin's rows and a sequence that does not fit get NaN, and
the rotation reads nothing of cos/sin for them (an illegal address would fault).
"""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.runtime.kvcache_options import CacheOptions, rotate
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
from tests.test_decode_gpu import _decode_examples
from tests.test_decode_rotary import capacity_of, reference_rotation, rotary_tables
from tests.test_prefill_gpu import _load_generated, _sinks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


def _check(spec, kernel, lengths, tokens, num_new, half, interleaved, splits, **extra):
    cache_cpu = make_cache(spec, lengths, seed=len(lengths), room=num_new)
    cache, unfused = cache_cpu.to("cuda").clone(), cache_cpu.to("cuda").clone()
    q, k_new, v_new, _ = make_queries(spec, len(lengths), tokens, seed=tokens, num_new=num_new)
    q, k_new, v_new = q.cuda(), k_new.cuda(), v_new.cuda()
    cos, sin = rotary_tables(capacity_of(cache_cpu) + 5, half, q.dtype, seed=half)
    cos, sin = cos.cuda(), sin.cuda()
    per_token = spec.mask.value != "none"
    kernel.FORCE_NUM_SPLITS = splits
    try:
        out, lse = run_decode(
            kernel, cache, q, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
            rotary_interleaved=interleaved, **extra,
        )  # fmt: skip
        options = CacheOptions((cos, sin, interleaved), None, None, 0)
        q_rot, k_rot = rotate(q.transpose(1, 2), k_new.transpose(1, 2), options, cache.lengths,
                              per_token)  # fmt: skip
        q_rot, k_rot = q_rot.transpose(1, 2), k_rot.transpose(1, 2)
        run_decode(kernel, unfused, q_rot, k_rot, v_new, **extra)
    finally:
        kernel.FORCE_NUM_SPLITS = None
    assert same_bits(cache.k.cpu(), unfused.k.cpu()) and same_bits(cache.v.cpu(), unfused.v.cpu())
    starts = cache_cpu.lengths.long()[:, None]
    k_ref = reference_rotation(k_new.cpu(), cos.cpu(), sin.cpu(), starts + torch.arange(num_new),
                               interleaved)  # fmt: skip
    k_expected, _ = expected_cache_after_append(cache_cpu, k_ref, v_new.cpu())
    eps = torch.finfo(q.dtype).eps  # one ulp of the float32 rotation's rounding, or ~0 near 0
    torch.testing.assert_close(cache.k.cpu(), k_expected, rtol=eps, atol=1e-5, equal_nan=True)
    sinks = extra.get("sinks")
    problems = decode_problems(
        spec, cache_cpu, out.cpu(), lse.cpu(), q_rot.cpu(), k_rot.cpu(), v_new.cpu(),
        sinks=None if sinks is None else sinks.cpu(),
    )  # fmt: skip
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 16), ("paged", 1)])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("interleaved, half", [(True, 32), (False, 64), (False, 32), (True, 64)])
def test_rendered_decode_fuses_rotary(layout, page_size, dtype, interleaved, half):
    spec = make_decode_spec(
        layout, page_size, dtype=dtype, head_dim=128, num_q_heads=32, num_kv_heads=8,
        mask="causal", causal_align="bottom_right", max_query_tokens=4,
    )  # fmt: skip
    kernel = load_decode(spec)
    lengths = [5000, 63, 64, 65, 1]
    for tokens, num_new, splits in ((1, 1, None), (4, 4, None), (2, 2, 1), (1, 1, 7)):
        _check(spec, kernel, lengths, tokens, num_new, half, interleaved, splits)


@pytest.mark.parametrize("spec", _decode_examples(), ids=lambda s: s.name)
def test_generated_decode_modules_fuse_rotary(spec):
    kernel = _load_generated(spec, "decode")
    if not kernel.ACCEPTS_ROTARY:  # the absorbed MLA decode: its RoPE is the rope part
        q = torch.zeros(1, spec.num_q_heads, 1, spec.head_dim, device="cuda",
                        dtype=getattr(torch, spec.dtype.torch_name))  # fmt: skip
        table = torch.ones(64, 8, device="cuda", dtype=q.dtype)
        with pytest.raises(ValueError, match="rotary_cos: this absorbed MLA decode module"):
            kernel._rotary_args(table, table, True, True, None, q, 64)
        return
    half = min(64, spec.head_dim // 2)
    _check(spec, kernel, [4095, 777, 1, 0], 1, 1, half, False, None, **_sinks(spec))


def test_flash_attn_with_kvcache_takes_the_fused_route_on_the_gpu():
    """llama3_8b's shapes (bf16, D 128, GQA 32:8, pages of 16): generated/'s decode module."""
    torch.manual_seed(0)
    batch, pages, hq, hkv, d = 4, 256, 32, 8, 128
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 1, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    shape = (batch * pages, 16, hkv, d)
    caches = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).reshape(batch, pages)
    lengths = torch.tensor([4095, 17, 0, 2048], dtype=torch.int32, device="cuda")
    cos, sin = (t.cuda() for t in rotary_tables(pages * 16, 64, torch.bfloat16, seed=1))
    fused = [c.clone() for c in caches]
    out = attngen.flash_attn_with_kvcache(q, *fused, k, v, cos, sin, lengths, block_table=table,
                                          causal=True, rotary_interleaved=False)  # fmt: skip
    assert attngen.last_dispatch().need.kind.value == "decode"
    options = CacheOptions((cos, sin, False), None, None, 0)
    q_rot, k_rot = rotate(q, k, options, lengths, True)
    plain = [c.clone() for c in caches]
    expected = attngen.flash_attn_with_kvcache(q_rot, *plain, k_rot, v, cache_seqlens=lengths,
                                               block_table=table, causal=True)  # fmt: skip
    assert same_bits(fused[0].cpu(), plain[0].cpu()) and same_bits(fused[1].cpu(), plain[1].cpu())
    # bf16: q rotated in the kernel and in torch may differ by an ulp where the compiler
    # contracts a multiply-add; the outputs by a few bf16 ulps of |out| < 4 (2**-6 each)
    torch.testing.assert_close(out, expected, rtol=0, atol=4 * 2**-6)
