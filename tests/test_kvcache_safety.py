"""flash_attn_with_kvcache with bad lengths and block tables: refused on the host when the
host can tell without a device read, otherwise NaN for that sequence and not a byte written
outside the slots of the good sequences, on both routes (a generated decode module, and the
varlen kind with the torch append). Caches sit in guard regions (tests/safety_harness.py)."""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.reference import compare_to_reference
from attngen.runtime.registry import current_registry, load_kernels
from tests.decode_harness import same_bits
from tests.kernel_harness import make_spec
from tests.runtime_harness import build_folder
from tests.safety_harness import guarded

TOY = make_spec(name="toy", dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=2)
CAPACITY, NEW, PAGE = 12, 2, 4
LENGTHS = [3, 7, 5]  # sequence 1 is the one made bad


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _case(seed=0):
    """q [B, 2, 4, 16], contiguous caches [B, CAPACITY, 2, 16], new keys [B, NEW, 2, 16], in
    flash-attn's layout. Slots past each length hold 0, not NaN: a bad sequence's NaN must
    come from the bound, not from garbage it read."""
    batch = len(LENGTHS)
    k_cache, v_cache = (
        _rand(batch, CAPACITY, 2, 16, seed=seed),
        _rand(batch, CAPACITY, 2, 16, seed=seed + 1),
    )
    for b, n in enumerate(LENGTHS):
        k_cache[b, n:] = v_cache[b, n:] = 0.0
    q = _rand(batch, 2, 4, 16, seed=seed + 2)
    return (
        q,
        k_cache,
        v_cache,
        _rand(batch, NEW, 2, 16, seed=seed + 3),
        _rand(batch, NEW, 2, 16, seed=seed + 4),
    )


def _paged(k_cache, v_cache):
    """The same caches in pages of PAGE rows, in shuffled order, plus one page nobody owns."""
    batch = k_cache.shape[0]
    per_row = CAPACITY // PAGE
    order = torch.randperm(batch * per_row + 1, generator=torch.Generator().manual_seed(9))
    pages = [torch.zeros(batch * per_row + 1, PAGE, 2, 16) for _ in range(2)]
    for cache, paged in zip((k_cache, v_cache), pages, strict=True):
        paged[order[:-1]] = cache.reshape(batch * per_row, PAGE, 2, 16)
    return *pages, order[:-1].view(batch, per_row).to(torch.int32)


def _expected(buffer, view, table, k_new, good):
    """The guard buffer after the call: the good sequences' new keys in their slots."""
    buffer = buffer.clone()
    pad = (buffer.numel() - view.numel()) // 2
    cache = buffer[pad : pad + view.numel()].view(view.shape)
    for b in good:
        pos = LENGTHS[b] + torch.arange(NEW)
        if table is None:
            cache[b, pos] = k_new[b]
        else:
            cache[table[b, pos // PAGE].long(), pos % PAGE] = k_new[b]
    return buffer


def _check(bad_lengths, table=None, bad=1, paged=False):
    q, k_cache, v_cache, k_new, v_new = _case()
    dense_k, dense_v = k_cache.clone(), v_cache.clone()
    if paged:
        k_cache, v_cache, good_table = _paged(k_cache, v_cache)
        table = good_table if table is None else table(good_table)
    k_view, k_buffer = guarded(k_cache)
    v_view, v_buffer = guarded(v_cache)
    good = [b for b in range(len(LENGTHS)) if b != bad]
    k_expected = _expected(k_buffer, k_view, table, k_new, good)
    v_expected = _expected(v_buffer, v_view, table, v_new, good)
    out, lse = attngen.flash_attn_with_kvcache(
        q,
        k_view,
        v_view,
        k_new,
        v_new,
        cache_seqlens=torch.tensor(bad_lengths, dtype=torch.int32),
        block_table=table,
        causal=True,
        return_softmax_lse=True,
    )
    assert same_bits(k_buffer, k_expected) and same_bits(v_buffer, v_expected)
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    for b in good:
        n = LENGTHS[b]
        keys = torch.cat([dense_k[b, :n], k_new[b]]).transpose(0, 1)[None]
        values = torch.cat([dense_v[b, :n], v_new[b]]).transpose(0, 1)[None]
        assert not compare_to_reference(
            TOY,
            out[b : b + 1].transpose(1, 2),
            lse[b : b + 1],
            q[b : b + 1].transpose(1, 2),
            keys,
            values,
        )


BAD_LENGTHS = {
    "append past the capacity": CAPACITY - NEW + 1,
    "negative": -1,
    "near 2**31": 2**31 - 1,
}
BAD_PAGES = {
    "past the cache": lambda t: _set(t, 0, t.numel() + 1),
    "negative, where the new keys go": lambda t: _set(t, 2, -1),
    "near 2**31": lambda t: _set(t, 1, 2**31 - 1),
}


def _set(table, page, value):
    table = table.clone()
    table[1, page] = value
    return table


def test_new_keys_need_cache_seqlens(toy_kernels):
    q, k_cache, v_cache, k_new, v_new = _case()
    with pytest.raises(ValueError, match="cache_seqlens: required with new keys"):
        attngen.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, causal=True)


@pytest.mark.parametrize("value", [CAPACITY - NEW + 1, -1])
def test_an_int_cache_seqlens_is_checked_on_the_host(toy_kernels, value):
    q, k_cache, v_cache, k_new, v_new = _case()
    with pytest.raises(ValueError, match=rf"cache_seqlens: got {value}; allowed: 0\.\.10"):
        attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=value, causal=True
        )


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name", list(BAD_LENGTHS))
def test_bad_lengths_on_the_varlen_route(toy_kernels, paged, name):
    _check([LENGTHS[0], BAD_LENGTHS[name], LENGTHS[2]], paged=paged)
    assert attngen.last_dispatch().module == "sm90/toy_varlen_fp32_d16_causal_br"


@pytest.mark.parametrize("name", list(BAD_PAGES))
def test_bad_block_table_entries_on_the_varlen_route(toy_kernels, name):
    _check(LENGTHS, table=BAD_PAGES[name], paged=True)


@pytest.fixture(scope="module")
def decode_folder(tmp_path_factory):
    decode = dict(
        name="toy",
        dtype="fp32",
        head_dim=16,
        num_q_heads=4,
        num_kv_heads=2,
        mask="causal",
        causal_align="bottom_right",
        kernels=["decode"],
        max_query_tokens=2,
    )
    return build_folder(
        tmp_path_factory.mktemp("decode"),
        [
            {**decode, "kv_layout": "contiguous"},
            {**decode, "name": "toy_pages", "kv_layout": "paged", "page_size": PAGE},
        ],
    )


@pytest.mark.parametrize(
    "paged, name",
    [(False, "append past the capacity"), (True, "negative"), (True, "past the cache")],
)
def test_bad_indices_on_the_decode_route(decode_folder, paged, name):
    saved = current_registry()
    try:
        load_kernels(decode_folder)
        if name in BAD_PAGES:
            _check(LENGTHS, table=BAD_PAGES[name], paged=True)
        else:
            _check([LENGTHS[0], BAD_LENGTHS[name], LENGTHS[2]], paged=paged)
        assert "_decode_" in attngen.last_dispatch().module
    finally:
        load_kernels(*saved.folders)


@pytest.mark.parametrize("route", ["varlen", "decode"])
@pytest.mark.parametrize(
    "name, error",
    [
        ("negative", r"cache_seqlens\[1\] = -1: expected 0\.\.10"),
        ("past the cache", r"block_table\[1, 0\] = 10: expected a page in 0\.\.9"),
    ],
)
def test_checked_mode_names_the_bad_entry(
    monkeypatch, toy_kernels, decode_folder, route, name, error
):
    saved = current_registry()
    try:
        if route == "decode":
            load_kernels(decode_folder)
        monkeypatch.setenv("ATTNGEN_CHECKS", "1")
        with pytest.raises(ValueError, match=error):
            if name in BAD_PAGES:
                _check(LENGTHS, table=BAD_PAGES[name], paged=True)
            else:
                _check([LENGTHS[0], BAD_LENGTHS[name], LENGTHS[2]], paged=True)
    finally:
        load_kernels(*saved.folders)
