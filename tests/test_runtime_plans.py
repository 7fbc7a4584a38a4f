"""Plans (attngen/runtime/plans.py): an eager call whose signature was served before runs the
route the full path chose for it, without the full path. The planned call must be the full
path's call: the same module, the same record, the same output; a changed signature misses;
and no check whose outcome depends on values or on an option's type is skipped. Toy kernels
and stand-in modules (tests/runtime_harness.py) under the CPU interpreter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import attngen
from attngen.runtime import dispatch, ops, plans, selection
from attngen.runtime.hf import attngen_attention
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from tests.runtime_harness import build_stand_ins
from tests.test_runtime import _cache_case, qkv, rand


@pytest.fixture()
def planned_kernels(toy_folder, tmp_path):
    """The toy kernels and a stand-in decode module that takes out=, as the registry."""
    saved = current_registry()
    decode = build_stand_ins(tmp_path / "decode", ("decode",), accepts_out=True)
    yield load_kernels(toy_folder, decode, replace=True)
    use_registry(saved)


@pytest.fixture()
def full_path(monkeypatch):
    """Counts the calls that take the full path (a Need is built for them)."""
    needs = []

    def counted(real):
        return lambda *args, **kwargs: needs.append(args[0]) or real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "need_for", counted(dispatch.need_for))  # through Call.need
    return needs


def flash(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def _sdpa_cases():
    q, k, v = qkv(2, 6, 6)
    q_tl, k_tl, v_tl = qkv(1, 3, 7)
    q_al, k_al, v_al = qkv(1, 5, 9, hkv=4)
    slopes = 2.0 ** (-8.0 * torch.arange(1, 5, dtype=torch.float32) / 4)
    q_w, k_w, v_w = qkv(1, 9, 9, hq=2, hkv=2, dim=32, dtype=torch.float16)
    sdpa = attngen.scaled_dot_product_attention
    return {
        "sdpa causal gqa": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True),
        "sdpa top-left": lambda: sdpa(q_tl, k_tl, v_tl, is_causal=True, enable_gqa=True),
        "sdpa alibi": lambda: sdpa(q_al, k_al, v_al, alibi_slopes=slopes, scale=0.3),
        "sdpa window softcap": lambda: sdpa(
            q_w, k_w, v_w, window=(3, 0), softcap=5.0, causal_align="bottom_right"
        ),
        "flash causal lse": lambda: attngen.flash_attn_func(
            *flash(q, k, v), causal=True, return_attn_probs=True
        ),
        "flash one query row": lambda: attngen.flash_attn_func(
            *flash(q[:, :, :1], k, v), causal=True
        ),
        "flash window softcap": lambda: attngen.flash_attn_func(
            *flash(q_w, k_w, v_w), causal=True, window_size=(3, 0), softcap=5.0, softmax_scale=0.2
        ),
        "kvpacked": lambda: attngen.flash_attn_kvpacked_func(
            q.transpose(1, 2), torch.stack(flash(k, v), dim=2), causal=True
        ),
        "transformers": lambda: attngen_attention(
            SimpleNamespace(is_causal=True), q, k, v, None, scaling=0.25
        ),
    }


def _packed_cases():
    lengths = [3, 5]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = cu.clone()
    q, k, v = rand(8, 4, 16, seed=1), rand(8, 2, 16, seed=2), rand(8, 2, 16, seed=3)
    varlen = attngen.flash_attn_varlen_func
    return {
        "varlen causal lse": lambda: varlen(
            q, k, v, cu, cu, max(lengths), max(lengths), causal=True, return_attn_probs=True
        ),
        "varlen two cu tensors": lambda: varlen(q, k, v, cu, cu_k, 5, 5, causal=True),
    }


def _cache_cases():
    new = _cache_case()
    old = _cache_case(seed=9)
    kv = attngen.flash_attn_with_kvcache
    return {
        "kvcache append lse": lambda: kv(
            *new[:5], cache_seqlens=new[5], causal=True, return_softmax_lse=True
        ),
        "kvcache read only": lambda: kv(old[0][:, :1], old[1], old[2], cache_seqlens=old[5]),
    }


def all_cases():
    return {**_sdpa_cases(), **_packed_cases(), **_cache_cases()}


def tensors_of(result):
    return [t for t in (result if isinstance(result, tuple) else (result,)) if t is not None]


@pytest.mark.parametrize("case", list(all_cases()))
def test_a_planned_call_is_the_full_path_s_call(planned_kernels, full_path, case):
    """The second call of a signature skips the full path (no Need is built) and is the first
    call: the same recorded Dispatch object, the same output bits."""
    call = all_cases()[case]
    first = call()
    chosen = attngen.last_dispatch()
    assert len(full_path) == 1 and len(plans.planned(planned_kernels)) == 1
    with attngen.dispatch_log() as log:
        again = call()
    assert len(full_path) == 1, "the planned call took the full path"
    assert log == [chosen] and log[0] is chosen and attngen.last_dispatch() is chosen
    for full, planned in zip(tensors_of(first), tensors_of(again), strict=True):
        assert planned.shape == full.shape and planned.stride() == full.stride()
        torch.testing.assert_close(planned, full, rtol=0, atol=0, equal_nan=True)


def test_a_changed_signature_misses_the_plans(planned_kernels, full_path):
    q, k, v = qkv(1, 6, 6)
    sdpa = attngen.scaled_dot_product_attention
    sdpa(q, k, v, is_causal=True, enable_gqa=True)
    sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert len(full_path) == 1
    variants = [
        lambda: sdpa(q[:, :, :5], k[:, :, :5], v[:, :, :5], is_causal=True, enable_gqa=True),
        lambda: sdpa(q, k[:, :, :5], v[:, :, :5], is_causal=True, enable_gqa=True),
        lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True, scale=0.5),
        lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True, causal_align="bottom_right"),
        lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True, softcap=0.0),
        lambda: sdpa(
            torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), is_causal=True, enable_gqa=True
        ),
    ]
    for number, variant in enumerate(variants, start=2):
        variant()
        assert len(full_path) == number
    assert len(plans.planned(planned_kernels)) == len(variants) + 1
    with pytest.raises(attngen.NoKernelError, match="dtype=fp16"):  # another dtype: its own Need
        sdpa(q.half(), k.half(), v.half(), is_causal=True, enable_gqa=True)
    with pytest.raises(attngen.NoKernelError, match="mask: needs none"):  # another option
        sdpa(q, k, v, enable_gqa=True)
    assert len(plans.planned(planned_kernels)) == len(variants) + 1


def test_an_option_of_another_type_takes_the_full_path(planned_kernels, full_path):
    """Keys compare options by value, where 1 == 1.0 == True: an option that is not of its
    plain type never runs from a plan, so the full path's type checks still refuse it."""
    q, k, v = flash(*qkv(1, 6, 6))
    attngen.flash_attn_func(q, k, v, causal=True, softmax_scale=1.0)
    attngen.flash_attn_func(q, k, v, causal=True, softmax_scale=1.0)
    assert len(full_path) == 1
    with pytest.raises(ValueError, match=r"scale: expected a finite float > 0 .* got True"):
        attngen.flash_attn_func(q, k, v, causal=True, softmax_scale=True)
    attngen.flash_attn_func(q, k, v, causal=1, softmax_scale=1)  # accepted, by the full path
    assert len(full_path) == 3
    qw, kw, vw = flash(*qkv(1, 9, 9, hq=2, hkv=2, dim=32, dtype=torch.float16))
    for _ in range(2):
        attngen.flash_attn_func(qw, kw, vw, causal=True, window_size=(3, 0), softcap=5.0)
    assert len(full_path) == 4
    with pytest.raises(ValueError, match=r"window_size: got \(3.0, 0\)"):
        attngen.flash_attn_func(qw, kw, vw, causal=True, window_size=(3.0, 0), softcap=5.0)
    attngen.flash_attn_func(qw, kw, vw, causal=True, window_size=[3, 0], softcap=5.0)
    assert len(full_path) == 5  # the float window was refused before its Need


def test_a_planned_kvcache_signature_still_checks_what_its_key_leaves_open(planned_kernels):
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()

    def step(**changed):
        args = dict(
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            k=k_new,
            v=v_new,
            cache_seqlens=seqlens,
            causal=True,
        )
        return attngen.flash_attn_with_kvcache(**{**args, **changed})

    step()
    step()
    assert attngen.last_dispatch().module == "sm90/toy_decode_out"
    with pytest.raises(
        ValueError,
        match=r"cache_seqlens: expected an int or int32 \[2\], got "
        r"\(2,\) torch.int64",
    ):
        step(cache_seqlens=seqlens.long())
    with pytest.raises(
        ValueError,
        match=r"k_cache: expected dtype torch.float32 on device cpu "
        r"\(as q\), got dtype torch.float64",
    ):
        step(k_cache=k_cache.double())
    with pytest.raises(
        ValueError,
        match=r"v: expected dtype torch.float32 on device cpu \(as "
        r"q\), got dtype torch.float32 on device meta",
    ):
        step(v=v_new.to("meta"))
    with pytest.raises(ValueError, match=r"cache_seqlens: got 11; allowed: 0..10"):
        step(cache_seqlens=11)  # an int is checked against the capacity on every call
    with pytest.raises(ValueError, match="k_descale: dequantizes an fp8 cache"):
        step(k_descale=torch.ones(2, 2))  # descales are in the key: refused, never ignored


def test_calls_that_need_the_op_layer_never_run_from_a_plan(planned_kernels, monkeypatch):
    q, k, v = flash(*qkv(1, 6, 6))
    attngen.flash_attn_func(q, k, v, causal=True)
    through_op = []
    real = ops.prefill_op
    monkeypatch.setattr(ops, "prefill_op", lambda *args: through_op.append(args[0]) or real(*args))
    attngen.flash_attn_func(q, k, v, causal=True)
    assert through_op == []
    # A tensor that requires grad takes the full path, which refuses these forward-only
    # modules (its op layer runs with gradient kernels: test_backward_runtime.py).
    with pytest.raises(attngen.NoKernelError, match="backward: needs true"):
        attngen.flash_attn_func(q.detach().requires_grad_(), k, v, causal=True)
    assert through_op == []

    class Subclass(torch.Tensor):
        pass

    attngen.flash_attn_func(q.as_subclass(Subclass), k, v, causal=True)
    assert through_op == [attngen.last_dispatch().key]


def test_one_query_row_is_written_in_the_caller_s_layout_without_out(tmp_path):
    """With one query token the module's own [B, HQ, 1, DV] output is the [B, 1, HQ, DV]
    layout: no out= is passed (its checks and view cost more than they save), and the output
    is still one contiguous tensor, the same values as with out=."""
    saved = current_registry()
    load_kernels(
        build_stand_ins(tmp_path / "out", ("prefill", "decode"), accepts_out=True), replace=True
    )
    try:
        q, k_cache, v_cache, _, _, seqlens = _cache_case()
        for tokens, wrote_out in ((2, True), (1, False)):
            step = q[:, :tokens].contiguous()
            for _ in range(2):  # the full path, then the plan
                out = attngen.flash_attn_with_kvcache(
                    step, k_cache, v_cache, cache_seqlens=seqlens, causal=True
                )
                module = current_registry().module(attngen.last_dispatch().key)
                assert module.WROTE[-1] == (out.data_ptr() if wrote_out else None)
                assert out.shape == (2, tokens, 4, 16) and out.is_contiguous()
            flash_out = attngen.flash_attn_func(step, k_cache[:, :7], v_cache[:, :7], causal=True)
            module = current_registry().module(attngen.last_dispatch().key)
            assert module.WROTE[-1] == (flash_out.data_ptr() if wrote_out else None)
            assert flash_out.is_contiguous()
            torch.testing.assert_close(flash_out[1], out[1], rtol=0, atol=0)  # 7 keys cached
    finally:
        use_registry(saved)


def test_routes_are_bounded_and_kept_only_by_the_registry_that_chose(
    planned_kernels, monkeypatch, tmp_path
):
    monkeypatch.setattr(selection, "ROUTE_CACHE_SIZE", 8)
    for n in (3, 4, 5, 6, 7, 8, 9, 10):
        q, k, v = flash(*qkv(1, n, n))
        attngen.flash_attn_func(q, k, v, causal=True)
        assert len(selection.routes(planned_kernels)) <= 8
        assert any(key[1] == q.shape for key in plans.planned(planned_kernels))  # this call's
    chosen = attngen.last_dispatch()
    other = load_kernels(build_stand_ins(tmp_path / "other", ("prefill",)), replace=True)
    plans.remember(("a key",), chosen, 0.25, False, True)  # chosen by the replaced registry
    assert plans.planned(other) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200")
def test_planned_calls_of_the_generated_modules_on_the_gpu(full_path):
    """tools/host_overhead.py's calls, with the repository's generated/ modules on CUDA: the
    second call of each runs from its plan, records the same Dispatch and gives the same bits."""
    saved = current_registry()
    try:
        load_kernels()

        def rand(*shape, dtype=torch.float16):
            return torch.randn(*shape, device="cuda", dtype=dtype)

        q, k, v = (rand(1, 64, 12, 64) for _ in range(3))  # flash layout, BERT's and GPT-2's
        ql, kl, vl = (
            rand(64, 32, 128, dtype=torch.bfloat16),
            *(rand(64, 8, 128, dtype=torch.bfloat16) for _ in range(2)),
        )
        cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)
        qd, k_new, v_new = (
            rand(1, 1, 28, 128, dtype=torch.bfloat16),
            *(rand(1, 1, 4, 128, dtype=torch.bfloat16) for _ in range(2)),
        )
        k_cache, v_cache = (rand(1, 4096, 4, 128, dtype=torch.bfloat16) for _ in range(2))
        qp, pages = (
            rand(1, 1, 32, 128, dtype=torch.bfloat16),
            rand(256, 16, 8, 128, dtype=torch.bfloat16),
        )
        table = torch.arange(256, device="cuda", dtype=torch.int32)[None]
        lens = torch.full((1,), 64, dtype=torch.int32, device="cuda")
        calls = [
            lambda: attngen.scaled_dot_product_attention(*flash(q, k, v)),
            lambda: attngen.flash_attn_func(q, k, v, return_attn_probs=True),
            lambda: attngen.flash_attn_func(q, k, v, causal=True),
            lambda: attngen_attention(SimpleNamespace(is_causal=True), *flash(q, k, v), None),
            lambda: attngen.flash_attn_varlen_func(ql, kl, vl, cu, cu, 64, 64, causal=True),
            lambda: attngen.flash_attn_with_kvcache(
                qd, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True
            ),
            lambda: attngen.flash_attn_with_kvcache(
                qp,
                pages,
                pages,
                cache_seqlens=lens,
                block_table=table,
                causal=True,
                return_softmax_lse=True,
            ),
        ]
        for call in calls:
            first = call()
            chosen, needs = attngen.last_dispatch(), len(full_path)
            again = call()
            assert len(full_path) == needs and attngen.last_dispatch() is chosen
            for full, planned in zip(tensors_of(first), tensors_of(again), strict=True):
                assert torch.equal(planned, full) and planned.stride() == full.stride()
    finally:
        use_registry(saved)
