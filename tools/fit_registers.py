"""Refit the 16-bit register model of attngen/tiling/prefill_model.py (regs_expression) from the
compiler measurements.

Reads attngen/verify/data/prefill_compile_triton-<version>.json and the original 584-config
fit set (docs/results/tiling_fit_set_584.json) and solves, per code path (mma.sync; wgmma on
sm90 with BLOCK_M >= 64), the linear program of docs/tiling.md: minimise the absolute error
against the registers a config needs (regs + spilled bytes / 4, capped at 400) subject to
  * every config that spills more than 64 B is predicted at 256 + CUSHION or more;
  * every tuned winner in tuning/*.json is predicted at 279 or less (it stays feasible).
The committed coefficients are these, rounded to simple fractions and re-checked by
`attngen verify-tiling`. Needs numpy and scipy (not attngen dependencies).

    python tools/fit_registers.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import linprog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.build import load_specs  # noqa: E402
from attngen.tiling.prefill import TileConfig  # noqa: E402
from attngen.verify.measurements import (  # noqa: E402
    data_path,
    measurement_key,
    triton_version,  # noqa: E402
)

CUSHION = 4
FEATURES = ("1", "acc", "scores", "kv")


def features(r: dict) -> list[float]:
    threads = 32 * r["num_warps"]
    e = 4 if r["dtype"] == "fp32" else 2
    return [
        1.0,
        r["BLOCK_M"] * r["DV"] / threads,
        r["BLOCK_M"] * r["BLOCK_N"] / threads,
        r["BLOCK_N"] * (r["D"] + r["DV"]) * e / (4 * threads),
    ]


def tuned_keys() -> set[tuple]:
    specs = {
        s.spec_hash(): s
        for path in [*ROOT.glob("examples/*.yaml"), *ROOT.glob("tools/bench_specs/*.yaml")]
        for s in load_specs([path])
    }
    keys = set()
    for path in ROOT.glob("tuning/sm*.json"):  # not the autotune progress files
        table = json.loads(path.read_text())
        for name, entry in table["entries"].items():
            spec = specs.get(name.split("/")[0])
            if spec is not None:
                keys.add(
                    tuple(
                        measurement_key(spec, table["arch"], TileConfig.from_dict(entry["config"]))
                    )
                )
    return keys


def fit(rows: list[dict], tuned: set[tuple]) -> np.ndarray:
    x = np.array([features(r) for r in rows])
    spills = np.array([r["spill_stores"] or 0 for r in rows])
    need = np.minimum(np.array([r["regs"] for r in rows]) + spills / 4, 400)
    n, k = x.shape
    bad = spills > 64
    keep = np.array(
        [
            tuple(
                r[f]
                for f in (
                    "arch",
                    "dtype",
                    "D",
                    "DV",
                    "BLOCK_M",
                    "BLOCK_N",
                    "num_warps",
                    "num_stages",
                )
            )
            in tuned
            for r in rows
        ]
    )
    zeros = np.zeros
    a_ub = np.vstack(
        [
            np.hstack([-x[bad], zeros((bad.sum(), 2 * n))]),
            np.hstack([x[keep], zeros((keep.sum(), 2 * n))]),
        ]
    )
    b_ub = np.concatenate([-(256 + CUSHION) * np.ones(bad.sum()), 279 * np.ones(keep.sum())])
    result = linprog(
        np.concatenate([zeros(k), np.ones(2 * n)]),
        A_ub=a_ub,
        b_ub=b_ub,
        A_eq=np.hstack([x, -np.eye(n), np.eye(n)]),
        b_eq=need,
        bounds=[(None, None)] + [(0, None)] * (k - 1 + 2 * n),
        method="highs",
    )
    if result.status != 0:
        raise SystemExit(f"no model satisfies the constraints: {result.message}")
    return result.x[:k]


def main() -> int:
    records = json.loads(data_path(triton_version()).read_text())["records"]
    fit_set = json.loads((ROOT / "docs/results/tiling_fit_set_584.json").read_text())
    # Aligned rows only: unaligned ones (read element by element) have their own formula
    # (regs_expression's pipelined=False), fitted over their own configs; the fit set's
    # head dims are all 16-element multiples. Without dropout: the fit is of the kernels the
    # model was fitted to (the keep mask's Philox rounds add registers of their own).
    rows = [
        r
        for r in records + fit_set
        if not r["error"]
        and r["dtype"] != "fp32"
        and r.get("aligned", True)
        and not r.get("dropout", False)
    ]
    tuned = tuned_keys()
    for name, wgmma in (("mma.sync", False), ("wgmma", True)):
        part = [r for r in rows if (r["arch"] == "sm90" and r["BLOCK_M"] >= 64) == wgmma]
        coef = fit(part, tuned)
        terms = " + ".join(f"{c:.3f}*{f}" for c, f in zip(coef, FEATURES, strict=True))
        print(f"{name:9} {len(part):5} configs: regs = {terms}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
