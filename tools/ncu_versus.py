"""Each kernel of one training step, attngen beside FA4 (or cuDNN), under Nsight Compute: where
a grid cell's gap sits, kernel by kernel (time, SM and tensor-pipe throughput, issue slots,
memory throughputs, the leading warp-stall reasons).

For each cell and implementation a worker process runs flash_attn_func's forward + backward
(bench_grid.py's shapes: [B, N, H, D] bf16, B = 16384 / N, H = 2048 / D) twice to warm up,
then once between cudaProfilerStart and Stop, which ncu alone profiles (`--profile-from-start
off`: process-wide, so the backward's kernels, launched from autograd's thread, are in; an NVTX
range is per thread and left them out), with the clocks left alone (`--clock-control none`,
METHOD.md). On a CUDA machine, from the
repository root (FA4 on the path: `source tools/gpu_fa4.sh`):

    python3 tools/ncu_versus.py --out OUT [--cells 128:16384:0 64:1024:1] [--impls attngen,fa4]

Writes OUT/ncu_versus.json (every metric of every kernel) and prints one block per cell.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

CELLS = ("128:16384:0", "64:16384:0", "64:1024:1", "128:4096:0", "256:4096:1")
METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "regex:sm__pipe_tensor.*pct_of_peak_sustained_active",
    "sm__instruction_throughput.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
    r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
)
STALL = "smsp__average_warps_issue_stalled_"


def worker(cell: str, impl: str) -> None:
    """The profiled process: warm-up steps, then one step between the profiler's start and stop."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_grid import implementations

    d, n, causal = (int(x) for x in cell.split(":"))
    fn = implementations([impl])[impl]
    if isinstance(fn, str):
        raise SystemExit(fn)
    shape = (16384 // n, n, 2048 // d, d)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    for step in range(3):
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
        torch.autograd.grad(fn(*leaves, bool(causal)), leaves, dout)
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()


def profile(cell: str, impl: str) -> list[dict]:
    """ncu's raw page of every kernel in the profiled step, one dict per kernel."""
    command = ["ncu", "--clock-control", "none", "--profile-from-start", "off",
               "--csv", "--page", "raw", "--metrics", ",".join(METRICS),
               sys.executable, __file__, "--worker", cell, impl]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    start = run.stdout.find('"ID"')
    if run.returncode or start < 0:
        raise RuntimeError(f"ncu rc {run.returncode}: {(run.stderr or run.stdout)[-600:]}")
    rows = csv.DictReader(io.StringIO(run.stdout[start:]))
    return [row for row in rows if row.get("Kernel Name")]  # (the units' row has none)


def summary(row: dict) -> dict:
    """The printed columns of one kernel: name, microseconds, throughputs, top three stalls."""

    def number(key: str) -> float:
        try:
            return float(str(row.get(key, "nan")).replace(",", ""))
        except ValueError:
            return float("nan")

    tensor = [number(k) for k in row if k.startswith("sm__pipe_tensor")]
    stalls = sorted(((number(k), k[len(STALL):].split("_per_issue")[0]) for k in row
                     if k.startswith(STALL)), reverse=True)  # fmt: skip
    return {
        "kernel": row["Kernel Name"][:48],
        "us": number("gpu__time_duration.sum") / 1e3,
        "sm%": number("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
        "tensor%": max(tensor, default=float("nan")),
        "issue%": number("smsp__issue_active.avg.pct_of_peak_sustained_active"),
        "l1%": number("l1tex__throughput.avg.pct_of_peak_sustained_active"),
        "l2%": number("lts__throughput.avg.pct_of_peak_sustained_elapsed"),
        "dram%": number("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
        "regs": number("launch__registers_per_thread"),
        "stalls": " ".join(f"{name} {value:.1f}" for value, name in stalls[:3]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cells", nargs="+", default=list(CELLS), help="D:N:causal")
    parser.add_argument("--impls", default="attngen,fa4")
    parser.add_argument("--worker", nargs=2, metavar=("CELL", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for cell in args.cells:
        for impl in args.impls.split(","):
            try:
                rows = profile(cell, impl)
            except Exception as exc:  # noqa: BLE001 - recorded, the other runs go on
                results[f"{cell} {impl}"] = {"error": str(exc)[-600:]}
                print(f"{cell} {impl}: {exc}", flush=True)
                continue
            results[f"{cell} {impl}"] = {"kernels": rows}
            print(f"== D:N:causal {cell}, {impl}", flush=True)
            for line in map(summary, rows):
                print("  " + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else str(v)
                                       for k, v in line.items()), flush=True)  # fmt: skip
        (args.out / "ncu_versus.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
