"""fp8 KV caches on a CUDA GPU (the H200): `pytest -m gpu tests/test_decode_fp8_gpu.py`.

The CPU file's property test on the device (tests/test_decode_fp8.py: the dequantized float64
reference, the append bit for bit against torch's quantization), Llama-3's decode shapes
(GQA 32/8, D 128, contiguous and paged 16, L 4k and 32k, one token and eight: speculative and
chunked-prefill steps), a CUDA graph capturing a step with an append, and
flash_attn_with_kvcache's route to an fp8 module. The speed against a bf16 cache is
tools/bench_decode_fp8.py's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from attngen.runtime import registry as registry_module
from attngen.runtime.registry import load_kernels
from tests.decode_harness import expected_cache_after_append, load_decode, make_queries
from tests.runtime_harness import build_folder
from tests.test_decode_fp8 import (
    bits,
    check_fp8_case,
    draw_descale,
    fp8_cache,
    fp8_case,
    fp8_problems,
    fp8_spec,
    quantize,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

LLAMA = dict(dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8, mask="causal",
             causal_align="bottom_right", max_query_tokens=8)  # fmt: skip


@given(fp8_case())
def test_fp8_properties_on_the_gpu(case):
    check_fp8_case(case, "cuda")


def _cuda(*tensors):
    return tuple(None if t is None else t.cuda() for t in tensors)


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 16)])
@pytest.mark.parametrize("length", [4096, 32768])
@pytest.mark.parametrize("tokens, new", [(1, 1), (8, 8), (8, 0)])
def test_llama3_fp8_steps_against_float64(layout, page_size, length, tokens, new):
    spec = fp8_spec(layout, page_size, **LLAMA)
    kernel = load_decode(spec)
    lengths = [length - new, length // 3]
    cache = fp8_cache(spec, lengths, seed=length + tokens, room=new)
    q, k_new, v_new, _ = make_queries(spec, 2, tokens, seed=tokens, num_new=new)
    kd, vd = draw_descale("random", 2, 8, 1), draw_descale("mixed", 2, 8, 2)
    before = cache.clone()
    on = cache.to("cuda")
    out, lse = kernel.decode(*_cuda(q), on.k, on.v, on.lengths, block_table=on.block_table,
                             k_new=_cuda(k_new)[0], v_new=_cuda(v_new)[0], return_lse=True,
                             k_descale=kd.cuda(), v_descale=vd.cuda())  # fmt: skip
    k_new8 = v_new8 = None
    if new:
        k_new8, v_new8 = (
            quantize(k_new, kd[:, :, None, None]),
            quantize(v_new, vd[:, :, None, None]),
        )
        k_expected, v_expected = expected_cache_after_append(before, k_new8, v_new8)
        assert torch.equal(bits(on.k.cpu()), bits(k_expected))
        assert torch.equal(bits(on.v.cpu()), bits(v_expected))
    problems = fp8_problems(spec, before, out.cpu(), lse.cpu(), q, k_new8, v_new8, kd, vd)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("kinds", [("random", "random"), ("none", "none")])
def test_an_fp8_step_with_an_append_replays_from_a_cuda_graph(kinds):
    spec = fp8_spec("paged", 16, **LLAMA)
    kernel = load_decode(spec)
    cache = fp8_cache(spec, [5000, 300, 8191], seed=3, room=1).to("cuda")
    q, k_new, v_new, _ = _cuda(*make_queries(spec, 3, 1, seed=3, num_new=1))
    kd, vd = _cuda(draw_descale(kinds[0], 3, 8, 4), draw_descale(kinds[1], 3, 8, 5))
    eager = cache.clone()

    def step(c):
        return kernel.decode(q, c.k, c.v, c.lengths, block_table=c.block_table, k_new=k_new,
                             v_new=v_new, k_descale=kd, v_descale=vd)  # fmt: skip

    expected = step(eager)
    step(cache.clone())  # compiled and planned before the capture
    kernel._UNIT_DESCALES.clear()  # None descales: the capture makes its own 1.0
    graph, replayed = torch.cuda.CUDAGraph(), cache.clone()
    with torch.cuda.graph(graph):
        out = step(replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert torch.equal(bits(replayed.k), bits(eager.k)) and torch.equal(
        bits(replayed.v), bits(eager.v)
    )


def test_flash_attn_with_kvcache_routes_fp8_caches_on_the_gpu(tmp_path):
    import attngen
    from attngen.runtime import plans

    fields = dict(LLAMA, kernels=["decode"], kv_dtype="fp8_e4m3", archs=["sm90"])
    folder = build_folder(tmp_path, [dict(fields, name="fp8g", kv_layout="paged", page_size=16)])
    saved = registry_module._current
    try:
        registry = load_kernels(folder, replace=True)
        spec = fp8_spec("paged", 16, **LLAMA)
        cache = fp8_cache(spec, [1000, 77], seed=9, room=4).to("cuda")
        q, k_new, v_new, _ = _cuda(*make_queries(spec, 2, 4, seed=9, num_new=4))
        kd, vd = (d.cuda() for d in (draw_descale("random", 2, 8, 6), draw_descale("one", 2, 8, 7)))
        direct, second, second_direct = cache.clone(), cache.clone(), cache.clone()
        out = attngen.flash_attn_with_kvcache(
            q.transpose(1, 2), cache.k, cache.v, k_new.transpose(1, 2), v_new.transpose(1, 2),
            cache_seqlens=cache.lengths, block_table=cache.block_table, causal=True,
            k_descale=kd, v_descale=vd,
        )  # fmt: skip
        assert attngen.last_dispatch().module.endswith("_kvfp8")
        module = registry.module(attngen.last_dispatch().key)
        expected = module.decode(q, direct.k, direct.v, direct.lengths,
                                 block_table=direct.block_table, k_new=k_new, v_new=v_new,
                                 k_descale=kd, v_descale=vd)  # fmt: skip
        assert torch.equal(out, expected.transpose(1, 2))
        assert torch.equal(bits(cache.k), bits(direct.k)) and torch.equal(
            bits(cache.v), bits(direct.v)
        )
        # the same signature again: from the runtime's plan, with this call's descales
        out = attngen.flash_attn_with_kvcache(
            q.transpose(1, 2), second.k, second.v, k_new.transpose(1, 2), v_new.transpose(1, 2),
            cache_seqlens=second.lengths, block_table=second.block_table, causal=True,
            k_descale=vd, v_descale=kd,
        )  # fmt: skip
        assert len(plans.planned(registry)) == 1
        expected = module.decode(q, second_direct.k, second_direct.v, second_direct.lengths,
                                 block_table=second_direct.block_table, k_new=k_new,
                                 v_new=v_new, k_descale=vd, v_descale=kd)  # fmt: skip
        assert torch.equal(out, expected.transpose(1, 2))
        assert torch.equal(bits(second.k), bits(second_direct.k))
    finally:
        registry_module._current = saved
