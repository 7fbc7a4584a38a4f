"""The registry's layers: loaded folders before the on-demand cache before the bundled
generated/; load_kernels adds (replace=True keeps only its folders); loaded_kernels() lists
every module with its origin."""

from __future__ import annotations

import torch

import attngen
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from tests.ondemand_harness import on_demand  # noqa: F401
from tests.runtime_harness import build_folder

LLAMA_LIKE = dict(
    name="mine",
    dtype="fp16",
    head_dim=59,
    num_q_heads=4,
    num_kv_heads=2,
    mask="causal",
    causal_align="bottom_right",
    kernels=["prefill"],
)


def _call():
    q, k, v = (torch.randn(1, 6, h, 59).half() for h in (4, 2, 2))
    attngen.flash_attn_func(q, k, v, causal=True)
    return attngen.last_dispatch()


def test_a_loaded_folder_comes_before_the_cache(on_demand, tmp_path):  # noqa: F811
    built = _call()
    assert built.source == "cache"
    mine = build_folder(tmp_path / "mine", [LLAMA_LIKE])
    load_kernels(mine)  # adds: the cache and generated/ stay behind it
    chosen = _call()
    assert chosen.source == "folder" and chosen.module == "sm90/mine_prefill_fp16_d59_causal_br"
    rows = attngen.loaded_kernels()
    sources = [row.source for row in rows]
    assert sources == sorted(sources, key=["folder", "cache", "bundled"].index)
    assert {"folder", "cache", "bundled"} == set(sources)
    cached = next(row for row in rows if row.source == "cache")
    assert cached.path == built.key and cached.folder == str(
        on_demand.resolve() / (built.key.split("/")[-3])
    )


def test_load_kernels_adds_newest_first_and_replace_keeps_only_its_folders(tmp_path):
    saved = current_registry()
    try:
        first = build_folder(tmp_path / "first", [LLAMA_LIKE])
        second = build_folder(tmp_path / "second", [{**LLAMA_LIKE, "name": "other"}])
        load_kernels(first, replace=True)
        registry = load_kernels(second)
        assert registry.folders[:2] == [second.resolve(), first.resolve()]
        assert _call().module == "sm90/other_prefill_fp16_d59_causal_br"  # newest first
        assert all(row.source != "bundled" for row in attngen.loaded_kernels())
        load_kernels(first, replace=True)
        assert {row.folder for row in attngen.loaded_kernels()} == {str(first.resolve())}
        load_kernels()  # the defaults again: generated/ is back
        assert any(row.source == "bundled" for row in attngen.loaded_kernels())
    finally:
        use_registry(saved)
