"""The decode tile model against what Triton 3.6 compiles
(attngen/verify/data/decode_compile_*.json, written by tools/decode_compile_check.py by
cross-compiling for sm80/86/89/90, no GPU).

The shared-memory model is prefill's loop with BLOCK_M = the row tile; it is exact for
contiguous caches and over for paged ones, where Triton 3.6 does not multi-buffer the K/V
loads whose address comes from the block table (one buffer whatever num_stages): the model
never promises less than the compiler needs, which is the direction that matters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attngen.arch import ARCHS
from attngen.build import load_specs
from attngen.spec import KernelKind, KvLayout
from attngen.tiling.decode import derive_decode_tiles, latent_rope_split, num_splits, row_tile
from attngen.tiling.decode_latent import derive_latent_tiles, register_cap
from attngen.tiling.prefill import TileConfig
from attngen.verify.measurements import triton_version

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "attngen" / "verify" / "data" / f"decode_compile_triton-{triton_version()}.json"
SAFE_SPILL_BYTES = 64


def _decode_specs():
    return [
        s
        for s in load_specs(sorted((ROOT / "examples").glob("*.yaml")))
        if KernelKind.decode in s.kernels
    ]


def _rows():
    rows = json.loads(DATA.read_text())["rows"]
    return {(r["kernel_hash"], r["arch"], r.get("v_from_k")): r for r in rows}


def test_every_chosen_decode_config_fits_what_the_compiler_allocates():
    assert DATA.is_file(), "regenerate: PYTHONPATH=. python tools/decode_compile_check.py"
    rows = _rows()
    archs = set()
    for spec in _decode_specs():
        if latent_rope_split(spec):
            continue  # its own model: the test below
        for arch in spec.archs:
            derivation = derive_decode_tiles(spec, arch)
            row = rows[(spec.kernel_hash(KernelKind.decode), arch, None)]
            assert TileConfig.from_dict(row["config"]) == derivation.chosen
            budget = ARCHS[arch].smem_budget
            model = derivation.chosen_candidate.smem_bytes
            assert row["error"] is None and row["shared"] <= budget
            assert row["shared"] <= model, (spec.name, arch)  # never under the compiler
            if spec.kv_layout is KvLayout.contiguous:
                assert row["shared"] == model, (spec.name, arch)  # exact where pipelined
            assert (row["spill_stores"] or 0) <= SAFE_SPILL_BYTES
            assert row["regs"] <= ARCHS[arch].max_regs_per_thread
            archs.add(arch)
    assert archs >= {"sm80", "sm86", "sm89", "sm90"}


def test_the_latent_decode_model_is_the_compilers():
    """The absorbed MLA decode (attngen/tiling/decode_latent.py), both paths: its latent cache
    (V the latent key tile, CONFIG) and a v_cache of its own (SEPARATE_V_CONFIG). Its shared
    memory model is exact (paged, as DeepSeek-V3's cache), and the chosen tiles neither
    spill more than SAFE_SPILL_BYTES nor exceed the warps' register file."""
    rows = _rows()
    specs = [s for s in _decode_specs() if latent_rope_split(s)]
    assert specs
    for spec in specs:
        for arch in spec.archs:
            for v_from_k in (True, False):
                derivation = derive_latent_tiles(spec, arch, v_from_k)
                row = rows[(spec.kernel_hash(KernelKind.decode), arch, v_from_k)]
                assert TileConfig.from_dict(row["config"]) == derivation.chosen
                model = derivation.chosen_candidate.smem_bytes
                assert row["error"] is None and row["shared"] == model, (arch, v_from_k)
                assert model <= ARCHS[arch].smem_budget
                assert (row["spill_stores"] or 0) <= SAFE_SPILL_BYTES, (arch, v_from_k)
                assert row["regs"] <= register_cap(ARCHS[arch], derivation.chosen.num_warps)
    sm90 = derive_latent_tiles(specs[0], "sm90").chosen
    assert (sm90.block_m, sm90.block_n) == (64, 64)  # FlashMLA's 64 heads x 64 keys


def test_a_paged_decode_config_compiles_as_recorded():
    """One live cross-compile (the full set is the slow test below): the decode kernel's launch
    signature, as attngen.verify.compiler builds it, still gives the recorded allocation."""
    from attngen.verify.compiler import compile_many  # a spawned worker: no interpreter there

    arch = "sm86"
    spec = next(s for s in _decode_specs() if s.kv_layout is KvLayout.paged and arch in s.archs)
    row = _rows()[(spec.kernel_hash(KernelKind.decode), arch, None)]
    config = derive_decode_tiles(spec, arch).chosen
    (record,) = compile_many([(spec, arch, config)], kind=KernelKind.decode)
    fields = ("shared", "regs", "spill_stores", "mma", "error")
    assert {f: record[f] for f in fields} == {f: row[f] for f in fields}


def test_the_fp8_cache_model_against_the_compiler():
    """fp8 caches (`kv_dtype`) against live sm90 cross-compiles: exact on contiguous caches
    (16-row mma.sync tiles at 1-3 stages, a 64-row wgmma tile), a bound on paged ones; and the
    choice on paged caches takes BLOCK_N 128 at 2 stages, the bytes in flight of a 16-bit
    tile of 64 keys (a third stage buffers nothing there)."""
    from attngen.verify.compiler import compile_many
    from tests.test_decode_fp8 import fp8_spec

    def spec(layout, hq=32, hkv=8, tokens=1):
        return fp8_spec(layout, 16 if layout == "paged" else None, dtype="bf16", head_dim=128,
                        num_q_heads=hq, num_kv_heads=hkv, max_query_tokens=tokens)  # fmt: skip

    contiguous, wide, paged = spec("contiguous"), spec("contiguous", 32, 2, 4), spec("paged")
    jobs = [(contiguous, "sm90", TileConfig(16, 128, 4, s)) for s in (1, 2, 3)]
    jobs += [(wide, "sm90", TileConfig(64, 32, 4, 3)), (paged, "sm90", TileConfig(16, 64, 4, 3))]
    records = compile_many(jobs, kind=KernelKind.decode)
    for (job_spec, arch, config), record in zip(jobs, records, strict=True):
        modelled = next(
            c.smem_bytes for c in derive_decode_tiles(job_spec, arch).candidates
            if c.config == config
        )  # fmt: skip
        exact = job_spec.kv_layout is KvLayout.contiguous
        assert record["error"] is None and record["shared"] is not None, record
        assert record["shared"] == modelled if exact else record["shared"] <= modelled, config
    assert derive_decode_tiles(paged, "sm90").chosen == TileConfig(16, 128, 4, 2)


@pytest.mark.slow
def test_compile_data_is_current():
    # About 4 minutes on two cores: the examples' chosen configs compiled live.
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "decode_compile_check.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_row_tile_and_split_rule():
    assert [row_tile(32, 8, n) for n in (1, 4, 16)] == [16, 16, 64]
    assert row_tile(28, 4, 4) == 32 and row_tile(64, 1, 16) == 64  # capped: row blocks
    assert num_splits(8, 4096, 64, 132) == (16, 256)  # B=1: 16 x 8 = 128 programs
    assert num_splits(512, 4096, 64, 132) == (1, 4096)  # B=64: enough programs already
    assert num_splits(64, 32768, 64, 132) == (6, 5504)  # a fuller last wave than 5
    assert num_splits(8, 0, 64, 132) == (1, 64)
    for programs in (1, 7, 64, 1000):
        for span in (1, 100, 4096, 10**6):
            splits, keys = num_splits(programs, span, 64, 132)
            assert 1 <= splits <= 64 and keys % 64 == 0
            assert splits * keys >= span > (splits - 1) * keys  # no empty split


def test_decode_choice_is_safe_and_bandwidth_first():
    for spec in _decode_specs():
        for arch in spec.archs:
            derivation = derive_decode_tiles(spec, arch)
            best = derivation.chosen_candidate
            assert best is not None and not best.may_spill(ARCHS[arch])
            feasible = [c for c in derivation.candidates if c.feasible]
            if latent_rope_split(spec):  # not spilling and the widest row tile first
                feasible = [
                    c
                    for c in feasible
                    if c.config.block_m == best.config.block_m
                    and c.regs_per_thread <= register_cap(ARCHS[arch], c.config.num_warps)
                ]
            top = max(c.score for c in feasible)
            assert best.score == top
