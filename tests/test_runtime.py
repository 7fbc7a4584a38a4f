"""The runtime: dispatch, the SDPA-shaped and flash-attn APIs, the KV cache, fallbacks, ops
under torch.compile. Toy kernels (tests/runtime_harness.py) under the CPU interpreter."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import attngen
from attngen.reference import compare_to_reference
from attngen.runtime import ops
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from tests.kernel_harness import make_spec
from tests.runtime_harness import build_fake_decode, build_folder
from tests.test_varlen_properties import assert_each_sequence_matches, cu_seqlens

TOY = make_spec(name="toy", dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=2)
TOY_TL = make_spec(name="toy", dtype="fp32", head_dim=16, causal_align="top_left")


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(batch, seqlen_q, seqlen_k, hq=4, hkv=2, dim=16, dtype=torch.float32, seed=0):
    return (
        rand(batch, hq, seqlen_q, dim, dtype=dtype, seed=seed),
        rand(batch, hkv, seqlen_k, dim, dtype=dtype, seed=seed + 1),
        rand(batch, hkv, seqlen_k, dim, dtype=dtype, seed=seed + 2),
    )


def module_of(dispatch):
    return current_registry().module(dispatch.key)


def test_sdpa_square_causal_runs_on_a_bottom_right_kernel(toy_kernels):
    q, k, v = qkv(2, 20, 20)
    out = attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    dispatch = attngen.last_dispatch()
    assert dispatch.module == "sm90/toy_prefill_fp32_d16_causal_br" and dispatch.fallback is None
    assert "serves kind=prefill" in dispatch.reason and "causal(top_left)" in dispatch.reason
    direct, lse = module_of(dispatch).attention(q, k, v, return_lse=True)
    assert torch.equal(out, direct)
    assert not compare_to_reference(TOY_TL, out, lse, q, k, v)  # top-left = bottom-right here


def test_sdpa_top_left_with_fewer_queries_than_keys(toy_kernels):
    q, k, v = qkv(1, 5, 20)
    out = attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert attngen.last_dispatch().module == "sm90/toy_tl_prefill_fp32_d16_causal_tl"
    _, lse = module_of(attngen.last_dispatch()).attention(q, k, v, return_lse=True)
    assert not compare_to_reference(TOY_TL, out, lse, q, k, v)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attngen.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_flash_attn_func_bottom_right_with_lse(toy_kernels):
    q, k, v = qkv(2, 5, 20)
    out, lse, probs = attngen.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, return_attn_probs=True
    )
    assert probs.shape == (0,) and out.shape == (2, 5, 4, 16) and out.is_contiguous()
    assert lse.shape == (2, 4, 5)
    assert not compare_to_reference(TOY, out.transpose(1, 2), lse, q, k, v)


def test_window_and_softcap_and_their_equivalence_to_causal(toy_kernels):
    spec = make_spec(
        dtype="fp16",
        head_dim=32,
        num_q_heads=2,
        num_kv_heads=2,
        mask="sliding_window",
        window_left=3,
        window_right=0,
        softcap=5.0,
    )
    q, k, v = qkv(1, 9, 9, hq=2, hkv=2, dim=32, dtype=torch.float16)
    bnhd = [t.transpose(1, 2) for t in (q, k, v)]
    out, lse, _ = attngen.flash_attn_func(
        *bnhd, causal=True, window_size=(3, 0), softcap=5.0, return_attn_probs=True
    )
    assert attngen.last_dispatch().module.startswith("sm90/toy_win_prefill")
    assert not compare_to_reference(spec, out.transpose(1, 2), lse, q, k, v)
    # causal with 4 keys: a window reaching 3 keys back is the whole causal mask
    short = [t[:, :4] for t in bnhd]
    attngen.flash_attn_func(*short, causal=True, softcap=5.0)
    assert attngen.last_dispatch().module.startswith("sm90/toy_win_prefill")
    with pytest.raises(attngen.NoKernelError, match="mask: needs causal"):
        attngen.flash_attn_func(*[t[:, :5] for t in bnhd], causal=True, softcap=5.0)


def test_alibi(toy_kernels):
    spec = make_spec(
        dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=4, mask="none", alibi=True
    )
    q, k, v = qkv(1, 7, 11, hkv=4)
    slopes = 2.0 ** (-8.0 * torch.arange(1, 5, dtype=torch.float32) / 4)
    out = attngen.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes)
    _, lse = module_of(attngen.last_dispatch()).attention(
        q, k, v, alibi_slopes=slopes, return_lse=True
    )
    assert not compare_to_reference(spec, out, lse, q, k, v, alibi_slopes=slopes)


def test_no_kernel_error_names_the_need_and_the_nearest(toy_kernels):
    q, k, v = qkv(1, 8, 8, dim=16, dtype=torch.float16)
    with pytest.raises(attngen.NoKernelError) as info:
        attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    text = str(info.value)
    assert "kind=prefill dtype=fp16 head_dim=16 mask=causal(top_left)" in text
    assert (
        "nearest: sm90/toy_prefill_fp32_d16_causal_br (dtype: needs fp16, module has fp32)" in text
    )
    assert "fallback='sdpa'" in text


def test_fallback_warns_and_matches_torch(toy_kernels):
    q, k, v = qkv(1, 8, 8, hkv=4, dtype=torch.float16)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.warns(UserWarning, match="falling back to torch SDPA: no generated kernel"):
        out = attngen.scaled_dot_product_attention(q, k, v, is_causal=True, fallback="sdpa")
    assert attngen.last_dispatch().fallback == "sdpa" and attngen.last_dispatch().key is None
    torch.testing.assert_close(out, expected)  # both are torch's SDPA on the same inputs
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    q32, k32, v32 = qkv(1, 8, 8, hkv=4)
    with pytest.raises(attngen.NoKernelError, match="attn_mask: a dense mask tensor"):
        attngen.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    with pytest.raises(attngen.NoKernelError, match="dropout_p: needs a module built"):
        attngen.scaled_dot_product_attention(q32, k32, v32, dropout_p=0.5)
    attngen.set_fallback("sdpa")
    try:
        with pytest.warns(UserWarning, match="attn_mask"):
            out = attngen.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    finally:
        attngen.set_fallback("error")
    expected = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    # Both are torch's SDPA in fp32 (a boolean causal mask against is_causal: the same math,
    # possibly another summation order), so assert_close's fp32 defaults (rtol 1.3e-6,
    # atol 1e-5) hold them.
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="fallback: got 'torch'"):
        attngen.scaled_dot_product_attention(q32, k32, v32, fallback="torch")


def test_flash_attn_varlen_func(toy_kernels):
    lengths = [3, 0, 9, 1]
    total = sum(lengths)
    q, k, v = (rand(total + 2, h, 16, seed=s) for s, h in ((0, 4), (1, 2), (2, 2)))
    for t in (q, k, v):
        t[total:] = float("nan")
    cu = cu_seqlens(lengths)
    out, lse, _ = attngen.flash_attn_varlen_func(
        q, k, v, cu, cu, 9, 9, causal=True, return_attn_probs=True
    )
    assert attngen.last_dispatch().module == "sm90/toy_varlen_fp32_d16_causal_br"
    assert_each_sequence_matches(TOY, out, lse, q, k, v, lengths, lengths, None)


def _cache_case(seed=5):
    k_cache = rand(2, 12, 2, 16, seed=seed)
    v_cache = rand(2, 12, 2, 16, seed=seed + 1)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    for b, n in enumerate(seqlens.tolist()):  # unwritten cache tails hold NaN
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    q = rand(2, 2, 4, 16, seed=seed + 2)  # two new tokens per row
    k_new, v_new = rand(2, 2, 2, 16, seed=seed + 3), rand(2, 2, 2, 16, seed=seed + 4)
    return q, k_cache, v_cache, k_new, v_new, seqlens


def _check_cache_result(out, lse, q, k_cache, v_cache, k_new, v_new, seqlens):
    for b, n in enumerate(seqlens.tolist()):
        assert torch.equal(k_cache[b, n : n + 2], k_new[b]) and torch.equal(
            v_cache[b, n : n + 2], v_new[b]
        )
        keys, values = (c[b, : n + 2].transpose(0, 1)[None] for c in (k_cache, v_cache))
        assert not compare_to_reference(
            TOY,
            out[b : b + 1].transpose(1, 2),
            lse[b : b + 1],
            q[b : b + 1].transpose(1, 2),
            keys,
            values,
        )


def test_flash_attn_with_kvcache_contiguous_and_paged(toy_kernels):
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
    out, lse = attngen.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        cache_seqlens=seqlens,
        causal=True,
        return_softmax_lse=True,
    )
    assert attngen.last_dispatch().module == "sm90/toy_varlen_fp32_d16_causal_br"
    assert out.shape == (2, 2, 4, 16) and lse.shape == (2, 4, 2)
    _check_cache_result(out, lse, q, k_cache, v_cache, k_new, v_new, seqlens)
    # the same cache in pages of 4 rows, in shuffled order
    q, k_flat, v_flat, k_new, v_new, seqlens = _cache_case()
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    k_pages = torch.empty(6, 4, 2, 16)
    v_pages = torch.empty(6, 4, 2, 16)
    k_pages[order] = k_flat.reshape(6, 4, 2, 16)
    v_pages[order] = v_flat.reshape(6, 4, 2, 16)
    table = order.view(2, 3).to(torch.int32)
    paged, paged_lse = attngen.flash_attn_with_kvcache(
        q,
        k_pages,
        v_pages,
        k_new,
        v_new,
        cache_seqlens=seqlens,
        block_table=table,
        causal=True,
        return_softmax_lse=True,
    )
    assert torch.equal(paged, out) and torch.equal(paged_lse, lse)
    # the pages hold what the contiguous cache holds, NaN tails included
    torch.testing.assert_close(
        k_pages[order].reshape(2, 12, 2, 16), k_cache, rtol=0, atol=0, equal_nan=True
    )
    with pytest.raises(ValueError, match="rotary_sin: pass rotary_cos and rotary_sin together"):
        attngen.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=torch.ones(1))


def test_kvcache_routes_to_a_decode_module_when_one_serves(toy_folder, tmp_path):
    saved = current_registry()
    try:
        load_kernels(toy_folder, build_fake_decode(tmp_path / "decode"), replace=True)
        entries = current_registry().entries
        module = current_registry().module(next(e.key for e in entries if e.kind == "decode"))
        q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
        out, lse = attngen.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k_new,
            v_new,
            cache_seqlens=seqlens,
            causal=True,
            return_softmax_lse=True,
        )
        assert attngen.last_dispatch().module == "sm90/toy_decode"
        assert module.CALLS == [torch.Size([2, 4, 2, 16])]  # [B, HQ, Nq, D], per the contract
        _check_cache_result(out, lse, q, k_cache, v_cache, k_new, v_new, seqlens)
    finally:
        use_registry(saved)


def test_kvcache_runs_the_generated_decode_kernels(tmp_path):
    """The toy spec's real decode modules, contiguous and paged: flash_attn_with_kvcache
    hands the caches over in place (flash-attn's [B, N, H, D] caches as [B, H, N, D] views, or
    its pages as they are), appends, and matches the reference."""
    decode = dict(
        name="toy",
        dtype="fp32",
        head_dim=16,
        num_q_heads=4,
        num_kv_heads=2,
        mask="causal",
        causal_align="bottom_right",
        kernels=["decode"],
        max_query_tokens=2,
    )
    folder = build_folder(
        tmp_path / "decode",
        [
            {**decode, "kv_layout": "contiguous"},
            {**decode, "name": "toy_pages", "kv_layout": "paged", "page_size": 4},
        ],
    )
    saved = current_registry()
    try:
        load_kernels(folder, replace=True)
        q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
        out, lse = attngen.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k_new,
            v_new,
            cache_seqlens=seqlens,
            causal=True,
            return_softmax_lse=True,
        )
        assert attngen.last_dispatch().module == "sm90/toy_decode_fp32_d16_causal_br_contig_q2"
        _check_cache_result(out, lse, q, k_cache, v_cache, k_new, v_new, seqlens)
        q, k_flat, v_flat, k_new, v_new, seqlens = _cache_case()
        order = torch.tensor([4, 1, 5, 0, 3, 2])
        k_pages, v_pages = torch.empty(6, 4, 2, 16), torch.empty(6, 4, 2, 16)
        k_pages[order], v_pages[order] = k_flat.reshape(6, 4, 2, 16), v_flat.reshape(6, 4, 2, 16)
        paged, paged_lse = attngen.flash_attn_with_kvcache(
            q,
            k_pages,
            v_pages,
            k_new,
            v_new,
            cache_seqlens=seqlens,
            block_table=order.view(2, 3).to(torch.int32),
            causal=True,
            return_softmax_lse=True,
        )
        assert attngen.last_dispatch().module == (
            "sm90/toy_pages_decode_fp32_d16_causal_br_paged4_q2"
        )
        _check_cache_result(
            paged,
            paged_lse,
            q,
            k_pages[order].reshape(2, 12, 2, 16),
            v_pages[order].reshape(2, 12, 2, 16),
            k_new,
            v_new,
            seqlens,
        )
    finally:
        use_registry(saved)


def test_ops_count_runs_and_compile_fullgraph(toy_kernels):
    """torch.compile(fullgraph=True) traces through the ops (their fake implementations give
    the shapes) and the compiled call equals eager. CPU Inductor needs a C++ compiler, which
    this machine has; the KV-cache case (in-place appends) uses aot_eager to stay fast."""
    q, k, v = qkv(2, 20, 20)

    def layer(q, k, v):
        return (
            attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2 + 1
        )

    ops.reset_run_counts()
    eager = layer(q, k, v)
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")(q, k, v)
    assert torch.equal(compiled, eager)
    key = next(iter(ops.run_counts()))
    assert key.endswith("toy_prefill_fp32_d16_causal_br.py") and ops.run_counts()[key] == 2

    def step(q, k_cache, v_cache, k_new, v_new, seqlens):
        return attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True
        )

    case_eager, case_compiled = _cache_case(), _cache_case()
    eager = step(*case_eager)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*case_compiled)
    assert torch.equal(compiled, eager)
    # the in-place append happened in the compiled call too
    torch.testing.assert_close(case_compiled[1], case_eager[1], rtol=0, atol=0, equal_nan=True)


def test_build_path_does_not_import_torch():
    code = (
        "import sys, attngen, attngen.cli, attngen.build, attngen.spec.hf; "
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules; "
        "attngen.spec_from_config; assert 'torch' not in sys.modules; "
        "attngen.flash_attn_func; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_dispatch_log_collects_in_order(toy_kernels):
    q, k, v = qkv(1, 4, 4)
    with attngen.dispatch_log() as log:
        attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        attngen.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    assert [d.api for d in log] == ["scaled_dot_product_attention", "flash_attn_func"]
    assert all(d.module == "sm90/toy_prefill_fp32_d16_causal_br" for d in log)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a served call never warns
        attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
