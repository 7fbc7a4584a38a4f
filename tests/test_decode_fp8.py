"""fp8 KV caches (spec `kv_dtype: fp8_e4m3`): the decode kernels read torch.float8_e4m3fn caches
and dequantize them as K = float(k_cache) * k_descale[b, h], V = float(v_cache) *
v_descale[b, h] (FA3's flash_attn_with_kvcache descales, fp32 [B, HKV]; None is 1.0); the
append kernel quantizes the step's bf16/fp16 keys: round(clamp(k / k_descale, -448, 448)).

The reference dequantizes the cache exactly as the kernel reads it (the fp8 element in float64
times the descale) and is then the float64 reference of RELIABILITY.md with its 16-bit rule
unchanged: the kernel's dot sees the same fp8 values (exact in bf16 and fp16) and applies the
descales in fp32 to the scores' scale and to the output, one rounding each, far below the
yardstick's (P rounded to the 16-bit dtype, which the kernel does too). Appends are compared
bit for bit against torch's quantization (fp32 division, clamp, round to nearest even).
Interpreter runs use tests/interpreter_bf16.py's fp8 casts (the interpreter's own are wrong).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attngen.runtime import registry as registry_module
from attngen.runtime.registry import load_kernels
from attngen.spec import KernelKind, SpecError, module_name
from tests.decode_harness import (
    decode_problems,
    expected_cache_after_append,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
)
from tests.runtime_harness import build_folder

FP8 = torch.float8_e4m3fn
DESCALES = ("none", "one", "random", "small", "zero", "mixed", "negative")


def quantize(x, descale):
    """The append's quantization in torch: x / descale in fp32, saturated, nearest even."""
    return (x.float() / descale).clamp(-448.0, 448.0).to(FP8)


def bits(t):
    return t.contiguous().view(torch.uint8)


def fp8_cache(spec, lengths, *, seed, room=0):
    """decode_harness.make_cache's cache (NaN in every slot no sequence owns) in fp8, its
    dense per-sequence keys too."""
    cache = make_cache(spec, lengths, seed=seed, room=room)
    cache.k, cache.v = cache.k.to(FP8), cache.v.to(FP8)
    cache.dense_k = [k.to(FP8) for k in cache.dense_k]
    cache.dense_v = [v.to(FP8) for v in cache.dense_v]
    return cache


def draw_descale(kind, batch, heads, seed):
    """fp32 [B, HKV] descales of a kind (None: the argument left out, 1.0)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    values = {"one": 1.0, "small": 1e-3, "zero": 0.0}
    if kind in values:
        return torch.full((batch, heads), values[kind])
    descale = torch.rand(batch, heads, generator=gen) * 2.0 + 0.01
    if kind == "mixed":  # 0 and 1e-3 beside ordinary scales
        descale.view(-1)[::3] = 0.0
        descale.view(-1)[1::3] = 1e-3
    return -descale if kind == "negative" else descale


def fp8_problems(spec, cache, out, lse, q, k_new8, v_new8, k_descale, v_descale, **kw):
    """decode_problems over the cache dequantized as the kernel reads it: float64(fp8) times
    the sequence's descales (1.0 for None)."""
    batch, heads = q.shape[0], cache.dense_k[0].shape[0] if cache.dense_k else 1
    ones = torch.ones(batch, heads)
    kd = (ones if k_descale is None else k_descale).double()
    vd = (ones if v_descale is None else v_descale).double()

    def deq(t, d):
        return t.double() * d[:, None, None]

    dense = SimpleNamespace(
        dense_k=[deq(k, kd[b]) for b, k in enumerate(cache.dense_k)],
        dense_v=[deq(v, vd[b]) for b, v in enumerate(cache.dense_v)],
    )
    k_new = v_new = None
    if k_new8 is not None:
        k_new = torch.stack([deq(k_new8[b], kd[b]) for b in range(batch)])
        v_new = torch.stack([deq(v_new8[b], vd[b]) for b in range(batch)])
    return decode_problems(spec, dense, out, lse, q, k_new, v_new, **kw)


def fp8_spec(layout="paged", page_size=4, **fields):
    fields.setdefault("dtype", "bf16")
    fields.setdefault("head_dim", 16)
    fields.setdefault("max_query_tokens", 4)
    return make_decode_spec(layout, page_size, kv_dtype="fp8_e4m3", **fields)


# ----------------------------------------------------------------------- against float64


@st.composite
def fp8_case(draw):
    layout = draw(st.sampled_from(["contiguous", "paged"]))
    page_size = draw(st.sampled_from([1, 4, 16])) if layout == "paged" else None
    mask = draw(st.sampled_from(["none", "causal", "sliding_window"]))
    max_tokens = draw(st.sampled_from([1, 4, 8]))  # 4, 8: chunked prefill over the cache
    fields = dict(
        dtype=draw(st.sampled_from(["bf16", "fp16"])),
        head_dim=draw(st.sampled_from([16, 40, 64])),
        mask=mask,
        max_query_tokens=max_tokens,
    )
    if draw(st.integers(0, 3)) == 0:
        fields["head_dim_v"] = draw(st.sampled_from([16, 32]))
    kv_heads = draw(st.integers(1, 2))
    fields["num_kv_heads"] = kv_heads
    fields["num_q_heads"] = kv_heads * draw(st.sampled_from([1, 2, 4]))
    if mask != "none":
        fields["causal_align"] = "bottom_right"
    if mask == "sliding_window":
        fields["window_left"] = draw(st.sampled_from([0, 5, 16]))
    if draw(st.integers(0, 4)) == 0:
        fields["softcap"] = 30.0
    if draw(st.integers(0, 4)) == 0:
        fields["alibi"] = True
    if draw(st.integers(0, 4)) == 0:
        fields["sinks"] = True
    block_n = draw(st.sampled_from([16, 32]))
    boundary = page_size or block_n
    length = st.sampled_from(sorted({0, 1, boundary - 1, boundary, boundary + 1, 37}))
    lengths = draw(st.lists(length, min_size=1, max_size=3))
    steps = (draw(st.integers(1, max_tokens)), draw(st.sampled_from([0, 1, 3])))
    splits = draw(st.sampled_from([None, 1, 2, 3]))
    descales = (draw(st.sampled_from(DESCALES)), draw(st.sampled_from(DESCALES)))
    seed = draw(st.integers(0, 2**16))
    return layout, page_size, fields, block_n, lengths, steps, splits, descales, seed


@given(fp8_case())
@example(  # GQA 4:1, 8 query tokens (chunked prefill) with 3 appended, saturating 1e-3 scales
    (
        "paged",
        4,
        dict(
            dtype="bf16",
            head_dim=40,
            mask="causal",
            causal_align="bottom_right",
            num_kv_heads=2,
            num_q_heads=8,
            max_query_tokens=8,
        ),
        16,
        [5, 0, 37],
        (8, 3),
        3,
        ("small", "mixed"),
        1,
    )  # fmt: skip
)
@example(  # contiguous, a window, zero key descales (uniform weights), forced splits
    (
        "contiguous",
        None,
        dict(
            dtype="fp16",
            head_dim=16,
            mask="sliding_window",
            causal_align="bottom_right",
            window_left=5,
            num_kv_heads=1,
            num_q_heads=2,
            max_query_tokens=4,
        ),
        16,
        [33, 16],
        (2, 1),
        2,
        ("zero", "random"),
        2,
    )  # fmt: skip
)
def test_fp8_decode_matches_the_dequantized_float64_reference(case):
    check_fp8_case(case)


def check_fp8_case(case, device="cpu"):
    """One fp8_case on `device`: the output against the dequantized float64 reference, the
    caches after the append bit for bit against torch's quantization."""
    layout, page_size, fields, block_n, lengths, steps, splits, descales, seed = case
    (num_q_tokens, num_new), (k_kind, v_kind) = steps, descales
    spec = make_decode_spec(layout, page_size, kv_dtype="fp8_e4m3", **fields)
    kernel = load_decode(spec, block_n)
    cache = fp8_cache(spec, lengths, seed=seed, room=num_new)
    q, k_new, v_new, slopes = make_queries(
        spec, len(lengths), num_q_tokens, seed=seed, num_new=num_new
    )
    sinks = torch.randn(spec.num_q_heads) if spec.sinks else None
    extra = {"sinks": sinks.to(device)} if spec.sinks else {}
    kd = draw_descale(k_kind, len(lengths), spec.num_kv_heads, seed)
    vd = draw_descale(v_kind, len(lengths), spec.num_kv_heads, seed + 1)
    before = cache.clone()
    kernel.FORCE_NUM_SPLITS = splits

    def on(t):
        return None if t is None else t.to(device)

    try:
        ran = cache.to(device)
        out, lse = run_decode(kernel, ran, on(q), on(k_new), on(v_new), on(slopes),
                              k_descale=on(kd), v_descale=on(vd), **extra)  # fmt: skip
        out, lse, cache.k, cache.v = out.cpu(), lse.cpu(), ran.k.cpu(), ran.v.cpu()
    finally:
        kernel.FORCE_NUM_SPLITS = None
    k_new8 = v_new8 = None
    k_expected, v_expected = before.k, before.v
    if num_new:
        ones = torch.ones(len(lengths), spec.num_kv_heads)
        k_new8 = quantize(k_new, (ones if kd is None else kd)[:, :, None, None])
        v_new8 = quantize(v_new, (ones if vd is None else vd)[:, :, None, None])
        k_expected, v_expected = expected_cache_after_append(before, k_new8, v_new8)
    # the append wrote the quantized keys bit for bit, and nothing else
    assert torch.equal(bits(cache.k), bits(k_expected))
    assert torch.equal(bits(cache.v), bits(v_expected))
    problems = fp8_problems(
        spec, before, out, lse, q, k_new8, v_new8, kd, vd, slopes=slopes, sinks=sinks
    )
    assert not problems, "; ".join(problems)


def test_the_append_saturates_and_rounds_to_nearest_even():
    spec = fp8_spec("contiguous", None, num_q_heads=2, num_kv_heads=1, head_dim=16)
    kernel = load_decode(spec, 16)
    cache = fp8_cache(spec, [3], seed=4, room=16)
    # |x| / descale: past 448 (saturates), at fp8 midpoints (ties to even), subnormal, NaN-free
    grid = torch.tensor([1000.0, -1e30, 448.0, 464.0, 1.0625, 1.1875, 2.0**-10, -3.0 * 2**-10])
    k_new = torch.cat([grid, grid * 0.5]).reshape(1, 1, 1, 16).repeat(1, 1, 2, 1).bfloat16()
    v_new = -k_new
    q = torch.randn(1, 2, 1, 16).bfloat16()
    kd, vd = torch.full((1, 1), 0.5), torch.full((1, 1), 2.0)
    before = cache.clone()
    run_decode(kernel, cache, q, k_new, v_new, k_descale=kd, v_descale=vd)
    written = cache.k[0, 0, 3:5].float()
    expected = quantize(k_new[0, 0], 0.5).float()
    assert torch.equal(bits(cache.k[0, 0, 3:5]), bits(quantize(k_new[0, 0], 0.5)))
    assert torch.equal(bits(cache.v[0, 0, 3:5]), bits(quantize(v_new[0, 0], 2.0)))
    assert written[0, 0] == 448.0 and written[0, 1] == -448.0  # 2000, -2e30: saturated
    assert written[0, 3] == 448.0  # 464 / 0.5 = 928: saturated (480 would be a NaN pattern)
    assert torch.equal(written, expected)
    assert torch.equal(bits(cache.k[0, 0, :3]), bits(before.k[0, 0, :3]))


def test_none_descales_are_ones_and_descales_take_any_strides():
    spec = fp8_spec("paged", 4, num_q_heads=4, num_kv_heads=2)
    kernel = load_decode(spec, 16)
    q, k_new, v_new, _ = make_queries(spec, 3, 2, seed=5, num_new=2)
    results = []
    strided = torch.rand(2, 3).t()  # [B, HKV] with strides (1, 3)
    dense = strided.contiguous()
    for kd, vd in ((None, None), (torch.ones(3, 2), torch.ones(1, 1).expand(3, 2)),
                   (strided, strided), (dense, dense)):  # fmt: skip
        cache = fp8_cache(spec, [7, 0, 12], seed=6, room=2)
        out, lse = run_decode(kernel, cache, q, k_new, v_new, k_descale=kd, v_descale=vd)
        results.append((bits(cache.k), bits(cache.v), out, lse))
    for first, second in ((0, 1), (2, 3)):
        for a, b in zip(results[first], results[second], strict=True):
            assert torch.equal(a, b)


def test_fused_rotary_quantizes_the_rotated_keys():
    from attngen.runtime.kvcache_options import CacheOptions, rotate

    spec = fp8_spec("paged", 4, num_q_heads=4, num_kv_heads=2, mask="causal",
                    causal_align="bottom_right")  # fmt: skip
    kernel = load_decode(spec, 16)
    lengths = [6, 1]
    cache = fp8_cache(spec, lengths, seed=7, room=2)
    q, k_new, v_new, _ = make_queries(spec, 2, 2, seed=7, num_new=2)
    angles = torch.rand(
        cache.block_table.shape[1] * 4, 4, generator=torch.Generator().manual_seed(8)
    )
    cos, sin = (angles * 6.3).cos().bfloat16(), (angles * 6.3).sin().bfloat16()
    kd, vd = draw_descale("random", 2, 2, 9), draw_descale("random", 2, 2, 10)
    before = cache.clone()
    out, lse = run_decode(kernel, cache, q, k_new, v_new, k_descale=kd, v_descale=vd,
                          rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)  # fmt: skip
    options = CacheOptions((cos, sin, False), None, None, 0)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    q_rot, k_rot = rotate(q.transpose(1, 2), k_new.transpose(1, 2), options, seqlens, True)
    q_rot, k_rot = q_rot.transpose(1, 2), k_rot.transpose(1, 2)
    k_new8, v_new8 = quantize(k_rot, kd[:, :, None, None]), quantize(v_new, vd[:, :, None, None])
    k_expected, v_expected = expected_cache_after_append(before, k_new8, v_new8)
    assert torch.equal(bits(cache.k), bits(k_expected))
    assert torch.equal(bits(cache.v), bits(v_expected))
    problems = fp8_problems(spec, before, out, lse, q_rot, k_new8, v_new8, kd, vd)
    assert not problems, "; ".join(problems)


# ------------------------------------------------------------------------------- checks


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k_descale=torch.ones(2)), "k_descale: expected shape [2, 2], got [2]"),
        (dict(v_descale=torch.ones(2, 2, dtype=torch.float16)), "v_descale: expected dtype"),
        (dict(k_descale=0.5), "k_descale: expected a torch.Tensor, got float"),
        (dict(v_descale=torch.ones(2, 2, device="meta")), "v_descale: expected device cpu"),
        (dict(k_cache="bf16"), "k_cache: expected an fp8 cache"),
        (dict(k_new="fp8"), "k_new: expected dtype torch.bfloat16, got torch.float8_e4m3fn"),
    ],
)
def test_bad_fp8_arguments_raise_naming_them(change, message):
    spec = fp8_spec("contiguous", None, num_q_heads=4, num_kv_heads=2)
    kernel = load_decode(spec, 16)
    cache = fp8_cache(spec, [3, 5], seed=1, room=1)
    q, k_new, v_new, _ = make_queries(spec, 2, 1, seed=1, num_new=1)
    kwargs = dict(k_descale=torch.ones(2, 2), v_descale=torch.ones(2, 2))
    kwargs.update({k: v for k, v in change.items() if k.endswith("descale")})
    k_cache = cache.k.float().bfloat16() if change.get("k_cache") else cache.k
    k_new = k_new.to(FP8) if change.get("k_new") else k_new
    before = bits(cache.v).clone()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        kernel.decode(q, k_cache, cache.v, cache.lengths, k_new=k_new, v_new=v_new, **kwargs)
    assert torch.equal(bits(cache.v), before)  # refused before the append


def test_an_fp8_cache_is_refused_in_one_line_by_a_16_bit_module():
    spec = make_decode_spec("contiguous", None, dtype="bf16", head_dim=16, num_q_heads=2,
                            num_kv_heads=1)  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = fp8_cache(fp8_spec("contiguous", None, num_q_heads=2, num_kv_heads=1), [2], seed=3)
    q = torch.randn(1, 2, 1, 16).bfloat16()
    with pytest.raises(ValueError) as error:
        kernel.decode(q, cache.k, cache.v, cache.lengths)
    text = str(error.value)
    assert "\n" not in text and text.startswith("k_cache: got an fp8 cache (torch.float8_e4m3fn)")
    assert "kv_dtype: fp8_e4m3" in text


# --------------------------------------------------------------------------------- spec


def _decode_fields(**fields):
    return dict(kernels=["decode"], kv_layout="contiguous", dtype="bf16", head_dim=64, **fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(kernels=["prefill"], kv_dtype="fp8_e4m3"), "kv_dtype: got 'fp8_e4m3'"),
        (_decode_fields(kv_dtype="fp8"), "kv_dtype"),
        (_decode_fields(kv_dtype="fp8_e4m3", archs=["sm80"]), "archs: got 'sm80'"),
        ({**_decode_fields(kv_dtype="fp8_e4m3"), "dtype": "fp32"}, "dtype: got 'fp32'"),
        ({**_decode_fields(kv_dtype="fp8_e4m3"), "head_dim": 576, "head_dim_v": 512},
         "kv_dtype: got 'fp8_e4m3'"),
    ],
)  # fmt: skip
def test_kv_dtype_is_validated(fields, message):
    from tests.kernel_harness import make_spec

    with pytest.raises(SpecError, match=message):
        make_spec(**fields)


def test_kv_dtype_changes_the_name_and_hash_only_when_set():
    from tests.kernel_harness import make_spec

    plain = make_spec(**_decode_fields())
    fp8 = make_spec(**_decode_fields(kv_dtype="fp8_e4m3"))
    assert "kv_dtype" not in plain.canonical()
    assert module_name(plain, KernelKind.decode) == "t_decode_bf16_d64_causal_br_contig"
    assert module_name(fp8, KernelKind.decode) == "t_decode_bf16_d64_causal_br_contig_kvfp8"
    assert plain.spec_hash() != fp8.spec_hash()
    both = make_spec(**{**_decode_fields(kv_dtype="fp8_e4m3"), "kernels": ["prefill", "decode"]})
    prefill_only = make_spec(kernels=["prefill"], dtype="bf16", head_dim=64)
    assert both.kernel_hash(KernelKind.prefill) == prefill_only.spec_hash()


# ---------------------------------------------------------------- flash_attn_with_kvcache


FP8_SPECS = [
    dict(name="fp8c", kv_layout="contiguous"),
    dict(name="fp8p", kv_layout="paged", page_size=4),
]


@pytest.fixture(scope="module")
def fp8_kernels(tmp_path_factory):
    common = dict(dtype="bf16", head_dim=16, num_q_heads=4, num_kv_heads=2, mask="causal",
                  causal_align="bottom_right", kernels=["decode"], max_query_tokens=4,
                  kv_dtype="fp8_e4m3")  # fmt: skip
    folder = build_folder(tmp_path_factory.mktemp("fp8_kernels"),
                          [{**common, **spec} for spec in FP8_SPECS])  # fmt: skip
    saved = registry_module._current
    yield load_kernels(folder, replace=True)
    registry_module._current = saved


def _flash_step(paged: bool, seed: int = 3):
    """flash_attn_with_kvcache's tensors: q [2, 3, 4, 16], fp8 caches (NaN past the lengths),
    two new keys, descales [2, 2]."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(2, 12, 2, 16, generator=gen).to(FP8) for _ in range(2))
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    for b, n in enumerate(lengths.tolist()):
        k_cache[b, n:], v_cache[b, n:] = float("nan"), float("nan")
    table = None
    if paged:  # pages of 4 in reverse order
        k_cache, v_cache = (
            k_cache.reshape(-1, 4, 2, 16).flip(0),
            v_cache.reshape(-1, 4, 2, 16).flip(0),
        )
        table = torch.arange(5, -1, -1, dtype=torch.int32).reshape(2, 3)
    q, k, v = (
        torch.randn(2, n, h, 16, generator=gen).bfloat16() for n, h in ((3, 4), (2, 2), (2, 2))
    )
    kd, vd = torch.rand(2, 2, generator=gen) + 0.05, torch.rand(2, 2, generator=gen) + 0.05
    return q, k_cache, v_cache, k, v, lengths, table, kd, vd


@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_with_kvcache_serves_fp8_caches_from_the_decode_module(fp8_kernels, paged):
    import attngen

    q, k_cache, v_cache, k, v, lengths, table, kd, vd = _flash_step(paged)
    direct = (k_cache.clone(), v_cache.clone())
    results = []
    for _ in range(2):  # the second call of the layout runs from the module's plan
        caches = (k_cache.clone(), v_cache.clone())
        out, lse = attngen.flash_attn_with_kvcache(
            q, *caches, k, v, cache_seqlens=lengths, block_table=table, causal=True,
            return_softmax_lse=True, k_descale=kd, v_descale=vd,
        )  # fmt: skip
        results.append((bits(caches[0]), bits(caches[1]), out, lse))
        dispatch = attngen.last_dispatch()
        assert dispatch.need.kind.value == "decode" and dispatch.module.endswith("_kvfp8")
    module = fp8_kernels.module(dispatch.key)
    expected = module.decode_flash(
        q, *direct, lengths, block_table=table, k_new=k, v_new=v, return_lse=True,
        k_descale=kd, v_descale=vd,
    )  # fmt: skip
    for result in results:
        assert torch.equal(result[0], bits(direct[0])) and torch.equal(result[1], bits(direct[1]))
        assert torch.equal(result[2], expected[0]) and torch.equal(result[3], expected[1])


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_steps_run_from_the_runtime_plan(fp8_kernels, paged, monkeypatch):
    """A repeated fp8 step runs from flash_attn_with_kvcache's plan (its key holds the caches'
    dtype and which descales are given), with the call's descales: bit for bit the full
    path's; a step that leaves a descale out is another signature (the full path)."""
    import attngen
    from attngen.runtime import kvcache, plans

    q, k_cache, v_cache, k, v, lengths, table, kd, vd = _flash_step(paged)

    def step(**descales):
        caches = (k_cache.clone(), v_cache.clone())
        out = attngen.flash_attn_with_kvcache(
            q, *caches, k, v, cache_seqlens=lengths, block_table=table, causal=True, **descales
        )
        return out, bits(caches[0]), bits(caches[1])

    kept = len(plans.planned(fp8_kernels))
    first, halved = step(k_descale=kd, v_descale=vd), step(k_descale=kd, v_descale=vd * 0.5)
    assert len(plans.planned(fp8_kernels)) == kept + 1  # the first step's full path kept it

    def unplanned(*args):
        raise AssertionError("the full path ran")

    monkeypatch.setattr(kvcache, "_unplanned", unplanned)
    for want, descales in ((first, dict(k_descale=kd, v_descale=vd)),
                           (halved, dict(k_descale=kd, v_descale=vd * 0.5))):  # fmt: skip
        got = step(**descales)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not torch.equal(first[0], halved[0])  # the call's own descales reach the kernel
    with pytest.raises(AssertionError, match="the full path ran"):
        step(k_descale=kd)


def test_flash_attn_with_kvcache_refuses_what_fp8_caches_cannot_take(fp8_kernels):
    import attngen

    q, k_cache, v_cache, k, v, lengths, _, kd, vd = _flash_step(False)
    with pytest.raises(ValueError, match="k_descale: dequantizes an fp8 cache"):
        attngen.flash_attn_with_kvcache(
            q, k_cache.float().bfloat16(), v_cache.float().bfloat16(), k, v,
            cache_seqlens=lengths, causal=True, k_descale=kd,
        )  # fmt: skip
    before = bits(k_cache).clone()
    for extra, q_call in (
        (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), q),  # route 2 only
        ({}, torch.cat([q, q], dim=1)),  # 6 query tokens: past max_query_tokens 4
    ):
        with pytest.raises(ValueError, match="k_cache: an fp8 cache .* none serves the call"):
            attngen.flash_attn_with_kvcache(
                q_call, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                k_descale=kd, v_descale=vd, **extra,
            )  # fmt: skip
    assert torch.equal(bits(k_cache), before)  # refused before any append
