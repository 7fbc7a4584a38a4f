"""The newer models' spec fields in every kernel kind, against the float64 reference
(attngen.reference, the rule of shared/RELIABILITY.md):

- sinks: one learned logit per query head in every row's normaliser and LSE; a row that sees
  no key (bottom-right causal with Nq > Nk, an empty cache) gives output 0 and the sink's LSE;
- mask chunked: chunk boundaries at BLOCK_N - 1, BLOCK_N, BLOCK_N + 1 (16-key tiles forced),
  both alignments with Nq != Nk;
- sink_tokens: the first k keys with a window, k inside, at and past a key tile;
- decode head dims 576/512 (multi-head latent attention's absorbed form) in fp16 and bf16 at
  small N, with the values a view of the keys' first 512 dims, as the latent cache is.

Few, small cases: the interpreter runs every program one after another.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from attngen.reference import compare_to_reference, random_sinks
from attngen.runtime.fallback import fallback_dense
from tests.decode_harness import load_decode, make_cache, make_decode_spec, make_queries
from tests.kernel_harness import load_kernel, make_inputs, make_spec

TILE = 16  # BLOCK_M = BLOCK_N forced to 16: boundaries where the cases put them


def _prefill(spec, seqlen_q, seqlen_k, *, seed, batch=1, tile=TILE, device="cpu"):
    """One prefill call at `tile` x `tile` (None: the derived tiles) on `device`, judged
    against the float64 reference on the host."""
    kernel = load_kernel(spec, tile, tile)
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=seed)
    sinks = random_sinks(q.shape[1], seed=seed) if spec.sinks else None
    extra = {"sinks": sinks.to(device)} if spec.sinks else {}
    out, lse = kernel.attention(q.to(device), k.to(device), v.to(device), return_lse=True, **extra)
    out, lse = out.cpu(), lse.cpu()
    problems = compare_to_reference(spec, out, lse, q, k, v, sinks=sinks)
    assert not problems, "; ".join(problems)
    return out, lse, sinks


# ------------------------------------------------------------------------------- sinks


@pytest.mark.parametrize(
    ("mask", "dtype", "seqlen_q", "seqlen_k"),
    [
        ("causal", "fp16", 40, 17),  # Nq > Nk bottom-right: 23 rows see no key
        ("causal", "fp32", 33, 33),
        ("sliding_window", "fp16", 37, 50),
        ("none", "fp16", 5, 31),
    ],
)
def test_sinks_join_the_normaliser_and_the_lse(mask, dtype, seqlen_q, seqlen_k):
    fields = {"window_left": 6} if mask == "sliding_window" else {}
    spec = make_spec(mask=mask, dtype=dtype, head_dim=32, sinks=True, **fields)
    out, lse, sinks = _prefill(spec, seqlen_q, seqlen_k, seed=3)
    if seqlen_q > seqlen_k and mask == "causal":
        unseen = seqlen_q - seqlen_k
        assert torch.all(out[:, :, :unseen] == 0)
        # a row that sees no key: its LSE is the sink's (logaddexp(-inf, s) = s), up to the
        # kernel's log2 domain: s * log2(e), then / log2(e) in fp32, an ulp or two of |s| < 4.
        expected = sinks[None, :, None].expand(1, -1, unseen)
        torch.testing.assert_close(lse[:, :, :unseen], expected, rtol=0, atol=1e-6)


def test_sinks_are_required_and_checked():
    spec = make_spec(head_dim=32, sinks=True)
    kernel = load_kernel(spec, TILE, TILE)
    q, k, v, _ = make_inputs(spec, 1, 8, 8, seed=0)
    with pytest.raises(ValueError, match="sinks: this kernel was built with sinks: true"):
        kernel.attention(q, k, v)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\) float32"):
        kernel.attention(q, k, v, sinks=torch.zeros(3))


@pytest.mark.parametrize(
    "sinks", [torch.zeros(3), torch.zeros(4, dtype=torch.float16), torch.zeros(4, 2)[:, 0]]
)
def test_the_fallback_checks_sinks_as_a_module_does(sinks):
    """The torch fallback (its entry checks) refuses a sinks tensor with the module's message."""
    spec = make_spec(head_dim=32, sinks=True)
    kernel = load_kernel(spec, TILE, TILE)
    q, k, v, _ = make_inputs(spec, 1, 8, 8, seed=0)
    with pytest.raises(ValueError) as module_says:
        kernel.attention(q, k, v, sinks=sinks)
    with pytest.raises(ValueError) as fallback_says:
        fallback_dense(q, k, v, alibi_slopes=None, sinks=sinks, return_lse=True)
    assert str(fallback_says.value) == str(module_says.value)
    assert str(module_says.value).startswith("sinks: expected")


# ------------------------------------------------------------------------------ chunks


@pytest.mark.parametrize("chunk", [TILE - 1, TILE, TILE + 1])
@pytest.mark.parametrize(
    ("align", "seqlen_q", "seqlen_k"),
    [("bottom_right", 40, 52), ("top_left", 52, 40), ("bottom_right", 49, 49)],
)
def test_chunk_boundaries_at_tile_boundaries(chunk, align, seqlen_q, seqlen_k):
    spec = make_spec(mask="chunked", chunk_size=chunk, causal_align=align, head_dim=40)
    _prefill(spec, seqlen_q, seqlen_k, seed=chunk)


def test_chunked_with_sinks_fp32():
    spec = make_spec(mask="chunked", chunk_size=8, dtype="fp32", head_dim=16, sinks=True)
    _prefill(spec, 35, 35, seed=1)


# ------------------------------------------------------------------------- sink tokens


@pytest.mark.parametrize("sink_tokens", [3, TILE, TILE + 1])
def test_sink_tokens_stay_visible_beside_the_window(sink_tokens):
    spec = make_spec(mask="sliding_window", window_left=9, sink_tokens=sink_tokens, head_dim=32)
    _prefill(spec, 50, 70, seed=sink_tokens)


# ---------------------------------------------------------------------------- Hypothesis


@st.composite
def model_case(draw):
    """Structure only: the new fields with chunk sizes, sink counts and lengths at the 16-key
    tiles' boundaries; tensors come from the seed."""
    kind = draw(st.sampled_from(["chunked", "sink_tokens", "sinks"]))
    fields: dict = dict(
        dtype=draw(st.sampled_from(["fp16", "fp32"])), head_dim=32, num_q_heads=2, num_kv_heads=1
    )
    if kind == "chunked":
        fields.update(
            mask="chunked",
            chunk_size=draw(st.sampled_from([1, 15, 16, 17, 33])),
            causal_align=draw(st.sampled_from(["top_left", "bottom_right"])),
        )
    elif kind == "sink_tokens":
        fields.update(
            mask="sliding_window",
            window_left=draw(st.sampled_from([0, 5, 16])),
            sink_tokens=draw(st.sampled_from([1, 15, 16, 17])),
        )
    else:
        fields.update(mask=draw(st.sampled_from(["causal", "none"])))
    fields["sinks"] = kind == "sinks" or draw(st.booleans())
    lengths = st.sampled_from([1, TILE - 1, TILE, TILE + 1, 2 * TILE + 1, 37])
    return fields, draw(lengths), draw(lengths), draw(st.integers(0, 2**16))


# A fifth of the profile's examples: each new spec renders a module for the interpreter.
@settings(max_examples=max(4, settings().max_examples // 5))
@given(model_case())
@example(
    (
        dict(
            dtype="fp16",
            head_dim=32,
            num_q_heads=2,
            num_kv_heads=1,
            mask="chunked",
            chunk_size=1,
            causal_align="bottom_right",
            sinks=True,
        ),
        17,
        1,
        0,
    )
)
def test_new_fields_match_the_reference(params):
    fields, seqlen_q, seqlen_k, seed = params
    _prefill(make_spec(**fields), seqlen_q, seqlen_k, seed=seed)


# ------------------------------------------------------------------------------ varlen


@pytest.mark.parametrize(
    "fields",
    [
        dict(mask="chunked", chunk_size=TILE + 1, sinks=True),
        dict(mask="sliding_window", window_left=5, sink_tokens=TILE),
    ],
)
def test_varlen_sequences_with_the_new_fields(fields):
    _varlen(make_spec(kernels=["varlen"], head_dim=32, **fields))


def _varlen(spec, tile=TILE, device="cpu"):
    """Four packed sequences (an empty one, Nq < Nk, Nq = Nk across tiles) on `device`."""
    kernel = load_kernel(spec, tile, tile, kind="varlen")
    lengths = [(0, 0), (33, 33), (7, 40), (18, 18)]
    seqs = [make_inputs(spec, 1, nq, nk, seed=i) for i, (nq, nk) in enumerate(lengths)]
    packed = [torch.cat([s[j][0].transpose(0, 1) for s in seqs]) for j in range(3)]
    cu_q = torch.tensor(
        [0] + [sum(n for n, _ in lengths[: i + 1]) for i in range(4)], dtype=torch.int32
    )
    cu_k = torch.tensor(
        [0] + [sum(n for _, n in lengths[: i + 1]) for i in range(4)], dtype=torch.int32
    )
    sinks = random_sinks(spec.num_q_heads, seed=5) if spec.sinks else None
    extra = {"sinks": sinks.to(device)} if spec.sinks else {}
    out, lse = kernel.attention_varlen(
        *(t.to(device) for t in packed),
        cu_q.to(device),
        cu_k.to(device),
        40,
        40,
        return_lse=True,
        **extra,
    )
    out, lse = out.cpu(), lse.cpu()
    for b, (q, k, v, _) in enumerate(seqs):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        got = out[rows].transpose(0, 1)[None]
        problems = compare_to_reference(spec, got, lse[:, rows][None], q, k, v, sinks=sinks)
        assert not problems, f"sequence {b}: " + "; ".join(problems)


# ------------------------------------------------------------------------------ decode


def _decode(
    spec,
    lengths,
    *,
    seed,
    num_q_tokens=1,
    latent_values=False,
    splits=None,
    block_n=TILE,
    device="cpu",
):
    """One decode step against a cache holding `lengths` on `device`, judged per sequence;
    `splits` forces the split count (the combine kernel then adds the sinks); block_n None:
    the derived key tile."""
    kernel = load_decode(spec, block_n=block_n if spec.head_dim <= 256 else None)
    kernel.FORCE_NUM_SPLITS = splits
    cache = make_cache(spec, lengths, seed=seed)
    on_device = cache.to(device)
    q, _, _, _ = make_queries(spec, len(lengths), num_q_tokens, seed=seed)
    sinks = random_sinks(spec.num_q_heads, seed=seed) if spec.sinks else None
    extra = {"sinks": sinks.to(device)} if spec.sinks else {}
    k_cache, v_cache, dense_v = on_device.k, on_device.v, cache.dense_v
    if latent_values:  # the absorbed form: the values are the keys' first DV dims
        v_cache = k_cache[..., : spec.value_head_dim]
        dense_v = [k[..., : spec.value_head_dim] for k in cache.dense_k]
    try:
        out, lse = kernel.decode(
            q.to(device),
            k_cache,
            v_cache,
            on_device.lengths,
            block_table=on_device.block_table,
            return_lse=True,
            **extra,
        )
    finally:
        kernel.FORCE_NUM_SPLITS = None
    out, lse = out.cpu(), lse.cpu()
    for b in range(len(lengths)):
        problems = compare_to_reference(
            spec,
            out[b : b + 1],
            lse[b : b + 1],
            q[b : b + 1],
            cache.dense_k[b][None],
            dense_v[b][None],
            sinks=sinks,
        )
        assert not problems, f"sequence {b}: " + "; ".join(problems)
    return out, lse, sinks


@pytest.mark.parametrize(("layout", "splits"), [("contiguous", None), ("paged", 3)])
def test_decode_sinks_and_an_empty_cache(layout, splits):
    spec = make_decode_spec(
        layout, 16 if layout == "paged" else None, head_dim=32, sinks=True, max_query_tokens=2
    )
    out, lse, sinks = _decode(spec, [0, 37, 5], seed=2, num_q_tokens=2, splits=splits)
    assert torch.all(out[0] == 0)
    # The empty cache's rows see only the sink: LSE = s after the log2 round trip (an ulp or
    # two of |s| < 4 in fp32).
    torch.testing.assert_close(lse[0], sinks[:, None].expand(-1, 2), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("layout", "chunk"), [("contiguous", TILE - 1), ("paged", TILE + 1)])
def test_decode_chunked(layout, chunk):
    spec = make_decode_spec(
        layout,
        16 if layout == "paged" else None,
        head_dim=32,
        mask="chunked",
        chunk_size=chunk,
        max_query_tokens=4,
    )
    _decode(spec, [1, chunk, chunk + 1, 3 * chunk + 5], seed=chunk, num_q_tokens=4, splits=2)


def test_decode_sink_tokens():
    spec = make_decode_spec(
        "paged", 16, head_dim=32, mask="sliding_window", window_left=7, sink_tokens=4
    )
    _decode(spec, [2, 30, 61], seed=4)
    _decode(spec, [2, 30, 61], seed=4, splits=2)  # the sinks' block in split 0, the window's


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_decode_latent_attention_dims(dtype):
    """MLA's absorbed decode: 576 / 512, one KV head, 16 query heads, 64-token pages."""
    spec = make_decode_spec(
        "paged",
        64,
        dtype=dtype,
        head_dim=576,
        head_dim_v=512,
        num_q_heads=16,
        num_kv_heads=1,
        kernels=["decode"],
    )
    _decode(spec, [70, 9], seed=6, latent_values=True)
