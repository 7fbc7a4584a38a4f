"""The draws of the dense-call property tests (tests/test_api_dense.py): which calls (`Call`,
`calls`: dtypes, head dims, GQA ratios, lengths, softcap, ALiBi, scales, q magnitudes, memory
layouts, and the mistakes a caller makes), the tensors they pass and what each may do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from tests.api_harness import INT32_MAX, Expect, draw_mistake
from tests.api_memory import Layout, guarded

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
LENGTHS = (0, 1, 2, 3, 4, 5, 15, 16, 17, 31, 33)
HEADS = ((4, 2), (4, 4), (4, 1), (2, 2), (1, 1))
FLASH_WINDOWS = (
    (-1, -1),
    (-1, -1),
    (3, -1),
    (-1, 3),
    (3, 0),
    (0, 0),
    (5, 7),
    (INT32_MAX, -1),
    (-1, INT32_MAX),
    (INT32_MAX - 1, 0),
    (2**31, 0),
)
SDPA_WINDOWS = (None, None, (3, 0), (3, INT32_MAX), (INT32_MAX, 3), (INT32_MAX, INT32_MAX), (0, 0))
# (dtype, head dim, softcap, alibi) of calls the toy modules serve, and some they do not
FLAVORS = (
    ("fp32", 16, 0.0, False),
    ("fp32", 16, 0.0, True),
    ("fp16", 16, 5.0, False),
    ("fp16", 32, 0.0, False),
    ("fp32", 16, 5.0, False),
    ("fp16", 16, 0.0, True),
)
# mistake -> (what the call may do, what a refusal must name)
MISTAKES = {
    "none": (None, ()),
    "gqa_ratio": (Expect.REFUSE, ("head",)),
    "k_dtype": (Expect.REFUSE, ("dtype",)),
    "k_head_dim": (Expect.REFUSE, ("head dim", "head_dim")),
    "v_length": (Expect.REFUSE, ("length", "v")),
    "batch": (Expect.REFUSE, ("batch",)),
    "rank": (Expect.REFUSE, ("rank",)),
    "scale": (Expect.REFUSE, ("scale",)),
    "inner_stride": (Expect.EITHER, ("stride", "contiguous")),
    "slopes_shape": (Expect.REFUSE, ("alibi_slopes",)),
    "slopes_dtype": (Expect.EITHER, ("alibi_slopes",)),
    "slopes_strided": (Expect.EITHER, ("alibi_slopes",)),
    "slopes_2d": (Expect.EITHER, ("alibi_slopes",)),
}
SLOPE_MISTAKES = {"slopes_shape", "slopes_dtype", "slopes_strided", "slopes_2d"}
MEMORY_ORDERS = ((0, 1, 2, 3), (0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3))


PLAIN = (Layout.plain(4),) * 3


@dataclass(frozen=True)
class Call:
    """One drawn call: shapes and flags, never data (tensors come from `seed`)."""

    dtype: str = "fp32"
    head_dim: int = 16
    heads: tuple[int, int] = (4, 2)
    batch: int = 1
    seqlen_q: int = 5
    seqlen_k: int = 9
    softcap: float = 0.0
    alibi: bool = False
    mistake: str = "none"
    layouts: tuple[Layout, Layout, Layout] = PLAIN
    scale: float | None = None
    magnitude: int = 0  # q ~ N(0, 1) x (1, 100, 3e9 (fp32: scores ~1e10) or 300 (fp16))
    fallback: bool = False  # run with no module loaded and fallback "sdpa"
    return_lse: bool = True
    seed: int = 0


@st.composite
def calls(draw, mistakes=tuple(MISTAKES)) -> Call:
    dtype, head_dim, softcap, alibi = draw(st.sampled_from(FLAVORS))
    mistake = draw(draw_mistake(mistakes))
    alibi = alibi or mistake in SLOPE_MISTAKES
    heads = (4, 3) if mistake == "gqa_ratio" else draw(st.sampled_from(HEADS))
    batch = draw(st.sampled_from((1, 1, 2, 3, 0)))
    if mistake == "batch":
        batch = max(batch, 1)
    step = 2 if mistake == "inner_stride" else 1
    layouts = tuple(
        Layout(draw(st.sampled_from(MEMORY_ORDERS)), draw(st.sampled_from((0, 0, 5))), step)
        for _ in range(3)
    )
    scale = draw(st.sampled_from((None, None, 0.3, 2.0)))
    if mistake == "scale":
        scale = draw(st.sampled_from((0.0, -1.0, float("nan"), float("inf"))))
    return Call(
        dtype,
        head_dim,
        heads,
        batch,
        draw(st.sampled_from(LENGTHS)),
        draw(st.sampled_from(LENGTHS)),
        softcap,
        alibi,
        mistake,
        layouts,
        scale,
        magnitude=draw(st.sampled_from((0, 0, 0, 1, 2))),
        fallback=draw(st.integers(0, 4)) == 0,
        return_lse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def tensors(call: Call, heads_first: bool):
    """q, k, v (values, in [B, N, H, D] or [B, H, N, D]) and slopes, mistakes applied."""
    gen = torch.Generator().manual_seed(call.seed)
    dtype = DTYPES[call.dtype]
    hq, hkv = call.heads
    k_dtype = dtype
    if call.mistake == "k_dtype":
        k_dtype = torch.float16 if dtype == torch.float32 else torch.float32
    k_dim = call.head_dim + (8 if call.mistake == "k_head_dim" else 0)
    k_batch = call.batch + (call.mistake == "batch")
    v_len = call.seqlen_k + (call.mistake == "v_length")

    def randn(batch, n, h, d, dt=dtype, scale=1.0):
        shape = (batch, h, n, d) if heads_first else (batch, n, h, d)
        return (torch.randn(*shape, generator=gen) * scale).to(dt)

    magnitude = (1.0, 100.0, 3e9 if dtype == torch.float32 else 300.0)[call.magnitude]
    q = randn(call.batch, call.seqlen_q, hq, call.head_dim, scale=magnitude)
    k = randn(k_batch, call.seqlen_k, hkv, k_dim, k_dtype)
    v = randn(k_batch, v_len, hkv, call.head_dim, k_dtype)
    slopes = None
    if call.alibi:
        slopes = 2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)
        if call.mistake == "slopes_shape":
            slopes = torch.cat([slopes, slopes[:1]])
        elif call.mistake == "slopes_dtype":
            slopes = slopes.double()
        elif call.mistake == "slopes_2d":
            slopes = slopes.expand(max(call.batch, 1), hq).contiguous()
    return q, k, v, slopes


def guard_all(call: Call, q, k, v, slopes):
    guards = {
        name: guarded(t, layout)
        for name, t, layout in zip("qkv", (q, k, v), call.layouts, strict=True)
    }
    if call.mistake == "rank":
        guards["q"] = guarded(q[None])
    if slopes is not None:
        strided = call.mistake == "slopes_strided"
        guards["alibi_slopes"] = guarded(
            slopes, Layout(tuple(range(slopes.dim())), 0, 2 if strided else 1)
        )
    return guards


def expectation(call: Call, kind_served: bool) -> tuple[Expect, tuple[str, ...]]:
    """What the call may do. A refusal names the faulty argument when something serves the
    call otherwise; when nothing does, "no kernel" is as right an answer."""
    expect, names = MISTAKES[call.mistake]
    can_run = kind_served or call.fallback
    if expect is None:
        expect = Expect.SERVE if can_run else Expect.EITHER
    return expect, names if can_run else ()
