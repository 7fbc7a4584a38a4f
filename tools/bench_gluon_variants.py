"""The Gluon forward's variants on the H200 against the tile-level forward and FlashAttention-4:
gpt-oss's local layers (window 128 = (127, 0) bottom-right with sinks, D 64, 64:8 heads) and
Gemma-2's softcap 50 (D 256, 16:8 heads; global causal and local window (4095, 0)).

Each case's module is built twice from one spec: with ATTNGEN_GLUON_VARIANTS=1 (the Gluon
kernel, gated or not) and with every variant gated (the tile-level kernel), then
timed through its attention() on the same inputs with FA4 (`flash_attn.cute.flash_attn_func`
with window_size, softcap and learnable_sink) where it takes the variant; forward only, bf16,
[B, N, H, D] inputs, B = 16384 / N tokens, `do_bench` medians. Every output is compared with
the tile-level one first (max abs diff; above 2e-2 flagged "!" and left out of the ratios); a
refusing implementation is recorded with its reason. On a CUDA machine, from the repository
root (FA4 on the path: `source tools/gpu_fa4.sh`):

    PYTHONPATH=. python tools/bench_gluon_variants.py --out DIR [--n 4096 16384]

Writes DIR/bench_gluon_variants.json and prints one line per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch
import triton

import attngen.tiling.gluon as gluon_tiling
from attngen.spec.files import VARIANTS_ENV
from tests.kernel_harness import load_kernel, make_spec

TOKENS = 16384
FLAG = 2e-2
# name -> (spec fields, FA4 keyword arguments)
CASES = {
    "gpt-oss-local-w128-sinks": (
        dict(
            dtype="bf16",
            head_dim=64,
            num_q_heads=64,
            num_kv_heads=8,
            mask="sliding_window",
            window_left=127,
            window_right=0,
            sinks=True,
        ),
        dict(causal=True, window_size=(127, 0)),
    ),
    "gemma2-global-softcap50": (
        dict(
            dtype="bf16", head_dim=256, num_q_heads=16, num_kv_heads=8, mask="causal", softcap=50.0
        ),
        dict(causal=True, softcap=50.0),
    ),
    "gemma2-local-w4096-softcap50": (
        dict(
            dtype="bf16",
            head_dim=256,
            num_q_heads=16,
            num_kv_heads=8,
            mask="sliding_window",
            window_left=4095,
            window_right=0,
            softcap=50.0,
        ),
        dict(causal=True, window_size=(4095, 0), softcap=50.0),
    ),
    "mistral-w4096": (
        dict(
            dtype="bf16",
            head_dim=128,
            num_q_heads=32,
            num_kv_heads=8,
            mask="sliding_window",
            window_left=4095,
            window_right=0,
        ),
        dict(causal=True, window_size=(4095, 0)),
    ),
    "mpt-alibi": (  # FA4 has no ALiBi
        dict(dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=32, alibi=True),
        dict(causal=True),
    ),
    "llama4-chunked-8192": (  # FA4 has no chunked mask
        dict(
            dtype="bf16",
            head_dim=128,
            num_q_heads=40,
            num_kv_heads=8,
            mask="chunked",
            chunk_size=8192,
        ),
        dict(causal=True),
    ),
}


def modules(fields):
    """(spec, Gluon module, tile-level module) of one spec; the first must run the Gluon kernel.
    The tile-level one is rendered with every variant gated again (GLUON_UNVERIFIED widened in
    this process), so the same spec compares the two forwards once its variant is open."""
    spec = make_spec(**fields)
    os.environ[VARIANTS_ENV] = "1"
    try:
        gluon = load_kernel.__wrapped__(spec)
    finally:
        del os.environ[VARIANTS_ENV]
    opened = gluon_tiling.GLUON_UNVERIFIED
    gluon_tiling.GLUON_UNVERIFIED = gluon_tiling.GLUON_VARIANTS
    gluon_tiling._derive_gluon_tiles.cache_clear()
    try:
        tile = load_kernel.__wrapped__(spec)
    finally:
        gluon_tiling.GLUON_UNVERIFIED = opened
        gluon_tiling._derive_gluon_tiles.cache_clear()
    assert not tile.forward_path().startswith("Gluon"), tile.forward_path()
    return spec, gluon, tile


def _fa4(fa4_kwargs, sinks):
    from flash_attn.cute import flash_attn_func

    def run(q, k, v):
        extra = {} if sinks is None else {"learnable_sink": sinks}
        out = flash_attn_func(q, k, v, **fa4_kwargs, **extra)
        return out[0] if isinstance(out, tuple) else out

    return run


def run_cell(name, n, rep_ms) -> dict:
    fields, fa4_kwargs = CASES[name]
    spec, gluon, tile = modules(fields)
    gen = torch.Generator(device="cuda").manual_seed(7)
    batch, hq, hkv, d = TOKENS // n, spec.num_q_heads, spec.num_kv_heads, spec.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v = randn(batch, n, hq, d), randn(batch, n, hkv, d), randn(batch, n, hkv, d)
    sinks = torch.randn(hq, generator=gen, device="cuda") if spec.sinks else None
    extra = {"sinks": sinks} if spec.sinks else {}
    if spec.alibi:  # MPT's slopes, 2**(-8 i / H)
        extra["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, hq + 1, device="cuda") / hq)
    impls = {
        "gluon": lambda q, k, v: gluon.attention_flash(q, k, v, **extra),
        "tile": lambda q, k, v: tile.attention_flash(q, k, v, **extra),
        "fa4": _fa4(fa4_kwargs, sinks),
    }
    cell: dict = {"case": name, "n": n, "batch": batch, "ms": {}, "diff": {}, "refused": {}}
    reference = impls["tile"](q, k, v)
    for impl, fn in impls.items():
        try:
            out = fn(q, k, v)
            cell["diff"][impl] = (out.float() - reference.float()).abs().max().item()
            cell["ms"][impl] = triton.testing.do_bench(lambda fn=fn: fn(q, k, v), rep=rep_ms)
        except Exception as exc:  # noqa: BLE001 - recorded, the cell goes on
            cell["refused"][impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            traceback.print_exc()
    cell["gluon_path"] = gluon.forward_path()
    for other in ("tile", "fa4"):
        ok = all(cell["diff"].get(x, 1.0) <= FLAG for x in ("gluon", other))
        if ok and other in cell["ms"] and "gluon" in cell["ms"]:
            cell[f"speedup_vs_{other}"] = cell["ms"][other] / cell["ms"]["gluon"]
    return cell


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cells = []
    for name in args.cases:
        for n in args.n:
            cell = run_cell(name, n, args.rep_ms)
            cells.append(cell)
            flags = {k: ("!" if v > FLAG else "") for k, v in cell["diff"].items()}
            print(
                name,
                n,
                cell["gluon_path"],
                {k: round(v, 3) for k, v in cell["ms"].items()},
                flags,
                cell["refused"],
                flush=True,
            )
            (args.out / "bench_gluon_variants.json").write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
