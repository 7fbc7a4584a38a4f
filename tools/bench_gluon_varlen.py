"""The Gluon varlen forward on the H200 against the tile-level varlen forward and FA4's.

Each cell's spec (bf16, D 64/128/256, H = 2048 / D, causal bottom-right or none) is built as a
varlen module twice: as a user gets it (the Gluon kernel per packed sequence) and with "varlen"
gated again (the tile-level kernel); both are timed through their attention_varlen() on the
same packed inputs, 16384 tokens in all, with FA4's `flash_attn.cute.flash_attn_varlen_func`
beside them (`source tools/gpu_fa4.sh` first; recorded as refused when not importable). Two
packings per N: "equal" (16384 / N sequences of N tokens) and "ragged" (lengths N, N/2, N/4,
N/8, repeated while they fit in 16384 tokens). forward_path() of the Gluon module is recorded
(short launches, and short sequences at D 64, take the tile-level kernel there by the module's
rules: what a user gets). Every output is compared with the tile-level one (max abs diff; above
2e-2 flagged "!" and left out of the ratios). On a CUDA machine, from the repository root:

    PYTHONPATH=. python tools/bench_gluon_varlen.py --out DIR [--n 1024 4096 16384] [--d 128]

Writes DIR/bench_gluon_varlen.json and prints one line per cell.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
import triton

from attngen.spec import KernelKind
from attngen.tiling import gluon as gluon_tiling
from tests.kernel_harness import load_kernel, make_spec

TOKENS, WIDTH = 16384, 2048
FLAG = 2e-2


def modules(d: int, causal: bool):
    """(Gluon varlen module, tile-level varlen module) of the cell's spec: the second rendered
    with "varlen" gated again (GLUON_UNVERIFIED widened in this process)."""
    heads, mask = WIDTH // d, "causal" if causal else "none"
    spec = make_spec(dtype="bf16", head_dim=d, num_q_heads=heads, num_kv_heads=heads, mask=mask,
                     kernels=["prefill", "varlen"])  # fmt: skip
    gluon = load_kernel.__wrapped__(spec, kind=KernelKind.varlen)
    opened = gluon_tiling.GLUON_UNVERIFIED
    gluon_tiling.GLUON_UNVERIFIED = frozenset({"varlen"})
    gluon_tiling._derive_gluon_tiles.cache_clear()
    try:
        tile = load_kernel.__wrapped__(spec, kind=KernelKind.varlen)
    finally:
        gluon_tiling.GLUON_UNVERIFIED = opened
        gluon_tiling._derive_gluon_tiles.cache_clear()
    return gluon, tile


def lengths(n: int, packing: str) -> list[int]:
    if packing == "equal":
        return [n] * (TOKENS // n)
    cycle = [n, n // 2, n // 4, n // 8]
    out: list[int] = []
    while sum(out) + cycle[len(out) % 4] <= TOKENS:
        out.append(cycle[len(out) % 4])
    return out


def _fa4(causal: bool):
    from flash_attn.cute import flash_attn_varlen_func

    def run(q, k, v, cu, max_len):
        lengths = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len)
        out = flash_attn_varlen_func(q, k, v, causal=causal, **lengths)
        return out[0] if isinstance(out, tuple) else out

    return run


def run_cell(d: int, n: int, causal: bool, packing: str, rep_ms: int) -> dict:
    gluon, tile = modules(d, causal)
    lens = lengths(n, packing)
    total, heads = sum(lens), WIDTH // d
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(total, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    pairs = sum(m * (m + 1) // 2 if causal else m * m for m in lens)
    impls: dict = {
        "gluon": lambda: gluon.attention_varlen(q, k, v, cu, cu, max(lens), max(lens)),
        "tile": lambda: tile.attention_varlen(q, k, v, cu, cu, max(lens), max(lens)),
    }
    try:
        fa4 = _fa4(causal)
        impls["fa4"] = lambda: fa4(q, k, v, cu, max(lens))
    except Exception as exc:  # noqa: BLE001 - recorded, the others still run
        impls["fa4"] = f"unavailable: {type(exc).__name__}: {exc}"[:200]
    cell: dict = {"D": d, "N": n, "causal": causal, "packing": packing, "sequences": len(lens),
                  "tflops": {}, "diff": {}, "refused": {}}  # fmt: skip
    reference = impls["tile"]()
    for name, fn in impls.items():
        if isinstance(fn, str):
            cell["refused"][name] = fn
            continue
        try:
            cell["diff"][name] = (fn().float() - reference.float()).abs().max().item()
            ms = triton.testing.do_bench(fn, rep=rep_ms)
            cell["tflops"][name] = round(4 * heads * d * pairs / ms / 1e9, 1)
        except Exception as exc:  # noqa: BLE001 - recorded, the cell goes on
            cell["refused"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            traceback.print_exc()
    cell["gluon_path"] = gluon.forward_path()
    for other in ("tile", "fa4"):
        ok = all(cell["diff"].get(x, 1.0) <= FLAG for x in ("gluon", other))
        if ok and other in cell["tflops"] and "gluon" in cell["tflops"]:
            cell[f"gluon/{other}"] = round(cell["tflops"]["gluon"] / cell["tflops"][other], 3)
    return cell


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--packing", nargs="+", default=["equal", "ragged"])
    parser.add_argument("--rep-ms", type=int, default=50)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cells = []
    for d in args.d:
        for n in args.n:
            for causal in (False, True):
                for packing in args.packing:
                    cell = run_cell(d, n, causal, packing, args.rep_ms)
                    cells.append(cell)
                    ratios = {k: v for k, v in cell.items() if k.startswith("gluon/")}
                    print(d, n, causal, packing, cell["tflops"], ratios, cell["refused"],
                          cell["gluon_path"][:40], flush=True)  # fmt: skip
                    (args.out / "bench_gluon_varlen.json").write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
