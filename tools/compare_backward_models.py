"""Compile the gradient kernels of specs with the newer models' fields (sinks, chunked masks,
sink tokens) at each kernel's chosen config and compare with the backward tiling model and
with the record of the same key in the committed data.

The backward measurements' key (dtype, padded head dims, dropout, tile) holds none of these
fields: their kernels must allocate the shared memory the model predicts for the key, and
that the plain kernel recorded under it allocates. A full `attngen verify-tiling --backward
SPEC --every-spec` sweep compiles every candidate; this compiles the chosen ones (minutes on
two cores).

    python tools/compare_backward_models.py tools/verify_specs/backward_models.yaml \
        [--arch sm80 --arch sm90] [--jobs 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen.build import load_specs  # noqa: E402
from attngen.tiling.backward import derive_backward_tiles  # noqa: E402
from attngen.verify.compiler import compile_many  # noqa: E402
from attngen.verify.measurements import (  # noqa: E402
    BackwardKey,
    backward_key,
    data_path,
    load_measurements,
    triton_version,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="+", type=Path)
    parser.add_argument("--arch", action="append", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    data = load_measurements(data_path(triton_version(), backward=True), BackwardKey)
    jobs, rows = [], []
    for spec in (s for s in load_specs(args.specs) if s.backward):
        for arch in args.arch or [a.value if hasattr(a, "value") else a for a in spec.archs]:
            derived = derive_backward_tiles(spec, arch)
            for kernel, derivation in (("dq", derived.dq), ("dkdv", derived.dkdv)):
                config = derivation.chosen
                model = next(c for c in derivation.candidates if c.config == config)
                recorded = data.get(backward_key(spec, arch, kernel, config)) or {}
                jobs.append((spec, arch, config, kernel))
                rows.append(
                    dict(
                        spec=spec.name,
                        arch=arch,
                        kernel=kernel,
                        config=config.as_dict(),
                        model_shared=model.smem_bytes,
                        recorded_shared=recorded.get("shared"),
                    )
                )
    failed = 0
    for row, record in zip(rows, compile_many(jobs, args.jobs), strict=True):
        row.update(
            shared=record["shared"],
            regs=record["regs"],
            error=record["error"],
            spills=record["spill_stores"],
            mma=record["mma"],
        )
        ok = (
            record["error"] is None
            and row["shared"] == row["model_shared"]
            and row["recorded_shared"] in (None, row["shared"])
        )
        failed += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} {row['spec']:28} {row['arch']} {row['kernel']:4} "
            f"{row['config']} shared {row['shared']} model {row['model_shared']} "
            f"record {row['recorded_shared']} regs {row['regs']} spills {row['spills']}"
            + (f" error {row['error']}" if row["error"] else "")
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{len(rows) - failed} of {len(rows)} as the model and the records say")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
