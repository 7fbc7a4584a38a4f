"""The absorbed multi-head latent attention decode (DeepSeek-V3: qk head dim 576 = 512 latent +
64 rope, value head dim 512, one KV head) against the float64 reference, on the CPU.

Its kernel computes q.k as two dots over one key tile (the latent 512 and the rope 64, no
padding to 1024) and, when v_cache is k_cache[..., :512] (the values are the latent keys),
uses the loaded latent tile as V (V_FROM_K) instead of reading V again; a v_cache of its own
is still read as one. Caches hold NaN wherever no sequence owns a slot, so a read outside a
sequence's keys shows up; lengths are not multiples of the page or the key tile.
"""

from __future__ import annotations

import pytest
import torch

from attngen.tiling.decode import derive_decode_tiles, latent_rope_split
from tests.decode_harness import (
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
)

LATENT, ROPE = 512, 64


def mla_spec(layout: str, dtype: str = "fp16"):
    """DeepSeek-V3's absorbed decode dims with 16 query heads (one 16-row tile: fast on CPU)."""
    return make_decode_spec(
        layout,
        64 if layout == "paged" else None,
        dtype=dtype,
        head_dim=LATENT + ROPE,
        head_dim_v=LATENT,
        num_q_heads=16,
        num_kv_heads=1,
        kernels=["decode"],
    )


def latent_cache(spec, lengths, seed):
    """A cache whose values are its keys' first 512 dims (the reference's values too)."""
    cache = make_cache(spec, lengths, seed=seed)
    cache.v = cache.k[..., :LATENT]
    cache.dense_v = [k[..., :LATENT] for k in cache.dense_k]
    return cache


def run(module, cache, q, splits):
    module.FORCE_NUM_SPLITS = splits
    try:
        out, lse = module.decode(
            q, cache.k, cache.v, cache.lengths, block_table=cache.block_table, return_lse=True
        )
    finally:
        module.FORCE_NUM_SPLITS = None
    assert module.LAST_NUM_SPLITS == (splits or module.LAST_NUM_SPLITS)
    return out, lse


def test_the_split_is_the_latent_and_rope_dims():
    assert latent_rope_split(mla_spec("paged")) == (LATENT, ROPE)
    # powers of two, and dims that are no latent + rope sum, keep the one padded dot
    assert latent_rope_split(make_decode_spec(head_dim=128)) is None
    assert latent_rope_split(make_decode_spec(head_dim=96)) is None  # DV = D: no latent part
    assert latent_rope_split(make_decode_spec(head_dim=200, head_dim_v=128)) is None


@pytest.mark.parametrize(
    ("layout", "dtype", "lengths", "splits"),
    [
        ("paged", "fp16", [70, 9, 0, 129], None),
        ("paged", "bf16", [70, 1, 191], 3),
        ("contiguous", "fp16", [33, 100], 4),
        ("contiguous", "bf16", [65, 7], 1),
    ],
)
def test_latent_values_match_the_reference(layout, dtype, lengths, splits):
    spec = mla_spec(layout, dtype)
    module = load_decode(spec, block_n=32)
    cache = latent_cache(spec, lengths, seed=len(lengths))
    assert module._values_are_latent_keys(cache.k, cache.v)
    q, _, _, _ = make_queries(spec, len(lengths), 1, seed=11)
    out, lse = run(module, cache, q, splits)
    problems = decode_problems(spec, cache, out, lse, q)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_a_value_cache_of_its_own_is_read(layout):
    """v_cache not k_cache's first 512 dims (same layout as that view, other values): the
    kernel reads it (V_FROM_K off), and the reference's values are its."""
    spec = mla_spec(layout)
    module = load_decode(spec, block_n=32)
    cache = make_cache(spec, [70, 5], seed=3)
    other = cache.k.flip(-1)  # the same pages, lengths and NaN slots, other values
    cache.v = other[..., :LATENT]
    cache.dense_v = [k.flip(-1)[..., :LATENT] for k in cache.dense_k]
    assert cache.v.stride() == cache.k.stride() and not module._values_are_latent_keys(
        cache.k, cache.v
    )
    q, _, _, _ = make_queries(spec, 2, 1, seed=5)
    out, lse = run(module, cache, q, 2)
    problems = decode_problems(spec, cache, out, lse, q)
    assert not problems, "; ".join(problems)


def test_a_page_outside_the_cache_gives_nan_for_its_sequence_only():
    spec = mla_spec("paged")
    module = load_decode(spec, block_n=32)
    cache = latent_cache(spec, [70, 40], seed=8)
    cache.block_table[1, 0] = cache.k.shape[0] + 3  # sequence 1's first page: not the cache's
    q, _, _, _ = make_queries(spec, 2, 1, seed=9)
    out, lse = run(module, cache, q, 2)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    good = make_cache(spec, [70], seed=8)
    assert not torch.isnan(out[0]).any() and torch.equal(good.lengths[:1], cache.lengths[:1])


def test_a_call_plan_tells_latent_values_from_a_cache_of_their_own(monkeypatch):
    """The plan key holds whether v_cache is k_cache's latent view: a later call whose v_cache
    has the same layout but other memory must not run the V_FROM_K launch."""
    spec = mla_spec("paged")
    module = load_decode(spec)
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)
    cache = make_cache(spec, [5], seed=1)
    other = cache.k.clone()
    q, _, _, _ = make_queries(spec, 1, 1, seed=2)

    def key(v_cache):
        return module._call_key(
            q, cache.k, v_cache, cache.lengths, cache.block_table, None, None, None, None,
            False, None, 0, None, None, True, True,
        )  # fmt: skip

    aliased, separate = key(cache.k[..., :LATENT]), key(other[..., :LATENT])
    assert aliased is not None and separate is not None and aliased != separate


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_deepseek_tile_holds_64_head_rows(arch):
    """The tiling model gives the absorbed decode 64 query-head rows per program (each latent
    byte read by two programs for 128 heads, not four)."""
    from attngen.build import load_specs
    from attngen.spec import KernelKind

    (spec,) = [
        s for s in load_specs(["examples/deepseek_v3.yaml"]) if KernelKind.decode in s.kernels
    ]
    config = derive_decode_tiles(spec, arch).chosen
    assert config is not None and config.block_m >= 64


def test_rotary_is_refused_by_name_on_the_split_dot():
    """The fused rotary rotates dims [0, rotary_dim); an absorbed MLA decode's RoPE lives in the
    rope part after the latent, so its module takes none and says so (the runtime rotates in
    torch for it: ACCEPTS_ROTARY is False)."""
    spec = mla_spec("paged")
    module = load_decode(spec)
    assert module.ACCEPTS_ROTARY is False
    cache = make_cache(spec, [5], seed=1)
    q, _, _, _ = make_queries(spec, 1, 1, seed=2)
    table = torch.ones(64, 8, dtype=q.dtype)
    with pytest.raises(ValueError, match="rotary_cos: this absorbed MLA decode module"):
        module.decode(
            q, cache.k, cache.k[..., :LATENT], cache.lengths, block_table=cache.block_table,
            rotary_cos=table, rotary_sin=table,
        )  # fmt: skip
