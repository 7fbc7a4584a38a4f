"""Rotary embedding fused into decode: the append kernel rotates the new keys as it writes them
into the cache, the split kernel rotates q as it loads it (flash-attn's rotary_cos/rotary_sin).

Against flash-attn's apply_rotary_emb in float64 (interleaved GPT-J pairs and GPT-NeoX halves,
rotary_dim below and equal to the head dim, causal and not, contiguous and paged caches, GQA,
cache_seqlens varying per sequence), and against the torch rotation of route 2
(attngen.runtime.kvcache_options.rotate): under the interpreter (no FMA contraction) the fused
rotation rounds exactly as torch's, so caches and outputs are bitwise those of the decode
module run on q and k rotated in torch.
"""

from __future__ import annotations

import pytest
import torch

import attngen
import attngen.runtime.dispatch as dispatch_module
import attngen.runtime.kvcache as kvcache_module
from attngen.runtime.kvcache_options import CacheOptions, rotate
from attngen.runtime.selection import routes
from tests.api_harness import api_kernels  # noqa: F401  (the module-scoped registry fixture)
from tests.decode_harness import (
    decode_problems,
    expected_cache_after_append,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
    same_bits,
)

LAYOUTS = [("contiguous", None), ("paged", 4)]


def rotary_tables(rows: int, half: int, dtype, seed: int):
    """cos/sin [rows, half] of random angles (every position its own)."""
    angles = torch.rand(rows, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


def reference_rotation(x, cos, sin, positions, interleaved: bool):
    """flash-attn's apply_rotary_emb in float64, rounded once to x's dtype: x [B, H, N, D]
    rotated at positions [B, N] on its first 2 * cos.shape[1] dims (cos/sin repeated per pair
    when interleaved, else per half; x * cos + rotate_half(x) * sin)."""
    rd = 2 * cos.shape[1]
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]  # [B, 1, N, half]
    x64 = x.double()
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        x1, x2 = x64[..., 0:rd:2], x64[..., 1:rd:2]
        turned = torch.stack((-x2, x1), -1).flatten(-2)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        x1, x2 = x64[..., : rd // 2], x64[..., rd // 2 : rd]
        turned = torch.cat((-x2, x1), -1)
    out = x64.clone()
    out[..., :rd] = x64[..., :rd] * c + turned * s
    return out.to(x.dtype)


def torch_rotation(q, k_new, cos, sin, lengths, interleaved: bool, per_token: bool):
    """Route 2's rotation (kvcache_rotary.rotate, flash layout) of the module's [B, H, N, D]."""
    options = CacheOptions((cos, sin, interleaved), None, None, 0)
    q_rot, k_rot = rotate(q.transpose(1, 2), k_new.transpose(1, 2), options, lengths, per_token)
    return q_rot.transpose(1, 2), k_rot.transpose(1, 2)


def capacity_of(cache) -> int:
    if cache.block_table is None:
        return cache.k.shape[2]
    return cache.block_table.shape[1] * cache.k.shape[1]


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("interleaved, half", [(True, 4), (False, 4), (True, 16), (False, 16)])
def test_fused_rotary_is_flash_attn_rotary(layout, page_size, mask, interleaved, half):
    spec = _spec(layout, page_size, mask)
    kernel = load_decode(spec, 16)
    lengths, num_new, num_q_tokens = [3, 9, 0], 2, 3
    cache = make_cache(spec, lengths, seed=1, room=num_new)
    before, unfused = cache.clone(), cache.clone()
    q, k_new, v_new, _ = make_queries(spec, 3, num_q_tokens, seed=1, num_new=num_new)
    cos, sin = rotary_tables(capacity_of(cache) + 3, half, q.dtype, seed=2)
    out, lse = run_decode(
        kernel,
        cache,
        q,
        k_new,
        v_new,
        rotary_cos=cos,
        rotary_sin=sin,
        rotary_interleaved=interleaved,
    )
    per_token = mask != "none"  # the module's default: flash-attn's causal or local calls
    q_rot, k_rot = torch_rotation(q, k_new, cos, sin, before.lengths, interleaved, per_token)
    unfused_out, unfused_lse = run_decode(kernel, unfused, q_rot, k_rot, v_new)
    # The cache holds the rotated keys and the values as they came, exactly as route 2 writes
    # them; the output is the module's on q rotated in torch, bit for bit.
    assert same_bits(cache.k, unfused.k) and same_bits(cache.v, unfused.v)
    assert same_bits(out, unfused_out) and same_bits(lse, unfused_lse)
    # flash-attn's semantics, in float64: the keys at cache_seqlens[b] + t; q at
    # cache_seqlens[b] (+ t under causal)
    starts = before.lengths.long()[:, None]
    k_ref = reference_rotation(k_new, cos, sin, starts + torch.arange(num_new), interleaved)
    q_positions = starts + torch.arange(num_q_tokens) * per_token
    q_ref = reference_rotation(q, cos, sin, q_positions, interleaved)
    k_expected, v_expected = expected_cache_after_append(before, k_ref, v_new)
    # fp16 rounding of the float32 rotation against that of the exact one: at most one ulp
    # (eps relative), or a few float32 ulps of the products (|x| < 5) near zero.
    eps = torch.finfo(q.dtype).eps
    torch.testing.assert_close(cache.k, k_expected, rtol=eps, atol=1e-6, equal_nan=True)
    assert same_bits(cache.v, v_expected)
    assert not decode_problems(spec, before, out, lse, q_ref, k_ref, v_new)


def test_the_query_positions_follow_rotary_q_per_token():
    spec = _spec("contiguous", None, "causal")
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [5, 2], seed=3, room=3)
    q, k_new, v_new, _ = make_queries(spec, 2, 3, seed=3, num_new=3)
    cos, sin = rotary_tables(capacity_of(cache), 8, q.dtype, seed=4)
    results = {}
    for per_token in (True, False):
        copy = cache.clone()
        results[per_token] = run_decode(
            kernel,
            copy,
            q,
            k_new,
            v_new,
            rotary_cos=cos,
            rotary_sin=sin,
            rotary_q_per_token=per_token,
        )
        q_rot, k_rot = torch_rotation(q, k_new, cos, sin, cache.lengths, True, per_token)
        expected = run_decode(kernel, cache.clone(), q_rot, k_rot, v_new)
        assert same_bits(results[per_token][0], expected[0])
    # the first token sits at cache_seqlens either way; the others move
    assert same_bits(results[True][0][:, :, :1], results[False][0][:, :, :1])
    assert not torch.equal(results[True][0][:, :, 1:], results[False][0][:, :, 1:])


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
def test_a_query_past_the_tables_rows_gets_nan_and_bad_sequences_read_nothing(layout, page_size):
    spec = _spec(layout, page_size, "causal")
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [7, 2, 3, 1], seed=5, room=1, extra_capacity=0)  # capacity 8
    capacity = capacity_of(cache)
    # sequence 0 ends at the capacity: its query tokens 1 and 2 sit past the table's rows;
    # sequences 2 and 3 do not fit (far past the capacity, negative): NaN, nothing appended,
    # and no row of cos/sin read for them (an unmasked read that far faults)
    cache.lengths = torch.tensor([capacity - 1, 2, 2**30, -(2**30)], dtype=torch.int32)
    before = cache.clone()
    q, k_new, v_new, _ = make_queries(spec, 4, 3, seed=5, num_new=1)
    cos, sin = rotary_tables(capacity, 8, q.dtype, seed=6)
    out, lse = run_decode(kernel, cache, q, k_new, v_new, rotary_cos=cos, rotary_sin=sin)
    nan_rows = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(lse.isnan(), nan_rows[:, None].expand_as(lse))
    assert torch.equal(out.isnan().all(-1), nan_rows[:, None].expand_as(lse))
    assert not out.isnan().any(-1)[~nan_rows[:, None].expand_as(lse)].any()
    # route 2's rotation agrees: NaN queries past the rows
    q_rot, _ = torch_rotation(q, k_new, cos, sin, cache.lengths, True, True)
    assert torch.equal(q_rot[:2].isnan().all(-1).all(1), nan_rows[:2])
    # the append: exactly the module's own with k rotated in torch (the sequences that fit)
    unfused = before.clone()
    run_decode(
        kernel,
        unfused,
        q_rot,
        *torch_rotation(q, k_new, cos, sin, cache.lengths, True, True)[1:],
        v_new,
    )
    assert same_bits(cache.k, unfused.k) and same_bits(cache.v, unfused.v)
    assert not same_bits(cache.k, before.k)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(rotary_sin=None), "rotary_sin: pass rotary_cos and rotary_sin together"),
        (dict(k_new=None, v_new=None), "rotary_cos: the rotary embedding rotates q and the"),
        (dict(rotary_cos=torch.ones(30, 8)), r"rotary_cos: expected a torch.float16 tensor"),
        (dict(rotary_sin=torch.ones(4, 8, dtype=torch.float16)), r"seqlen_ro >= \d+"),
        (dict(rotary_cos=torch.ones(30, 17), rotary_sin=torch.ones(30, 17)), r"1\.\.16"),
        (dict(rotary_interleaved=1), "rotary_interleaved: expected a bool, got int"),
        (dict(rotary_q_per_token=None), "rotary_q_per_token: expected a bool, got NoneType"),
    ],
)
def test_bad_rotary_arguments_raise_naming_them(change, message):
    spec = _spec("contiguous", None, "causal")
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [3], seed=7, room=1)
    q, k_new, v_new, _ = make_queries(spec, 1, 1, seed=7, num_new=1)
    cos, sin = rotary_tables(capacity_of(cache), 8, q.dtype, seed=8)
    args = dict(k_new=k_new, v_new=v_new, rotary_cos=cos, rotary_sin=sin, **{})
    args.update(change)
    if "rotary_cos" in change and "rotary_sin" not in change:
        args["rotary_sin"] = args["rotary_cos"]
    before = cache.k.clone()
    with pytest.raises(ValueError, match=message):
        kernel.decode(q, cache.k, cache.v, cache.lengths, **args)
    assert same_bits(cache.k, before)  # refused before anything is appended


# ------------------------------------------------------------------ flash_attn_with_kvcache


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
def test_flash_attn_with_kvcache_fuses_rotary_into_the_decode_module(
    api_kernels,  # noqa: F811
    paged,
    interleaved,
):
    gen = torch.Generator().manual_seed(11)
    batch, length, heads, d = 2, 12, (4, 2), 16
    q = torch.randn(batch, 3, heads[0], d, generator=gen)
    k, v = torch.randn(batch, 2, heads[1], d, generator=gen), torch.randn(batch, 2, 2, d)
    k_cache = torch.randn(batch, length, heads[1], d, generator=gen)
    v_cache = torch.randn(batch, length, heads[1], d, generator=gen)
    table = None
    if paged:  # pages of 4 in reverse order
        k_cache, v_cache = (
            k_cache.reshape(-1, 4, 2, d).flip(0),
            v_cache.reshape(-1, 4, 2, d).flip(0),
        )
        table = torch.arange(k_cache.shape[0] - 1, -1, -1, dtype=torch.int32).reshape(batch, -1)
    lengths = torch.tensor([7, 2], dtype=torch.int32)
    cos, sin = rotary_tables(length, 4, torch.float32, seed=12)  # rotary_dim 8 of 16
    caches = {}
    for way in ("fused", "torch"):
        caches[way] = (k_cache.clone(), v_cache.clone())
        rotary = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
        inputs = (q, k)
        if way == "torch":  # rotated before the call: the decode module appends as it is
            options = CacheOptions((cos, sin, interleaved), None, None, 0)
            inputs, rotary = rotate(q, k, options, lengths, True), {}
        with pytest.MonkeyPatch.context() as patch:  # the fused call rotates nothing in torch
            patch.setattr(kvcache_module, "rotate", _no_torch_rotation)
            caches[way] += attngen.flash_attn_with_kvcache(
                inputs[0],
                *caches[way],
                inputs[1],
                v,
                cache_seqlens=lengths,
                block_table=table,
                causal=True,
                return_softmax_lse=True,
                **rotary,
            )
        assert attngen.last_dispatch().need.kind.value == "decode"
    for fused, unfused in zip(caches["fused"], caches["torch"], strict=True):
        assert same_bits(fused, unfused)
    if not paged:  # route 2 (cache_leftpad zeros: the varlen module) writes the same cache
        route2 = (k_cache.clone(), v_cache.clone())
        out = attngen.flash_attn_with_kvcache(
            q,
            *route2,
            k,
            v,
            cos,
            sin,
            lengths,
            cache_leftpad=torch.zeros(2, dtype=torch.int32),
            causal=True,
            rotary_interleaved=interleaved,
        )
        assert attngen.last_dispatch().need.kind.value == "varlen"
        assert same_bits(route2[0], caches["fused"][0]) and same_bits(route2[1], caches["fused"][1])
        # two fp32 kernels (varlen, decode) over the same rotated inputs: a few ulps of |out| < 4
        torch.testing.assert_close(out, caches["fused"][2], rtol=0, atol=1e-5)


def _spec(layout, page_size, mask):
    return make_decode_spec(
        layout, page_size, mask=mask, dtype="fp16", head_dim=32, max_query_tokens=4
    )


def _no_torch_rotation(q, k, options, *args):
    assert options.rotary is None, "q and k were rotated in torch"
    return q, k


# --------------------------------------------------------------------------------- plans


def _rotary_step(seed=13):
    """A flash-layout decode step on api_kernels' contiguous fp32 causal module: q [2, 2, 4,
    16], caches [2, 12, 2, 16] (NaN past the lengths), two new keys, cos/sin [12, 4]."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(2, 12, 2, 16, generator=gen), torch.randn(2, 12, 2, 16)
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    for b, n in enumerate(lengths.tolist()):
        k_cache[b, n:], v_cache[b, n:] = float("nan"), float("nan")
    q, k, v = (torch.randn(2, 2, h, 16, generator=gen) for h in (4, 2, 2))
    cos, sin = rotary_tables(12, 4, torch.float32, seed=seed)
    return q, k_cache, v_cache, k, v, cos, sin, lengths


def test_a_fused_rotary_step_runs_from_its_plan(api_kernels, monkeypatch):  # noqa: F811
    needs = []
    need_for = dispatch_module.need_for  # the Call's Need (dispatch.Call.need)
    monkeypatch.setattr(
        dispatch_module, "need_for", lambda *a, **kw: needs.append(a) or need_for(*a, **kw)
    )
    monkeypatch.setattr(kvcache_module, "rotate", _no_torch_rotation)
    q, k_cache, v_cache, k, v, cos, sin, lengths = _rotary_step()
    results = []
    for _ in range(2):
        caches = (k_cache.clone(), v_cache.clone())
        results.append(
            (*caches, *attngen.flash_attn_with_kvcache(
                q, *caches, k, v, cos, sin, lengths, causal=True, return_softmax_lse=True,
                rotary_interleaved=False,
            ))
        )  # fmt: skip
    assert len(needs) == 1, "the second step took the full path"
    for full, planned in zip(*results, strict=True):
        assert same_bits(full, planned)
    # a call with other rotary options is another signature: the full path, then its plan
    caches = (k_cache.clone(), v_cache.clone())
    attngen.flash_attn_with_kvcache(q, *caches, k, v, cos, sin, lengths, causal=True)
    assert len(needs) == 2


def test_a_step_rotated_in_torch_keeps_no_plan(api_kernels, monkeypatch):  # noqa: F811
    """A decode module whose kernels do not rotate (ACCEPTS_ROTARY False): q and k are
    rotated in torch, on every call, and such a step never runs from a plan (which would not
    rotate)."""
    module = api_kernels.module_for("api", "decode")
    monkeypatch.setattr(module, "ACCEPTS_ROTARY", False)
    routes(api_kernels.registry).clear()  # (the plans earlier tests left, of kernels that rotate)
    rotations = []
    monkeypatch.setattr(kvcache_module, "rotate", lambda *a: rotations.append(a) or rotate(*a))
    q, k_cache, v_cache, k, v, cos, sin, lengths = _rotary_step()
    results = []
    for _ in range(2):
        caches = (k_cache.clone(), v_cache.clone())
        out = attngen.flash_attn_with_kvcache(q, *caches, k, v, cos, sin, lengths, causal=True)
        assert attngen.last_dispatch().need.kind.value == "decode"
        results.append((*caches, out))
    assert len(rotations) == 2
    for torch_way, again in zip(*results, strict=True):
        assert same_bits(torch_way, again)
    monkeypatch.undo()  # the module's kernels rotate again: the same bytes
    caches = (k_cache.clone(), v_cache.clone())
    fused = attngen.flash_attn_with_kvcache(q, *caches, k, v, cos, sin, lengths, causal=True)
    for torch_way, kernels in zip(results[0], (*caches, fused), strict=True):
        assert same_bits(torch_way, kernels)
