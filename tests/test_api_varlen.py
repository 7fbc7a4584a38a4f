"""API-level properties of packed sequences: attngen.flash_attn_varlen_func and a generated
module's attention_varlen().

Hypothesis draws packed batches (empty batches, empty sequences, lengths at the 16-row tile
boundaries, NaN padding rows, seqused_k over key spans with unused NaN rows), GQA ratios,
flash-attn masks and windows at the int32 limit, ALiBi with Nq != Nk, max_seqlen_* above or
below the true maximum, and index tensors that are out of range, negative, strided or of the
wrong dtype, with and without the checked mode (ATTNGEN_CHECKS=1). Every tensor is a view into
a sentinel-filled buffer. A call must raise ValueError / NoKernelError, or give every well-formed
sequence the float64 reference's result and every sequence whose indices leave the tensors NaN
output and LSE; no buffer may change. Each example runs in a forked child (a stray store can
kill the process: that is one failing example, not the end of the run).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attngen
from tests.api_harness import (
    Expect,
    api_kernels,  # noqa: F401  (the module-scoped registry fixture)
    attempt,
    draw_mistake,
    flash_semantics,
    reference_problems,
    served,
)
from tests.api_memory import Layout, guarded, isolated, unexpected_writes

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Flavor:
    """A kind of call: dtype, dims and flash-attn's mask arguments; `module` names the toy
    spec that serves it (None: nothing does, or only at some lengths)."""

    dtype: str
    head_dim: int
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    alibi: bool
    module: str | None


FLAVORS = (
    Flavor("fp32", 16, True, (-1, -1), 0.0, False, "api"),
    Flavor("fp32", 16, False, (-1, -1), 0.0, True, "api_alibi"),
    Flavor("fp32", 16, False, (3, -1), 0.0, False, "api_right"),
    Flavor("fp32", 16, False, (-1, 3), 0.0, False, "api_left"),
    Flavor("fp16", 16, True, (3, -1), 5.0, False, "api_win"),
    Flavor("fp16", 32, True, (-1, -1), 0.0, False, "api_h32"),
    # a causal call only the window kernel can serve, and only while every key is in reach
    Flavor("fp16", 16, True, (-1, -1), 5.0, False, None),
)
LENGTHS = (0, 1, 2, 5, 15, 16, 17, 33)
HEADS = ((4, 2), (4, 4), (4, 1), (2, 2))
# mistake -> (what the call may do, what a refusal must name); None: decided per sequence
MISTAKES = {
    "none": (None, ()),
    "cu_strided": (Expect.EITHER, ("cu_seqlens",)),
    "seqused_strided": (Expect.EITHER, ("seqused_k",)),
    "slopes_strided": (Expect.EITHER, ("alibi_slopes",)),
    "cu_int64": (Expect.EITHER, ("cu_seqlens",)),
    "cu_shape": (Expect.REFUSE, ("cu_seqlens",)),
    "cu_beyond_q": (None, ("cu_seqlens_q",)),
    "cu_beyond_k": (None, ("cu_seqlens_k",)),
    "seqused_beyond": (None, ("seqused_k",)),
    "seqused_negative": (None, ("seqused_k",)),
    "max_q_low": (None, ("max_seqlen_q",)),
    "max_k_low": (Expect.EITHER, ("max_seqlen_k",)),
    "gqa_ratio": (Expect.REFUSE, ("head",)),
    "k_dtype": (Expect.REFUSE, ("dtype",)),
    "scale": (Expect.REFUSE, ("scale",)),
}
INDEX_MISTAKES = {"cu_beyond_q", "cu_beyond_k", "seqused_beyond", "seqused_negative"}


@dataclass(frozen=True)
class PackedCase:
    """One drawn call: structure only (tensors come from `seed`)."""

    api: str = "flash_attn_varlen_func"  # or "module": the flavor's attention_varlen()
    flavor: Flavor = FLAVORS[0]
    heads: tuple[int, int] = (4, 2)
    lengths_q: tuple[int, ...] = (5, 17)
    lengths_k: tuple[int, ...] = (9, 3)
    same: bool = False  # one cu_seqlens tensor for q and k (every sequence has Nq == Nk)
    spare_k: tuple[int, ...] = ()  # unused key rows after each sequence's (seqused_k); () = 0
    use_seqused: bool = False
    pad: int = 3  # NaN rows after the packed sequences
    mistake: str = "none"
    bad: int = 0  # the sequence an index mistake hits
    slack_q: int = 0  # max_seqlen_q beyond the longest query sequence
    slack_k: int = 0
    layout: Layout = Layout.plain(3)
    checked: bool = False  # ATTNGEN_CHECKS=1
    fallback: bool = False
    seed: int = 0


@st.composite
def packed_cases(draw, flavors=FLAVORS, lengths=LENGTHS, heads=HEADS):
    flavor = draw(st.sampled_from(flavors))
    mistake = draw(draw_mistake(MISTAKES))
    api = draw(st.sampled_from(("flash_attn_varlen_func", "module")))
    if mistake.startswith("seqused"):
        api = "module"  # flash-attn 2.x's varlen function takes no seqused_k
    if api == "module" and flavor.module is None:
        api, mistake = (
            "flash_attn_varlen_func",
            "none" if mistake.startswith("seqused") else (mistake),
        )
    batch = draw(st.sampled_from((1, 2, 3, 3, 0)))
    if mistake in INDEX_MISTAKES | {"max_q_low", "cu_shape"}:
        batch = max(batch, 1)
    lengths_q = tuple(draw(st.sampled_from(lengths)) for _ in range(batch))
    if mistake == "max_q_low" and max(lengths_q) == 0:
        lengths_q = (lengths[-1],) + lengths_q[1:]
    use_seqused = api == "module" and (draw(st.booleans()) or mistake.startswith("seqused"))
    same = not use_seqused and draw(st.booleans())
    lengths_k = lengths_q if same else tuple(draw(st.sampled_from(lengths)) for _ in range(batch))
    spare_k = tuple(draw(st.sampled_from((0, 3))) if use_seqused else 0 for _ in range(batch))
    order = draw(st.sampled_from(((0, 1, 2), (0, 1, 2), (1, 0, 2))))
    layout = Layout(order, draw(st.sampled_from((0, 0, 5))), 1)
    return PackedCase(
        api=api,
        flavor=flavor,
        heads=(4, 3) if mistake == "gqa_ratio" else draw(st.sampled_from(heads)),
        lengths_q=lengths_q,
        lengths_k=lengths_k,
        same=same,
        spare_k=spare_k,
        use_seqused=use_seqused,
        pad=draw(st.sampled_from((0, 3))),
        mistake=mistake,
        bad=draw(st.integers(0, max(batch - 1, 0))),
        slack_q=draw(st.sampled_from((0, 0, 3))),
        slack_k=draw(st.sampled_from((0, 0, 5))),
        layout=layout,
        checked=mistake in INDEX_MISTAKES | {"max_q_low"} and draw(st.booleans()),
        fallback=api != "module" and draw(st.integers(0, 4)) == 0,
        seed=draw(st.integers(0, 2**16)),
    )


def cumulative(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass
class Packed:
    """The call's arguments as values, and what each sequence b should get."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: list[int]
    cu_k: list[int]
    seqused: list[int] | None
    slopes: torch.Tensor | None
    max_q: int
    max_k: int


def make_packed(case: PackedCase, device="cpu") -> Packed:
    gen = torch.Generator().manual_seed(case.seed)
    flavor = case.flavor
    dtype = DTYPES[flavor.dtype]
    hq, hkv = case.heads
    spare = case.spare_k or (0,) * len(case.lengths_k)
    spans = [n + s for n, s in zip(case.lengths_k, spare, strict=True)]
    cu_q, cu_k = cumulative(case.lengths_q), cumulative(spans)

    def packed(rows, heads, dtype=dtype):
        t = torch.randn(rows + case.pad, heads, flavor.head_dim, generator=gen).to(dtype)
        t[rows:] = float("nan")
        return t

    q, k = packed(cu_q[-1], hq), packed(cu_k[-1], hkv)
    v = packed(cu_k[-1], hkv)
    for b, n in enumerate(case.lengths_k):  # keys past seqused_k are a cache's unused tail
        k[cu_k[b] + n : cu_k[b + 1]] = float("nan")
        v[cu_k[b] + n : cu_k[b + 1]] = float("nan")
    if case.mistake == "k_dtype":
        k = k.to(torch.float32 if dtype != torch.float32 else torch.float16)
    seqused = list(case.lengths_k) if case.use_seqused else None
    if not case.use_seqused:
        cu_k = cumulative(case.lengths_k)
    b, mistake = case.bad, case.mistake
    if mistake == "cu_beyond_q":
        cu_q[-1] = q.shape[0] + 2
    elif mistake == "cu_beyond_k":
        cu_k[-1] = k.shape[0] + 2
    elif mistake == "seqused_beyond":
        seqused[b] = cu_k[b + 1] - cu_k[b] + 2
    elif mistake == "seqused_negative":
        seqused[b] = -3
    slopes = None
    if flavor.alibi:
        slopes = 2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)
    max_q = max(case.lengths_q, default=0) + case.slack_q
    max_k = max(case.lengths_k, default=0) + case.slack_k
    if mistake == "max_q_low":
        max_q = max(case.lengths_q) - 1
    elif mistake == "max_k_low":
        max_k = max(max(case.lengths_k, default=0) // 2, 0)
    return Packed(
        q.to(device),
        k.to(device),
        v.to(device),
        cu_q,
        cu_k,
        seqused,
        None if slopes is None else slopes.to(device),
        max_q,
        max_k,
    )


def sequence_verdicts(p: Packed) -> list[str]:
    """Per sequence: "good" (must match the reference), "bad" (its indices leave the
    tensors or its span: NaN, or a refused call), "short" (more queries than max_seqlen_q:
    NaN or correct)."""
    verdicts = []
    total_q, total_k = p.q.shape[0], p.k.shape[0]
    for b in range(len(p.cu_q) - 1):
        q0, q1, k0, k1 = p.cu_q[b], p.cu_q[b + 1], p.cu_k[b], p.cu_k[b + 1]
        used = k1 - k0 if p.seqused is None else p.seqused[b]
        bad = (
            not 0 <= q0 <= q1 <= total_q or not 0 <= k0 <= k1 <= total_k or not 0 <= used <= k1 - k0
        )
        verdicts.append("bad" if bad else "short" if q1 - q0 > p.max_q else "good")
    return verdicts


def sequence_problems(case: PackedCase, p: Packed, out, lse) -> list[str]:
    """Per sequence by its verdict (CPU tensors: out and lse as returned)."""
    sem = flash_semantics(
        case.flavor.causal, case.flavor.window_size, case.flavor.softcap, case.flavor.alibi
    )
    problems = []
    total_q = p.q.shape[0]
    covered = torch.zeros(total_q, dtype=torch.bool)
    for b, verdict in enumerate(sequence_verdicts(p)):
        q0, q1 = max(p.cu_q[b], 0), min(max(p.cu_q[b + 1], 0), total_q)
        covered[q0:q1] = True
        rows = slice(q0, q1)
        nan = out[rows].isnan().all() and (lse is None or lse[:, rows].isnan().all())
        if verdict == "bad":
            if not nan:
                problems.append(
                    f"sequence {b}: its indices leave the tensors, but its output is not NaN"
                )
            continue
        k0 = p.cu_k[b]
        k1 = k0 + (p.cu_k[b + 1] - k0 if p.seqused is None else p.seqused[b])

        def heads_first(t):
            return t.transpose(0, 1)[None]

        found = reference_problems(
            sem,
            heads_first(out[rows]),
            None if lse is None else lse[:, rows][None],
            heads_first(p.q[rows].cpu()),
            heads_first(p.k[k0:k1].cpu()),
            heads_first(p.v[k0:k1].cpu()),
            scale=None,
            slopes=p.slopes,
        )
        if found and not (verdict == "short" and nan):
            problems += [f"sequence {b} ({verdict}): {x}" for x in found]
    rest = ~covered
    if rest.any() and not (
        torch.all(out[rest] == 0) and (lse is None or torch.all(lse[:, rest] == float("-inf")))
    ):
        problems.append("rows no sequence covers are not 0 / -inf")
    return problems


def expectation(case: PackedCase, p: Packed, specs: list[dict]) -> tuple[Expect, tuple[str, ...]]:
    expect, names = MISTAKES[case.mistake]
    flavor = case.flavor
    sem = flash_semantics(flavor.causal, flavor.window_size, flavor.softcap, flavor.alibi)
    same = case.same and case.mistake != "cu_beyond_k"
    # the dispatcher reads the lengths from max_seqlen_* (the device's cu_seqlens stay unread)
    longest_q = max(p.max_q, max(case.lengths_q, default=0))
    longest_k = max(p.max_k, max(case.lengths_k, default=0))
    can_run = (
        case.api == "module"
        or case.fallback
        or served(
            specs, "varlen", DTYPES[flavor.dtype], flavor.head_dim, sem, longest_q, longest_k, same
        )
    )
    if case.mistake == "max_k_low" and case.api == "module":
        expect = Expect.SERVE  # the module documents max_seqlen_k as unused
    if expect is None:
        verdicts = sequence_verdicts(p)
        bad = "bad" in verdicts
        if case.checked and (bad or "short" in verdicts):
            expect = Expect.REFUSE  # the checked mode validates index tensors on the host
        else:
            expect = Expect.SERVE if can_run and not bad else Expect.EITHER
    return expect, names if can_run else ()


def check_packed(kernels, case: PackedCase, device: str = "cpu") -> None:
    p = make_packed(case, device)
    hq = case.heads[0]
    strided = Layout((0,), 0, 2)
    index_layout = strided if case.mistake == "cu_strided" else None
    cu_dtype = torch.int64 if case.mistake == "cu_int64" else torch.int32
    cu_k_values = p.cu_k + [p.cu_k[-1]] if case.mistake == "cu_shape" else p.cu_k
    guards = {
        "q": guarded(p.q, case.layout),
        "k": guarded(p.k, case.layout),
        "v": guarded(p.v, case.layout),
        "cu_seqlens_q": guarded(torch.tensor(p.cu_q, dtype=cu_dtype, device=device), index_layout),
    }
    same = case.same and case.mistake not in ("cu_beyond_k", "cu_shape")
    guards["cu_seqlens_k"] = (
        guards["cu_seqlens_q"]
        if same
        else guarded(torch.tensor(cu_k_values, dtype=cu_dtype, device=device), index_layout)
    )
    if p.seqused is not None:
        guards["seqused_k"] = guarded(
            torch.tensor(p.seqused, dtype=torch.int32, device=device),
            strided if case.mistake == "seqused_strided" else None,
        )
    if p.slopes is not None:
        guards["alibi_slopes"] = guarded(
            p.slopes, strided if case.mistake == "slopes_strided" else None
        )
    expect, names = expectation(case, p, kernels.specs)
    scale = -1.0 if case.mistake == "scale" else None
    args = {name: g.view for name, g in guards.items()}
    with kernels.checked(case.checked) as active:
        result, _ = attempt(lambda: call_packed(active, case, args, p, scale, hq), expect, names)
    problems = [x for name, g in guards.items() for x in unexpected_writes(name, g)]
    if result is not None:
        out, lse = result
        assert out.shape == (p.q.shape[0], hq, case.flavor.head_dim), out.shape
        problems += sequence_problems(case, p, out.cpu(), lse.cpu())
    assert not problems, "; ".join(problems)


def call_packed(kernels, case: PackedCase, args, p: Packed, scale, hq):
    seqused = args.get("seqused_k")
    if case.api == "module":
        module = kernels.module_for(case.flavor.module, "varlen")
        return module.attention_varlen(
            args["q"],
            args["k"],
            args["v"],
            args["cu_seqlens_q"],
            args["cu_seqlens_k"],
            p.max_q,
            p.max_k,
            sm_scale=scale,
            alibi_slopes=args.get("alibi_slopes"),
            return_lse=True,
            seqused_k=seqused,
        )
    flavor = case.flavor

    def fn():
        out, lse, _ = attngen.flash_attn_varlen_func(
            args["q"],
            args["k"],
            args["v"],
            args["cu_seqlens_q"],
            args["cu_seqlens_k"],
            p.max_q,
            p.max_k,
            softmax_scale=scale,
            causal=flavor.causal,
            window_size=flavor.window_size,
            softcap=flavor.softcap,
            alibi_slopes=args.get("alibi_slopes"),
            return_attn_probs=True,
        )
        return out, lse

    if not case.fallback:
        return fn()
    with kernels.fallback_only(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn()


CAUSAL, ALIBI, RIGHT, LEFT, WINDOW, VARLEN_H32, CAUSAL_SHORT = FLAVORS


@settings(max_examples=20)
@given(packed_cases())
# found: ALiBi without a mask used |i - j| when Nq != Nk
@example(PackedCase(flavor=ALIBI, lengths_q=(2, 1, 2), lengths_k=(33, 1, 1)))
# found: window sides of 2**31 - 1 overflowed int32: wrong results, and a crash
@example(PackedCase(flavor=RIGHT, lengths_q=(16, 15), lengths_k=(16, 16)))
@example(PackedCase(flavor=LEFT, lengths_q=(33, 2), lengths_k=(1, 15)))
@example(
    PackedCase(
        api="module",
        flavor=LEFT,
        heads=(2, 2),
        lengths_q=(15, 1, 33),
        lengths_k=(16, 17, 5),
        spare_k=(3, 0, 0),
        use_seqused=True,
        layout=Layout((1, 0, 2)),
    )
)
# found: strided cu_seqlens, seqused_k and alibi_slopes were read with stride 1 (a crash,
# wrong lengths, wrong slopes)
@example(PackedCase(flavor=ALIBI, lengths_q=(0, 1), lengths_k=(33, 2), mistake="cu_strided"))
@example(
    PackedCase(
        api="module",
        heads=(4, 1),
        lengths_q=(15, 33, 16),
        lengths_k=(16, 16, 16),
        spare_k=(0, 3, 0),
        use_seqused=True,
        mistake="seqused_strided",
    )
)
@example(
    PackedCase(
        flavor=ALIBI, lengths_q=(5, 9), lengths_k=(5, 9), same=True, mistake="slopes_strided"
    )
)
# found: cu_seqlens past the packed length aborted the process or read other memory;
# seqused_k past a sequence's span read the next one's keys; the checked mode let them pass
@example(
    PackedCase(api="module", lengths_q=(0, 33, 0), lengths_k=(17, 0, 0), mistake="cu_beyond_q")
)
@example(PackedCase(mistake="cu_beyond_k", bad=1))
@example(
    PackedCase(
        api="module",
        flavor=VARLEN_H32,
        heads=(4, 4),
        lengths_q=(17, 2, 2),
        lengths_k=(33, 17, 2),
        spare_k=(0, 3, 0),
        use_seqused=True,
        mistake="seqused_beyond",
    )
)
@example(
    PackedCase(
        api="module",
        lengths_q=(17,),
        lengths_k=(0,),
        spare_k=(3,),
        use_seqused=True,
        mistake="seqused_negative",
        checked=True,
    )
)
@example(
    PackedCase(
        flavor=CAUSAL_SHORT,
        lengths_q=(5,),
        lengths_k=(5,),
        same=True,
        mistake="cu_beyond_q",
        checked=True,
        fallback=True,
    )
)
# found: max_seqlen_k below the true length let a window kernel serve a causal call
@example(PackedCase(flavor=CAUSAL_SHORT, lengths_q=(1,), lengths_k=(9,), mistake="max_k_low"))
# found: max_seqlen_q below a sequence's length left its last rows 0 (no error)
@example(
    PackedCase(
        api="module", flavor=WINDOW, lengths_q=(17, 1), lengths_k=(15, 3), mistake="max_q_low"
    )
)
# max_seqlen_q below a length: NaN from the kernel and from the fallback; checked mode raises
@example(PackedCase(lengths_q=(33, 2), lengths_k=(5, 9), mistake="max_q_low"))
@example(PackedCase(lengths_q=(33, 2), lengths_k=(5, 9), mistake="max_q_low", fallback=True))
@example(PackedCase(lengths_q=(33, 2), lengths_k=(5, 9), mistake="max_q_low", checked=True))
@example(
    PackedCase(
        lengths_q=(33, 2), lengths_k=(5, 9), mistake="max_q_low", checked=True, fallback=True
    )
)
def test_packed_sequences(api_kernels, case):  # noqa: F811
    isolated(check_packed, api_kernels, case)


@pytest.mark.slow
@settings(max_examples=300)
@given(packed_cases())
def test_packed_sequences_more(api_kernels, case):  # noqa: F811
    """test_packed_sequences with many more examples (`pytest -m slow`)."""
    isolated(check_packed, api_kernels, case)
