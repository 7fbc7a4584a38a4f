"""Regression tests for what the API-level suite (tests/test_api_*.py) found, one per finding,
on the suite's toy modules (tests/api_harness.py):

- the torch fallback refuses an invalid call with the same ValueError as a generated module;
- a packed sequence longer than max_seqlen_q gets NaN (kernel and fallback), and the checked
  mode (ATTNGEN_CHECKS=1) raises for it;
- flash_attn_with_kvcache's varlen route refuses before it appends: a refused call leaves the
  caches as they were;
- with ALiBi, a top-left window that covers every key is not served by the mask-none module
  (whose bias distance is bottom-right's).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import attngen
from tests.api_harness import (
    INT32_MAX,
    Semantics,
    api_kernels,  # noqa: F401  (the module-scoped registry fixture)
    reference_problems,
)


def seeded(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def refusal(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def in_fallback(kernels, fn):
    """fn() with no module loaded and fallback "sdpa" (the warning is by design)."""
    with kernels.fallback_only(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn()


def slopes(heads=4):
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)


# ------------------------------------------------------ the fallback refuses as a module


def dense_call(mistake: str):
    """An SDPA call ([B, H, N, D], fp32, D 16, 4 over 2 heads) with one mistake; the toy
    modules serve it without the mistake (causal bottom-right, or ALiBi without a mask)."""
    q, k, v = seeded(2, 4, 5, 16), seeded(2, 2, 9, 16, seed=1), seeded(2, 2, 9, 16, seed=2)
    alibi = None
    if mistake == "k_dtype":
        k = k.half()
    elif mistake == "k_head_dim":
        k = seeded(2, 2, 9, 24)
    elif mistake == "gqa_ratio":
        k, v = seeded(2, 3, 9, 16), seeded(2, 3, 9, 16)
    elif mistake == "batch":
        k, v = k[:1], v[:1]
    elif mistake == "v_length":
        v = seeded(2, 2, 8, 16)
    elif mistake == "slopes_strided":
        alibi = slopes(8)[::2]
    elif mistake == "slopes_shape":
        alibi = slopes(5)
    elif mistake == "slopes_dtype":
        alibi = slopes().double()

    def call():
        return attngen.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=alibi is None,
            causal_align="bottom_right",
            enable_gqa=True,
            alibi_slopes=alibi,
        )

    return call


@pytest.mark.parametrize(
    "mistake",
    [
        "k_dtype",
        "k_head_dim",
        "gqa_ratio",
        "batch",
        "v_length",
        "slopes_strided",
        "slopes_shape",
        "slopes_dtype",
    ],
)
def test_dense_fallback_refuses_as_a_module_does(api_kernels, mistake):  # noqa: F811
    call = dense_call(mistake)
    module_says = refusal(call)
    assert refusal(lambda: in_fallback(api_kernels, call)) == module_says


def varlen_call(mistake: str):
    """flash_attn_varlen_func, causal, two packed sequences, with one mistake."""
    q, k, v = seeded(7, 4, 16), seeded(12, 2, 16, seed=1), seeded(12, 2, 16, seed=2)
    cu_q = torch.tensor([0, 5, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12], dtype=torch.int32)
    max_q = 5
    if mistake == "cu_int64":
        cu_q = cu_q.long()
    elif mistake == "cu_strided":
        cu_k = torch.tensor([0, 0, 9, 0, 12, 0], dtype=torch.int32)[::2]
    elif mistake == "cu_shape":
        cu_k = torch.tensor([0, 9], dtype=torch.int32)
    elif mistake == "k_dtype":
        k = k.half()
    elif mistake == "gqa_ratio":
        k, v = seeded(12, 3, 16), seeded(12, 3, 16)
    elif mistake == "max_seqlen_q":
        max_q = -1

    def call():
        return attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, 9, causal=True)

    return call


@pytest.mark.parametrize(
    "mistake", ["cu_int64", "cu_strided", "cu_shape", "k_dtype", "gqa_ratio", "max_seqlen_q"]
)
def test_varlen_fallback_refuses_as_a_module_does(api_kernels, mistake):  # noqa: F811
    call = varlen_call(mistake)
    module_says = refusal(call)
    assert refusal(lambda: in_fallback(api_kernels, call)) == module_says


def test_max_seqlen_must_be_an_int(api_kernels):  # noqa: F811
    q, k = seeded(4, 4, 16), seeded(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for bad in (None, 4.0):
        message = refusal(lambda bad=bad: attngen.flash_attn_varlen_func(q, k, k, cu, cu, bad, 4))
        assert "max_seqlen_q" in message


# ----------------------------------------------------- max_seqlen_q below a sequence's length


def packed_beyond_max_seqlen_q():
    """Sequence 0 has 33 queries, max_seqlen_q says 32: the 16-row query blocks the grid has
    cover 32 rows, so the kernel cannot serve it; sequence 1 is well-formed."""
    q, k, v = seeded(35, 4, 16), seeded(14, 2, 16, seed=1), seeded(14, 2, 16, seed=2)
    cu_q = torch.tensor([0, 33, 35], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 14], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("route", ["kernel", "fallback"])
def test_a_sequence_longer_than_max_seqlen_q_is_nan(api_kernels, route):  # noqa: F811
    q, k, v, cu_q, cu_k = packed_beyond_max_seqlen_q()

    def call():
        return attngen.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 32, 9, causal=True, return_attn_probs=True
        )

    out, lse, _ = call() if route == "kernel" else in_fallback(api_kernels, call)
    assert out[:33].isnan().all() and lse[:, :33].isnan().all()

    def heads_first(t):
        return t.transpose(0, 1)[None]

    problems = reference_problems(
        Semantics("causal", "bottom_right"),
        heads_first(out[33:]),
        lse[:, 33:][None],
        heads_first(q[33:]),
        heads_first(k[5:]),
        heads_first(v[5:]),
    )
    assert not problems, problems


@pytest.mark.parametrize("route", ["kernel", "fallback"])
def test_checked_mode_refuses_a_sequence_longer_than_max_seqlen_q(
    api_kernels,  # noqa: F811
    route,
    monkeypatch,
):
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    q, k, v, cu_q, cu_k = packed_beyond_max_seqlen_q()

    def call():
        return attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 32, 9, causal=True)

    message = refusal(call if route == "kernel" else lambda: in_fallback(api_kernels, call))
    assert "max_seqlen_q = 32" in message and "sequence 0 has 33" in message


# ------------------------------------------ the KV-cache varlen route refuses before appending


def kv_call(**changes):
    """flash_attn_with_kvcache on a contiguous fp32 cache, D 16, 4 over 2 heads, two new keys;
    without a contiguous decode module for ALiBi, the varlen route serves it."""
    k_cache, v_cache = seeded(2, 12, 2, 16, seed=3), seeded(2, 12, 2, 16, seed=4)
    args = dict(
        q=seeded(2, 1, 4, 16),
        k_cache=k_cache,
        v_cache=v_cache,
        k=seeded(2, 2, 2, 16, seed=5),
        v=seeded(2, 2, 2, 16, seed=6),
        cache_seqlens=torch.tensor([3, 7], dtype=torch.int32),
        alibi_slopes=slopes(),
    )
    args.update(changes)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    return args, before


@pytest.mark.parametrize(
    "mistake, error",
    [
        ("causal_many_queries", attngen.NoKernelError),  # ALiBi, causal: no module serves it
        ("slopes_strided", ValueError),
        ("softmax_scale", ValueError),
        ("new_heads", ValueError),
        ("new_dtype", ValueError),
    ],
)
@pytest.mark.parametrize("fallback", [False, True])
def test_a_refused_kvcache_call_changes_no_cache(
    api_kernels,  # noqa: F811
    mistake,
    error,
    fallback,
):
    changes = {
        "causal_many_queries": dict(causal=True, q=seeded(2, 5, 4, 16)),
        "slopes_strided": dict(alibi_slopes=slopes(8)[::2]),
        "softmax_scale": dict(softmax_scale=-1.0),
        "new_heads": dict(k=seeded(2, 2, 3, 16)),
        "new_dtype": dict(v=seeded(2, 2, 2, 16).double()),
    }[mistake]
    if fallback and error is attngen.NoKernelError:
        return  # with the fallback that call is served
    args, before = kv_call(**changes)
    with pytest.raises(error):
        if fallback:
            in_fallback(api_kernels, lambda: attngen.flash_attn_with_kvcache(**args))
        else:
            attngen.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


# ------------------------------------------------ ALiBi with a window that covers every key


def test_alibi_with_a_covering_top_left_window_is_not_mask_none(api_kernels):  # noqa: F811
    """SDPA's window (INT32_MAX, INT32_MAX) top-left excludes no key, but its ALiBi distance
    is top-left's (|i - j|); the mask-none ALiBi module's is bottom-right's. No module serves
    it; the fallback computes the top-left distance."""
    q, k, v = seeded(1, 4, 3, 16), seeded(1, 2, 7, 16, seed=1), seeded(1, 2, 7, 16, seed=2)

    def call(fallback=None):
        return attngen.scaled_dot_product_attention(
            q,
            k,
            v,
            enable_gqa=True,
            window=(INT32_MAX, INT32_MAX),
            causal_align="top_left",
            alibi_slopes=slopes(),
            fallback=fallback,
        )

    with pytest.raises(attngen.NoKernelError):
        call()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = call("sdpa")
    sem = Semantics("sliding_window", "top_left", (INT32_MAX, INT32_MAX), alibi=True)
    problems = reference_problems(sem, out, None, q, k, v, slopes=slopes())
    assert not problems, problems
