"""Refit the register model of the backward kernels (attngen/tiling/backward.py,
regs_expression) from the compiler measurements.

Reads attngen/verify/data/backward_compile_triton-<version>.json and solves, per kernel (dQ,
dK/dV, and the dK/dV kernel's one-gradient launches dV and dK) and code path (mma.sync;
wgmma on sm90 where the kernel's owned side has >= 64 rows), the linear program of
tools/fit_registers.py (docs/tiling.md): minimise the absolute error against the registers a
config needs (regs + spilled bytes / 4, capped at 400) subject to
  * every config that spills more than 64 B is predicted at 256 + CUSHION or more (never
    "safe");
  * every tuned winner of tuning/*.json that the data holds is predicted at 279 - CUSHION or
    less (it stays feasible: the build refuses a tuned config the model rejects), and at
    255 - CUSHION or less ("safe") when it compiles without spilling.
Features, with `rows` the score-tile rows a warp holds (owned / W; at least 16, an MMA
instruction's M, where the score tile stays in registers as the next dot's left operand:
always on wgmma, on mma.sync when the owned side >= D; see regs_expression):
  acc    fp32 accumulator elements a thread holds, rows * width / 32 (width: dQ D, dK/dV
         D + DV, the one-gradient launches dV DV and dK D);
  tile   one score tile, rows * streamed / 32;
  stream the streamed dot operands in 32-bit registers (dQ: K and V, BN * (D + DV) * E / 4;
         dK/dV: Q and dO, BM * (D + DV) * E / 4), over 32 W threads;
  repeat acc again where a warp holds more than 16 rows (a warpgroup more than one wgmma M
         slice of 64: 4 warps on 128 rows), else 0.
16-bit configs only: fp32 dots are FMA loops whose register use no tile formula follows (the
forward's finding), so fp32 stays in the may-spill class. Prints each fit, its error (rms over
the configs that do not spill) beside the committed model's, and the committed model's
violations of the two rules (there must be none). Needs numpy and scipy (not attngen
dependencies).

    python tools/fit_backward_registers.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import linprog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.arch import ARCHS  # noqa: E402
from attngen.build import load_specs  # noqa: E402
from attngen.tiling.backward import KERNELS, regs_model  # noqa: E402
from attngen.tiling.evaluate import compiled  # noqa: E402
from attngen.tiling.prefill import MODEL_NAMES  # noqa: E402
from attngen.tuning.database import backward_entry_key  # noqa: E402
from attngen.verify.measurements import data_path, triton_version  # noqa: E402

CUSHION = 4
FEATURES = ("1", "acc", "tile", "stream", "repeat")
KEY_FIELDS = ("arch", "kernel", "dtype", "D", "DV", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def on_wgmma(r: dict) -> bool:
    owned = r["BLOCK_M"] if r["kernel"] == "dq" else r["BLOCK_N"]
    return r["arch"] == "sm90" and owned >= 64 and r["dtype"] != "fp32"


def features(r: dict) -> list[float]:
    w, e = r["num_warps"], 4 if r["dtype"] == "fp32" else 2
    d, dv = r["D"], r["DV"]
    owned, streamed = (r["BLOCK_M"], r["BLOCK_N"])[:: 1 if r["kernel"] == "dq" else -1]
    width = {"dq": d, "dkdv": d + dv, "dv": dv, "dk": d}[r["kernel"]]
    in_registers = on_wgmma(r) or (owned >= d and e == 2)
    rows = max(16, owned / w) if in_registers else owned / w
    acc = rows * width / 32
    stream = streamed * (d + dv) * e / (128 * w)
    return [1.0, acc, rows * streamed / 32, stream, acc if rows > 16 else 0.0]


def tuned_keys() -> set[tuple]:
    """(arch, kernel, dtype, D, DV, config) of every tuned backward winner whose spec is among
    the examples and tools/bench_specs."""
    paths = [*ROOT.glob("examples/*.yaml"), *ROOT.glob("tools/bench_specs/*.yaml")]
    specs = [s for path in paths for s in load_specs([path]) if s.backward]
    keys = set()
    for path in ROOT.glob("tuning/sm*.json"):
        table = json.loads(path.read_text())
        for spec in specs:
            for kernel in KERNELS:
                entry = table["entries"].get(backward_entry_key(spec, kernel))
                if entry is not None:
                    c = entry["config"]
                    dims = (spec.head_dim, spec.value_head_dim)
                    keys.add(
                        (table["arch"], kernel, spec.dtype.value, *dims)
                        + (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])
                    )
    return keys


def fit(rows: list[dict], tuned: set[tuple]) -> np.ndarray:
    x = np.array([features(r) for r in rows])
    spills = np.array([r["spill_stores"] or 0 for r in rows])
    need = np.minimum(np.array([r["regs"] for r in rows]) + spills / 4, 400)
    n, k = x.shape
    bad = spills > 64
    keep = np.array([tuple(r[f] for f in KEY_FIELDS) in tuned for r in rows])
    safe = keep & (spills == 0)
    a_ub = np.vstack(
        [
            np.hstack([sign * x[m], np.zeros((m.sum(), 2 * n))])
            for sign, m in ((-1, bad), (1, keep), (1, safe))
        ]
    )
    b_ub = np.concatenate(
        [
            -(256 + CUSHION) * np.ones(bad.sum()),
            (279 - CUSHION) * np.ones(keep.sum()),
            (255 - CUSHION) * np.ones(safe.sum()),
        ]
    )
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


def committed(r: dict) -> int:
    """The committed model's prediction (what the tiler and verify-tiling use)."""
    model = compiled(regs_model(ARCHS[r["arch"]], r["kernel"]), MODEL_NAMES)
    e = 4 if r["dtype"] == "fp32" else 2
    values = (r["BLOCK_M"], r["BLOCK_N"], r["num_stages"], r["num_warps"], r["D"], r["DV"], e)
    return math.ceil(model(*values))


def rms(errors: list[float]) -> float:
    return float(np.sqrt(np.mean(np.square(errors)))) if errors else float("nan")


def main() -> int:
    records = json.loads(data_path(triton_version(), backward=True).read_text())["records"]
    rows = [r for r in records if not r["error"] and r["dtype"] != "fp32"]
    tuned = tuned_keys()
    violations = 0
    for kernel in KERNELS:
        for name, wgmma in (("mma.sync", False), ("wgmma", True)):
            part = [r for r in rows if r["kernel"] == kernel and on_wgmma(r) == wgmma]
            coef = fit(part, tuned)
            terms = " + ".join(f"{c:.3f}*{f}" for c, f in zip(coef, FEATURES, strict=True))
            clean = [r for r in part if not r["spill_stores"]]
            fitted = rms([float(np.dot(coef, features(r))) - r["regs"] for r in clean])
            model = rms([committed(r) - r["regs"] for r in clean])
            print(
                f"{kernel:4} {name:9} {len(part):4} configs: regs = {terms}\n"
                f"     rms on {len(clean)} that do not spill: fit {fitted:.1f}, "
                f"committed {model:.1f}"
            )
            for r in part:
                spills, predicted = r["spill_stores"] or 0, committed(r)
                key = tuple(r[f] for f in KEY_FIELDS)
                tuned_limit = 255 if spills == 0 else 279
                if (spills > 64 and predicted <= 255) or (key in tuned and predicted > tuned_limit):
                    violations += 1
                    print(f"     VIOLATION {key}: predicted {predicted}, spills {spills} B")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
