"""Recompile the compiler measurements' records of one arch (all dtypes, or only 16-bit ones),
with the spec each was compiled from, and rewrite them: after a template change that alters what the
compiler allocates on that arch (TMA on sm90), without a full `verify-tiling --recompile`.
    python tools/refresh_measurements.py sm90 --sixteen-bit [--only-errors-and-matrix]
        [--block-m-below 64] [--jobs 2]
(--only-errors-and-matrix: the records that failed to compile and the capability matrix's.)
"""

from __future__ import annotations

import argparse

from attngen.verify.compiler import compile_many
from attngen.verify.measurements import (
    data_path,
    load_measurements,
    save_measurements,
    triton_version,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("arch")
    parser.add_argument("--sixteen-bit", action="store_true")
    parser.add_argument("--only-errors-and-matrix", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--block-m-below",
        type=int,
        default=None,
        help="only configs with a smaller BLOCK_M (a path the change touched)",
    )
    args = parser.parse_args()
    path = data_path(triton_version())
    data = load_measurements(path)
    keys = [
        k
        for k in data.records
        if k.arch == args.arch
        and not (args.sixteen_bit and k.dtype == "fp32")
        and not (
            args.only_errors_and_matrix
            and not data.records[k]["error"]
            and not data.records[k]["spec"].startswith("capability")
        )
        and not (args.block_m_below and k.config.block_m >= args.block_m_below)
    ]
    print(f"recompiling {len(keys)} records of {args.arch}", flush=True)
    for start in range(0, len(keys), 48):
        chunk = keys[start : start + 48]
        jobs = [(data.spec_of(k), k.arch, k.config) for k in chunk]
        for key, (spec, _, _), record in zip(
            chunk, jobs, compile_many(jobs, args.jobs), strict=True
        ):
            data.add(key, spec, record)
        save_measurements(data, path)
        print(f"{start + len(chunk)} of {len(keys)}", flush=True)


if __name__ == "__main__":
    main()
