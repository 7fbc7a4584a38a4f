"""Cross-compile a spec at chosen tile configs and print what Triton allocates (no GPU needed).

A thin command over attngen.verify.compiler, for poking at single configs; `attngen
verify-tiling` is the full comparison with the tiling model.

    python tools/compile_configs.py SPEC.yaml --arch sm90 --config 128x64x8x3 --config 64x64x4x2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attngen.arch import ARCHS  # noqa: E402
from attngen.spec import load_spec_file  # noqa: E402
from attngen.tiling.prefill import TileConfig, derive_tiles  # noqa: E402
from attngen.verify.compiler import compile_many  # noqa: E402


def _parse_config(text: str) -> TileConfig:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BMxBNxWARPSxSTAGES, e.g. 128x64x8x3")
    return TileConfig(*map(int, parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="spec YAML file (every variant is compiled)")
    parser.add_argument("--arch", action="append", choices=list(ARCHS), required=True)
    parser.add_argument("--config", action="append", type=_parse_config, required=True)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    jobs = [
        (spec, arch, config)
        for spec in load_spec_file(args.spec)
        for arch in args.arch
        for config in args.config
    ]
    records = compile_many(jobs, args.processes)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    print(
        f"{'spec':<20} {'arch':<6} {'BMxBNxWxS':<12} {'shared':>7} {'model':>7} {'regs':>4} "
        f"{'model':>5} {'spills':>6} {'mma':<8} error"
    )
    for (spec, arch, config), r in zip(jobs, records, strict=True):
        cand = {c.config: c for c in derive_tiles(spec, arch).candidates}.get(config)
        model_smem = cand.smem_bytes if cand else "-"
        model_regs = cand.regs_per_thread if cand else "-"
        label = f"{config.block_m}x{config.block_n}x{config.num_warps}x{config.num_stages}"
        print(
            f"{spec.name[:20]:<20} {arch:<6} {label:<12} {r['shared'] or '-':>7} "
            f"{model_smem:>7} {r['regs'] or '-':>4} {model_regs:>5} "
            f"{r['spill_stores'] or 0:>6} {r['mma'] or '-':<8} {r['error'] or ''}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
