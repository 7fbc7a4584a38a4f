"""API-level properties of the dense entry points: attngen.flash_attn_func,
attngen.scaled_dot_product_attention and a generated module's attention().

Hypothesis draws calls as a user would write them, valid and invalid: dtypes, head dims, GQA
ratios (and ratios that do not divide), lengths at the 16-row tile boundaries and 0, empty
batches, masks, windows with a side at the int32 limit, softcap, ALiBi with Nq != Nk (and
slopes of the wrong shape, dtype or stride), scales, q magnitudes up to scores of 1e10, inputs
at storage offsets, with gaps and transposed in memory, SDPA's attn_mask with the torch
fallback, and the torch fallback itself (no module loaded, fallback "sdpa"). Each call must
match the float64 reference or raise ValueError / NoKernelError (tests/api_harness.py, Expect),
and every input buffer must be bitwise unchanged. Failures found are kept as @example.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attngen
from tests.api_dense_cases import (
    DTYPES,
    FLASH_WINDOWS,
    MISTAKES,
    SDPA_WINDOWS,
    SLOPE_MISTAKES,
    Call,
    calls,
    expectation,
    guard_all,
    tensors,
)
from tests.api_harness import (
    INT32_MAX,
    Expect,
    Semantics,
    api_kernels,  # noqa: F401  (the module-scoped registry fixture)
    attempt,
    dense_mask_problems,
    flash_semantics,
    reference_problems,
    served,
)
from tests.api_memory import isolated, unexpected_writes


def run_routed(kernels, call: Call, fn):
    if not call.fallback:
        return fn()
    with kernels.fallback_only(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the fallback's warning, by design
        return fn()


def input_problems(guards) -> list[str]:
    return [p for name, g in guards.items() for p in unexpected_writes(name, g)]


# ------------------------------------------------------------------------- flash_attn_func


@st.composite
def flash_calls(draw):
    return draw(calls()), draw(st.booleans()), draw(st.sampled_from(FLASH_WINDOWS))


def check_flash_attn_func(kernels, call: Call, causal: bool, window_size) -> None:
    q, k, v, slopes = tensors(call, heads_first=False)
    guards = guard_all(call, q, k, v, slopes)
    sem = flash_semantics(causal, window_size, call.softcap, call.alibi)
    kind_served = served(
        kernels.specs,
        "prefill",
        DTYPES[call.dtype],
        call.head_dim,
        sem,
        call.seqlen_q,
        call.seqlen_k,
        call.seqlen_q == call.seqlen_k,
    )
    expect, names = expectation(call, kind_served)
    slopes_arg = guards["alibi_slopes"].view if slopes is not None else None

    def fn():
        return attngen.flash_attn_func(
            guards["q"].view,
            guards["k"].view,
            guards["v"].view,
            softmax_scale=call.scale,
            causal=causal,
            window_size=window_size,
            softcap=call.softcap,
            alibi_slopes=slopes_arg,
            return_attn_probs=call.return_lse,
        )

    result, _ = attempt(lambda: run_routed(kernels, call, fn), expect, names)
    problems = input_problems(guards)
    if result is not None:
        out, lse = (result[0], result[1]) if call.return_lse else (result, None)
        ref_slopes = None if slopes is None else slopes.reshape(-1, slopes.shape[-1])[0]
        problems += reference_problems(
            sem,
            out.transpose(1, 2),
            lse,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            scale=call.scale,
            slopes=ref_slopes,
        )
    assert not problems, "; ".join(problems)


@settings(max_examples=15)
@given(flash_calls())
# found: ALiBi without a mask used |i - j| when Nq != Nk (flash-attn: |i + Nk - Nq - j|)
@example((Call(alibi=True, seqlen_q=3, seqlen_k=1), False, (-1, -1)))
# found: window_size (3, -1) and (-1, 3) are a side of 2**31 - 1, which overflowed int32
@example((Call(), False, (3, -1)))
@example((Call(seqlen_q=17, seqlen_k=3), False, (-1, 3)))
# found: the torch fallback validated nothing (a torch error, or a result for a wrong call)
@example((Call(mistake="k_head_dim", fallback=True), True, (-1, -1)))
@example((Call(mistake="gqa_ratio", heads=(4, 3), fallback=True), False, (-1, -1)))
@example(
    (Call(dtype="fp16", alibi=True, mistake="k_dtype", fallback=True), True, (INT32_MAX - 1, 0))
)
# found: a strided alibi_slopes was read with stride 1
@example((Call(alibi=True, seqlen_q=9, seqlen_k=9, mistake="slopes_strided"), False, (-1, -1)))
# an empty batch with a window past the spec's limit (causal at every length)
@example((Call(batch=0), True, (2**31, 0)))
# scores near 1e10 in fp32
@example((Call(magnitude=2, seqlen_q=17, seqlen_k=33), False, (-1, -1)))
def test_flash_attn_func(api_kernels, case):  # noqa: F811
    isolated(check_flash_attn_func, api_kernels, *case)


# ------------------------------------------------------------ scaled_dot_product_attention


@st.composite
def sdpa_calls(draw):
    call = draw(calls(mistakes=tuple(m for m in MISTAKES if m != "slopes_2d")))
    window = draw(st.sampled_from(SDPA_WINDOWS))
    is_causal = window is None and draw(st.booleans())
    attn_mask = draw(st.sampled_from((None, None, None, "bool2d", "bool4d", "float4d")))
    return call, is_causal, window, draw(st.sampled_from(("top_left", "bottom_right"))), attn_mask


def make_attn_mask(kind, call: Call, gen):
    if kind is None:
        return None
    hq = call.heads[0]
    shape = (
        (call.seqlen_q, call.seqlen_k)
        if kind == "bool2d"
        else (call.batch, hq, call.seqlen_q, call.seqlen_k)
    )
    keep = torch.rand(*shape, generator=gen) < 0.7
    if kind.startswith("bool"):
        return keep
    return torch.where(keep, torch.rand(*shape, generator=gen), float("-inf")).to(
        DTYPES[call.dtype]
    )


def check_sdpa(kernels, call: Call, is_causal, window, causal_align, mask_kind) -> None:
    q, k, v, slopes = tensors(call, heads_first=True)
    guards = guard_all(call, q, k, v, slopes)
    attn_mask = make_attn_mask(mask_kind, call, torch.Generator().manual_seed(call.seed))
    mask = "sliding_window" if window else ("causal" if is_causal else "none")
    sem = Semantics(mask, causal_align, window, call.softcap, call.alibi)
    kind_served = served(
        kernels.specs,
        "prefill",
        DTYPES[call.dtype],
        call.head_dim,
        sem,
        call.seqlen_q,
        call.seqlen_k,
        call.seqlen_q == call.seqlen_k,
    )
    expect, names = expectation(call, kind_served and attn_mask is None)
    if attn_mask is not None and call.mistake == "none":
        # no kernel takes a dense mask: refused unless the caller asked for the fallback
        expect, names = (Expect.SERVE, ()) if call.fallback else (Expect.REFUSE, ("attn_mask",))
    slopes_arg = guards["alibi_slopes"].view if slopes is not None else None

    def fn():
        return attngen.scaled_dot_product_attention(
            guards["q"].view,
            guards["k"].view,
            guards["v"].view,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=call.scale,
            enable_gqa=True,
            window=window,
            softcap=call.softcap or None,
            alibi_slopes=slopes_arg,
            causal_align=causal_align,
            fallback="sdpa" if call.fallback else None,
        )

    out, _ = attempt(lambda: run_routed(kernels, call, fn), expect, names)
    problems = input_problems(guards)
    if out is not None and attn_mask is not None:
        problems += dense_mask_problems(
            sem, attn_mask, out, q, k, v, scale=call.scale, slopes=slopes
        )
    elif out is not None:
        problems += sdpa_problems(kernels, call, sem, out, q, k, v, slopes, fn)
    assert not problems, "; ".join(problems)


def sdpa_problems(kernels, call, sem, out, q, k, v, slopes, fn) -> list[str]:
    """ALiBi without a mask and Nq != Nk: SDPA documents its distance convention; either is
    accepted here, but the kernel and the torch fallback must give the same one."""
    if not (sem.alibi and sem.mask == "none" and call.seqlen_q != call.seqlen_k):
        return reference_problems(sem, out, None, q, k, v, scale=call.scale, slopes=slopes)
    by_align = {
        align: reference_problems(
            replace(sem, align=align), out, None, q, k, v, scale=call.scale, slopes=slopes
        )
        for align in ("top_left", "bottom_right")
    }
    matching = [align for align, problems in by_align.items() if not problems]
    if not matching:
        return [f"ALiBi distance ({align}): {'; '.join(p)}" for align, p in by_align.items()]
    if call.fallback:
        return []
    with kernels.fallback_only(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch_out = fn()
    torch_ok = any(
        not reference_problems(
            replace(sem, align=align), torch_out, None, q, k, v, scale=call.scale, slopes=slopes
        )
        for align in matching
    )
    return (
        []
        if torch_ok
        else [
            f"ALiBi distance: the kernel's is {' or '.join(matching)}, the torch fallback's is not"
        ]
    )


@settings(max_examples=15)
@given(sdpa_calls())
# found: a 4-D boolean attn_mask with fallback "sdpa" zeroed the wrong axis (or crashed)
@example((Call(fallback=True), False, None, "top_left", "bool4d"))
@example(
    (Call(alibi=True, fallback=True, seqlen_q=4, seqlen_k=4), False, None, "bottom_right", "bool4d")
)
# found: ALiBi without a mask, Nq != Nk: the kernel and the torch fallback disagreed
@example((Call(alibi=True, seqlen_q=3, seqlen_k=7), False, None, "bottom_right", None))
# found: the torch fallback returned results for a batch mismatch and a negative scale
@example(
    (
        Call(mistake="batch", softcap=5.0, fallback=True),
        False,
        (INT32_MAX, INT32_MAX),
        "bottom_right",
        "bool2d",
    )
)
@example((Call(mistake="scale", scale=-1.0, fallback=True), False, (3, 0), "bottom_right", None))
# found: a top-left window that covers every key, with ALiBi, ran on the mask-none module,
# whose ALiBi distance is bottom-right's
@example(
    (Call(alibi=True, seqlen_q=15, seqlen_k=31), False, (INT32_MAX, INT32_MAX), "top_left", None)
)
def test_scaled_dot_product_attention(api_kernels, case):  # noqa: F811
    isolated(check_sdpa, api_kernels, *case)


# ------------------------------------------------------------- a module's attention()

# the toy prefill modules; mask none with ALiBi uses flash-attn's bottom-right distance
MODULE_SPECS = (
    "api",
    "api_none",
    "api_tl",
    "api_alibi",
    "api_right",
    "api_left",
    "api_win",
    "api_h32",
)


@st.composite
def module_calls(draw):
    name = draw(st.sampled_from(MODULE_SPECS))
    call = draw(calls(mistakes=tuple(MISTAKES) + ("slopes_missing", "slopes_given")))
    return name, call


def module_semantics(spec: dict) -> Semantics:
    window = (
        (spec["window_left"], spec["window_right"]) if (spec["mask"] == "sliding_window") else None
    )
    align = spec.get("causal_align") or "bottom_right"
    return Semantics(
        spec["mask"], align, window, float(spec.get("softcap") or 0.0), bool(spec.get("alibi"))
    )


def module_expectation(call: Call, alibi_spec: bool) -> tuple[Expect, tuple[str, ...]]:
    if call.mistake in ("slopes_missing", "slopes_given"):
        wrong = (call.mistake == "slopes_missing") == alibi_spec
        return (Expect.REFUSE, ("alibi_slopes",)) if wrong else (Expect.SERVE, ())
    if call.mistake in SLOPE_MISTAKES and not alibi_spec:
        return Expect.REFUSE, ("alibi_slopes",)  # slopes given to a module without ALiBi
    if call.mistake in ("none", "inner_stride"):
        return Expect.SERVE, ()  # a module documents "any strides"
    return MISTAKES[call.mistake]


def check_module_attention(kernels, name: str, call: Call) -> None:
    module = kernels.module_for(name, "prefill")
    spec = next(e.spec for e in kernels.registry.entries if e.spec["name"] == name)
    alibi_spec = bool(spec.get("alibi"))
    alibi = {"slopes_missing": False, "slopes_given": True}.get(call.mistake, alibi_spec)
    alibi = alibi or call.mistake in SLOPE_MISTAKES
    call = replace(
        call,
        dtype=spec["dtype"],
        head_dim=spec["head_dim"],
        alibi=alibi,
        softcap=float(spec.get("softcap") or 0.0),
        fallback=False,
    )
    q, k, v, slopes = tensors(call, heads_first=True)
    guards = guard_all(call, q, k, v, slopes)
    expect, names = module_expectation(call, alibi_spec)
    slopes_arg = guards["alibi_slopes"].view if slopes is not None else None
    result, _ = attempt(
        lambda: module.attention(
            guards["q"].view,
            guards["k"].view,
            guards["v"].view,
            sm_scale=call.scale,
            alibi_slopes=slopes_arg,
            return_lse=True,
        ),
        expect,
        names,
    )
    problems = input_problems(guards)
    if result is not None:
        out, lse = result
        ref_slopes = None if slopes is None else slopes.reshape(-1, slopes.shape[-1])[0]
        problems += reference_problems(
            module_semantics(spec), out, lse, q, k, v, scale=call.scale, slopes=ref_slopes
        )
    assert not problems, "; ".join(problems)


@settings(max_examples=10)
@given(module_calls())
# found: ALiBi without a mask used |i - j| when Nq != Nk
@example(("api_alibi", Call(alibi=True, seqlen_q=1, seqlen_k=2)))
# found: window sides of 2**31 - 1 overflowed int32 (right: zeros; left with Nq > Nk: wrong)
@example(("api_right", Call()))
@example(("api_left", Call(seqlen_q=17, seqlen_k=3)))
def test_module_attention(api_kernels, case):  # noqa: F811
    isolated(check_module_attention, api_kernels, *case)


@pytest.mark.slow
@settings(max_examples=300)
@given(
    st.one_of(
        flash_calls().map(lambda c: ("flash", c)),
        sdpa_calls().map(lambda c: ("sdpa", c)),
        module_calls().map(lambda c: ("module", c)),
    )
)
def test_dense_entry_points_more(api_kernels, drawn):  # noqa: F811
    """The three properties above with many more examples (`pytest -m slow`)."""
    which, case = drawn
    check = {"flash": check_flash_attn_func, "sdpa": check_sdpa, "module": check_module_attention}[
        which
    ]
    isolated(check, api_kernels, *case)


# ------------------------------------------------------------------- errors that mislead


def test_backward_says_the_kernels_are_forward_only(api_kernels):  # noqa: F811
    """Only forward-only modules are loaded (and no on-demand builds): a call whose inputs
    require grad is refused, and the error says the modules are forward-only, not torch's
    generic "no autograd formula"."""
    q = torch.randn(1, 5, 4, 16, requires_grad=True)
    k, v = torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    try:
        out = attngen.flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        assert "forward" in str(exc).lower(), f"the error does not say forward-only: {exc}"
    else:
        pytest.fail("backward through a forward-only kernel returned gradients")
