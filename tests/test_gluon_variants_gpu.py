"""The Gluon forward's variants (windows, sink tokens, chunks, softcap, ALiBi, sinks, head_dim !=
head_dim_v) on the H200:
`pytest -m gpu tests/test_gluon_variants_gpu.py`.

They are built only with ATTNGEN_GLUON_VARIANTS=1 until these pass (GLUON_UNVERIFIED in
attngen/tiling/gluon.py), so every module here is rendered with it set. Each case runs through
the module's attention() with the Gluon kernel on every launch, against the float64 reference
(RELIABILITY.md's criterion, attngen.reference), and forward_path() must name the Gluon
kernel; a second call (from the call plan where the module keeps them) must be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from attngen.reference import visible_mask
from attngen.spec import KernelKind
from attngen.spec.files import VARIANTS_ENV
from attngen.tiling.gluon import gluon_gap
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

_WIN = "sliding_window"
# (id, spec fields, (B, Nq, Nk))
CASES = [
    # gpt-oss's local layers: window 128 (127, 0) bottom-right with sinks, GQA 8:1
    (
        "gptoss-local",
        dict(
            dtype="bf16",
            head_dim=64,
            mask=_WIN,
            window_left=127,
            window_right=0,
            sinks=True,
            num_q_heads=8,
            num_kv_heads=1,
        ),
        (2, 1000, 1000),
    ),
    (
        "gptoss-local-prefix",
        dict(
            dtype="bf16",
            head_dim=64,
            mask=_WIN,
            window_left=127,
            window_right=0,
            sinks=True,
            num_q_heads=8,
            num_kv_heads=1,
        ),
        (1, 300, 1000),
    ),
    (
        "win-top-left",
        dict(
            dtype="fp16",
            head_dim=128,
            mask=_WIN,
            window_left=200,
            window_right=0,
            causal_align="top_left",
        ),
        (1, 1000, 300),
    ),
    (
        "win-both-sides",
        dict(dtype="bf16", head_dim=128, mask=_WIN, window_left=64, window_right=64),
        (2, 700, 700),
    ),
    (
        "win-right-only",
        dict(
            dtype="bf16",
            head_dim=64,
            mask=_WIN,
            window_left=0,
            window_right=200,
            causal_align="top_left",
        ),
        (1, 500, 800),
    ),
    (
        "win-infinite-left",
        dict(dtype="fp16", head_dim=64, mask=_WIN, window_left=2**31 - 1, window_right=3),
        (1, 600, 600),
    ),
    (
        "mistral-4095",
        dict(
            dtype="bf16",
            head_dim=128,
            mask=_WIN,
            window_left=4095,
            window_right=0,
            num_q_heads=8,
            num_kv_heads=2,
        ),
        (1, 5000, 5000),
    ),
    (
        "win-d256",
        dict(dtype="bf16", head_dim=256, mask=_WIN, window_left=300, window_right=0),
        (1, 1000, 1000),
    ),
    ("gemma2-global", dict(dtype="bf16", head_dim=256, mask="causal", softcap=50.0), (2, 700, 700)),
    (
        "gemma2-local",
        dict(dtype="bf16", head_dim=256, mask=_WIN, window_left=255, window_right=0, softcap=50.0),
        (1, 1000, 1000),
    ),
    ("softcap-none", dict(dtype="fp16", head_dim=64, mask="none", softcap=30.0), (2, 300, 500)),
    (
        "softcap-d128",
        dict(dtype="bf16", head_dim=128, mask="causal", softcap=5.0, causal_align="top_left"),
        (1, 1000, 1100),
    ),
    ("alibi-none", dict(dtype="fp16", head_dim=128, mask="none", alibi=True), (2, 300, 500)),
    (
        "alibi-causal",
        dict(dtype="bf16", head_dim=64, mask="causal", alibi=True, causal_align="top_left"),
        (1, 1000, 700),
    ),
    ("alibi-d256", dict(dtype="bf16", head_dim=256, mask="causal", alibi=True), (1, 500, 500)),
    (
        "alibi-window-softcap",
        dict(
            dtype="bf16",
            head_dim=128,
            mask=_WIN,
            window_left=100,
            window_right=20,
            alibi=True,
            softcap=20.0,
        ),
        (1, 600, 600),
    ),
    (
        "sinks-causal",
        dict(dtype="bf16", head_dim=64, mask="causal", sinks=True, num_q_heads=8, num_kv_heads=1),
        (2, 1000, 1000),
    ),
    # bottom-right, Nq > Nk: the first 200 rows see no key (O 0, LSE the sink)
    (
        "sinks-rows-unseen",
        dict(dtype="fp16", head_dim=128, mask="causal", sinks=True),
        (1, 300, 100),
    ),
    ("sinks-none-d256", dict(dtype="bf16", head_dim=256, mask="none", sinks=True), (1, 400, 400)),
    # Llama 4's chunked layers (chunk 8192 there; 256 puts several chunks in a sequence)
    (
        "chunked-gqa",
        dict(
            dtype="bf16",
            head_dim=128,
            mask="chunked",
            chunk_size=256,
            num_q_heads=8,
            num_kv_heads=1,
        ),
        (2, 1000, 1000),
    ),
    (
        "chunked-odd-top-left",
        dict(dtype="fp16", head_dim=64, mask="chunked", chunk_size=100, causal_align="top_left"),
        (1, 700, 300),
    ),
    (
        "chunked-prefix-d256",
        dict(dtype="bf16", head_dim=256, mask="chunked", chunk_size=64),
        (1, 300, 1000),
    ),
    ("chunked-small", dict(dtype="bf16", head_dim=64, mask="chunked", chunk_size=3), (1, 200, 200)),
    # StreamingLLM: 4 sink tokens beside a 128 window; sinks far from, next to and inside it
    (
        "sink-tokens",
        dict(
            dtype="bf16",
            head_dim=64,
            mask=_WIN,
            window_left=127,
            window_right=0,
            sink_tokens=4,
            num_q_heads=8,
            num_kv_heads=2,
        ),
        (2, 1000, 1000),
    ),
    (
        "sink-tokens-wide-top-left",
        dict(
            dtype="fp16",
            head_dim=128,
            mask=_WIN,
            window_left=300,
            window_right=0,
            sink_tokens=130,
            causal_align="top_left",
        ),
        (1, 700, 900),
    ),
    (
        "sink-tokens-both-sides",
        dict(
            dtype="bf16", head_dim=128, mask=_WIN, window_left=64, window_right=64, sink_tokens=64
        ),
        (1, 500, 500),
    ),
    (
        "sink-tokens-d256-learned-sinks",
        dict(
            dtype="bf16",
            head_dim=256,
            mask=_WIN,
            window_left=200,
            window_right=0,
            sink_tokens=1,
            sinks=True,
        ),
        (1, 600, 600),
    ),
    # head_dim != head_dim_v: O out through tiles of its own (Q's slot is [BLOCK_M, D])
    ("dv64-d128-causal", dict(dtype="bf16", head_dim=128, head_dim_v=64), (2, 700, 700)),
    ("dv128-d64-none", dict(dtype="fp16", head_dim=64, head_dim_v=128, mask="none"), (1, 300, 900)),
    (
        "dv256-d128-gqa-window",
        dict(
            dtype="bf16",
            head_dim=128,
            head_dim_v=256,
            mask=_WIN,
            window_left=100,
            window_right=0,
            num_q_heads=8,
            num_kv_heads=2,
        ),
        (1, 640, 640),
    ),  # fmt: skip
]


def variant_module(spec, monkeypatch):
    """The spec's module built with the unverified variants, the Gluon kernel on every launch
    (small launches otherwise take the tile-level kernel for host time)."""
    monkeypatch.setenv(VARIANTS_ENV, "1")
    assert gluon_gap(spec, "sm90", KernelKind.prefill) == ""
    module = load_kernel.__wrapped__(spec)  # not the cache: the same spec renders without it
    module.POINTER_LOADS_UP_TO = 0
    return module


def _sinks(spec, device="cuda"):
    if not spec.sinks:
        return None
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(spec.num_q_heads, generator=gen) * 2.0).to(device)


@pytest.mark.parametrize("name, fields, shape", CASES, ids=[case[0] for case in CASES])
def test_the_variant_matches_the_float64_reference(name, fields, shape, monkeypatch):
    spec = make_spec(**fields)
    module = variant_module(spec, monkeypatch)
    b, nq, nk = shape
    q, k, v, slopes = make_inputs(spec, b, nq, nk, seed=51, device="cuda")
    sinks = _sinks(spec)
    extra = {"sinks": sinks} if spec.sinks else {}
    out, lse = module.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **extra)
    assert module.forward_path() == module.GLUON_PATH
    cpu = [t.cpu() for t in (out, lse, q, k, v)]
    assert_matches_reference(
        spec,
        *cpu,
        slopes=None if slopes is None else slopes.cpu(),
        sinks=None if sinks is None else sinks.cpu(),
    )
    again = module.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **extra)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse), "not bitwise repeatable"


def test_alibi_per_batch_slopes(monkeypatch):
    """[B, HQ] slopes (a row stride of its own) through the Gluon kernel."""
    spec = make_spec(dtype="bf16", head_dim=128, mask="causal", alibi=True)
    module = variant_module(spec, monkeypatch)
    q, k, v, slopes = make_inputs(spec, 2, 400, 400, seed=52, device="cuda")
    per_batch = torch.stack([slopes, slopes.flip(0) * 0.5])
    out, lse = module.attention(q, k, v, alibi_slopes=per_batch, return_lse=True)
    assert module.forward_path() == module.GLUON_PATH
    for b in range(2):
        assert_matches_reference(
            spec,
            out[b : b + 1].cpu(),
            lse[b : b + 1].cpu(),
            q[b : b + 1].cpu(),
            k[b : b + 1].cpu(),
            v[b : b + 1].cpu(),
            slopes=per_batch[b].cpu(),
        )


_CHUNKS = dict(mask="chunked", chunk_size=200)


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize(
    "fields",
    [
        dict(mask=_WIN, window_left=100, window_right=30),
        _CHUNKS,
        dict(mask=_WIN, window_left=100, window_right=30, sink_tokens=70),
    ],
    ids=["window", "chunks", "sink-tokens"],
)
def test_nan_and_inf_in_keys_outside_every_window_leave_the_output_bitwise(
    align, fields, monkeypatch
):
    """Keys left of every row's window or chunk (the first block's head) and right of it (the
    last block's tail): K NaN and V inf there must not reach the output (V's rows zeroed)."""
    spec = make_spec(dtype="bf16", head_dim=64, causal_align=align, **fields)
    module = variant_module(spec, monkeypatch)
    nq, nk = 300, 700
    q, k, v, _ = make_inputs(spec, 1, nq, nk, seed=53, device="cuda")
    clean = module.attention(q, k, v, return_lse=True)
    unseen = ~visible_mask(spec, nq, nk, "cuda").any(dim=0)
    assert unseen.any()
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, unseen], v_bad[:, :, unseen] = float("nan"), float("inf")
    padded = module.attention(q, k_bad, v_bad, return_lse=True)
    assert module.forward_path() == module.GLUON_PATH
    assert torch.equal(clean[0], padded[0]) and torch.equal(clean[1], padded[1])
