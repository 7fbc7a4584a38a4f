"""Refit the register model of the backward kernels (attngen/tiling/backward.py,
regs_expression) from the compiler measurements.

Reads attngen/verify/data/backward_compile_triton-<version>.json and solves, per kernel (dQ,
dK/dV) and code path (mma.sync; wgmma on sm90 where the kernel's score tile has >= 64 rows),
the linear program of tools/fit_registers.py (docs/tiling.md): minimise the absolute error
against the registers a config needs (regs + spilled bytes / 4, capped at 400) subject to
every config that spills more than 64 B being predicted at 256 + CUSHION or more (never
"safe"). Features, over 32 * num_warps threads:
  acc    fp32 accumulator elements a thread holds (dQ: BM * D; dK/dV: BN * (D + DV));
  tile   one score tile (BM * BN);
  stream the streamed dot operands, in 32-bit registers (dQ: K and V, BN * (D + DV) * E / 4;
         dK/dV: Q and dO, BM * (D + DV) * E / 4).
16-bit configs only: fp32 dots are FMA loops whose register use no tile formula follows (the
forward's finding), so fp32 stays in the may-spill class. Needs numpy and scipy (not attngen
dependencies).

    python tools/fit_backward_registers.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import linprog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.verify.measurements import data_path, triton_version  # noqa: E402

CUSHION = 4
FEATURES = ("1", "acc", "tile", "stream")


def features(r: dict) -> list[float]:
    threads = 32 * r["num_warps"]
    e = 4 if r["dtype"] == "fp32" else 2
    bm, bn, width = r["BLOCK_M"], r["BLOCK_N"], r["D"] + r["DV"]
    if r["kernel"] == "dq":
        acc, stream = bm * r["D"], bn * width * e / 4
    else:
        acc, stream = bn * width, bm * width * e / 4
    return [1.0, acc / threads, bm * bn / threads, stream / threads]


def on_wgmma(r: dict) -> bool:
    rows = r["BLOCK_M"] if r["kernel"] == "dq" else r["BLOCK_N"]
    return r["arch"] == "sm90" and rows >= 64


def fit(rows: list[dict]) -> np.ndarray:
    x = np.array([features(r) for r in rows])
    spills = np.array([r["spill_stores"] or 0 for r in rows])
    need = np.minimum(np.array([r["regs"] for r in rows]) + spills / 4, 400)
    n, k = x.shape
    bad = spills > 64
    a_ub = np.hstack([-x[bad], np.zeros((bad.sum(), 2 * n))])
    b_ub = -(256 + CUSHION) * np.ones(bad.sum())
    result = linprog(
        np.concatenate([np.zeros(k), np.ones(2 * n)]),
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
    records = json.loads(data_path(triton_version(), backward=True).read_text())["records"]
    rows = [r for r in records if not r["error"] and r["dtype"] != "fp32"]
    for kernel in ("dq", "dkdv"):
        for name, wgmma in (("mma.sync", False), ("wgmma", True)):
            part = [r for r in rows if r["kernel"] == kernel and on_wgmma(r) == wgmma]
            if not part:
                continue
            coef = fit(part)
            terms = " + ".join(f"{c:.3f}*{f}" for c, f in zip(coef, FEATURES, strict=True))
            clean = [r for r in part if not r["spill_stores"]]
            err = np.array([np.dot(coef, features(r)) - r["regs"] for r in clean])
            rms = float(np.sqrt(np.mean(err**2))) if len(err) else float("nan")
            print(
                f"{kernel:4} {name:9} {len(part):4} configs: regs = {terms} "
                f"(rms {rms:.1f} on {len(clean)} that do not spill)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
