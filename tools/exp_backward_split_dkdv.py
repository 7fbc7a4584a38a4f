"""Experiment: the D 256 backward's dK/dV as two launches, one for dV and one for dK.

The generated dK/dV kernel keeps both accumulators, dK [BLOCK_N, D] and dV [BLOCK_N, DV] in
fp32, resident for its whole loop. At D 256 that is 64 KiB of registers per 32 keys, so the
tiles that fit are 32 keys wide (the H200 autotune's winner: 32x32, 4 warps, 3 stages), and
a 32-row M is below wgmma's 64: the kernel runs on mma.sync at about 220 TFLOP/s, 75% of the
backward's time at D 256 (autotune on the H200: dK/dV 4.99 ms against dQ 1.63 ms at B 4,
H 8, N 4096, non-causal; the dQ kernel, on wgmma, runs its three products at ~500 TFLOP/s).

The same kernel launched twice with GRADS 1 (dV: S = K Q^T, dV += P^T dO) and GRADS 2 (dK:
S, dP^T = V dO^T, dK += dS^T Q) holds one accumulator a launch: five products instead of
four (1.25x the work), but 64- and 128-key tiles on 8 warps, wgmma's M, fit without
spilling. A module runs that way when its BWD_DKDV_SPLIT holds the two launches' configs
(tests/test_backward_split.py: bitwise the fused kernel at equal tiles, on the CPU). Whether
it wins on the H200 is the question this answers:

    PYTHONPATH=. python tools/exp_backward_split_dkdv.py --out DIR    # H200: times, JSON
    PYTHONPATH=. python tools/exp_backward_split_dkdv.py --compile    # sm90 registers, no GPU

On the GPU: the backward grid's D 256 cells (B 4, H 8, N 4096, bf16, non-causal and causal;
tools/bench_backward.py's modules with their tuned configs), each kernel's time by
torch.profiler for the fused launch and for each launch of the split at every config of
SINGLES, the split gradients against the fused ones; then the best dV and dK launches' sum
against the fused launch. The grid's D 128 cells run too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GRID = ROOT / "tools" / "bench_specs" / "backward_grid.yaml"

# One config for both launches, each launch timed on its own: the best dV and the best dK
# need not share a config, and the launches are independent (each its own accumulator).
SINGLES = (
    (32, 64, 4, 2),
    (32, 64, 8, 2),
    (32, 128, 4, 2),
    (32, 128, 8, 2),
    (32, 128, 8, 3),
    (16, 128, 8, 2),
    (16, 128, 8, 3),
    (64, 64, 8, 2),
    (64, 128, 8, 2),
    (64, 128, 8, 3),
    (32, 256, 8, 2),
    (64, 128, 4, 2),
)
SHAPES = {256: (4, 8, 4096, 256), 128: (4, 16, 4096, 128)}  # the grid's N 4k cells


def as_config(config: tuple[int, int, int, int]) -> dict[str, int]:
    block_m, block_n, warps, stages = config
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def compile_report() -> list[dict]:
    """Cross-compile both launches of every config for sm90 (no GPU): registers, spills,
    shared memory and the matrix instructions (attngen.verify.compiler)."""
    from attngen.spec import KernelKind, load_spec_file
    from attngen.tiling.prefill import TileConfig
    from attngen.verify.compiler import compile_many

    spec = next(s for s in load_spec_file(GRID) if s.name == "backward_grid_d256_causal")
    jobs = sorted({(kernel, config) for kernel in ("dv", "dk") for config in SINGLES})
    records = compile_many(
        [(spec, "sm90", TileConfig(*config), kernel) for kernel, config in jobs],
        kind=KernelKind.prefill,
    )
    for (kernel, config), record in zip(jobs, records, strict=True):
        record.update(kernel=kernel, config=config)
        print(
            f"{kernel:<4}{'x'.join(map(str, config)):<12} regs {record['regs']} spills "
            f"{record['spill_stores']} shared {record['shared']} {record['mma']} "
            f"{record.get('error') or ''}"
        )
    return records


def launch_ms(run, repeats: int = 10) -> list[float]:
    """Milliseconds of each dK/dV launch of one run(), in launch order (torch.profiler): one
    entry for the fused kernel, two (dV, then dK) for the split."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    times = [
        event.device_time / 1e3
        for event in sorted(prof.events(), key=lambda event: event.time_range.start)
        if event.device_type == torch.autograd.DeviceType.CUDA
        and event.name.startswith("_attn_bwd_dkdv_kernel")
    ]
    per_run = len(times) // repeats
    return [sum(times[i::per_run]) / repeats for i in range(per_run)]


def on_gpu(out: Path, head_dims=(256, 128), device="cuda", timer=None) -> None:
    """The grid's N 4k cells of each head dim, causal and not: the fused dK/dV launch, then
    each of SINGLES as the split's dV and dK launch, each timed; device and timer
    (launch_ms) are parameters so that a CPU smoke run can take a small shape."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_backward import load_module  # the grid cell's module, with its tuned configs

    timer = timer or launch_ms
    rows, summary = [], []
    for head_dim in head_dims:
        shape = SHAPES[head_dim]
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v, dout = (
                torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4)
            )
            module = load_module(head_dim, causal)

            def gradients(module=module, q=q, k=k, v=v, dout=dout):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                module.attention(*leaves).backward(dout)
                return leaves[1].grad, leaves[2].grad

            fused = [g.float() for g in gradients()]
            fused_ms = sum(timer(gradients))
            cell = {"head_dim": head_dim, "causal": causal, "fused": module.BWD_DKDV_CONFIG,
                    "fused_ms": fused_ms, "dv_ms": {}, "dk_ms": {}}  # fmt: skip
            for config in SINGLES:
                module.BWD_DKDV_SPLIT = (as_config(config), as_config(config))
                key = "x".join(map(str, config))
                try:
                    split = gradients()
                    errors = [
                        ((a.float() - b).abs().max() / b.abs().max()).item()
                        for a, b in zip(split, fused, strict=True)
                    ]
                    dv_ms, dk_ms = timer(gradients)
                    cell["dv_ms"][key], cell["dk_ms"][key] = dv_ms, dk_ms
                    row = {"config": key, "dv_ms": dv_ms, "dk_ms": dk_ms, "errors": errors}
                except Exception as exc:  # a config that does not fit: reported, others run
                    row = {"config": key, "error": str(exc)[:200]}
                finally:
                    module.BWD_DKDV_SPLIT = None
                rows.append({"head_dim": head_dim, "causal": causal, **row})
                print(rows[-1], flush=True)
            summary.append(with_best(cell))
    result = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "rows": rows,
        "cells": summary,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp_backward_split_dkdv.json").write_text(json.dumps(result, indent=1))
    print_table(summary)


def with_best(cell: dict) -> dict:
    """The cell with its fastest dV and dK configs and their sum, the split's time."""
    best_dv = min(cell["dv_ms"], key=cell["dv_ms"].get, default=None)
    best_dk = min(cell["dk_ms"], key=cell["dk_ms"].get, default=None)
    nan = float("nan")
    split_ms = cell["dv_ms"].get(best_dv, nan) + cell["dk_ms"].get(best_dk, nan)
    return {**cell, "best_dv": best_dv, "best_dk": best_dk, "split_ms": split_ms}


def print_table(summary: list[dict]) -> None:
    print(f"{'D':>4} {'causal':>6} {'fused ms':>9} {'best dV':>12} {'best dK':>12} "
          f"{'split ms':>9} {'speedup':>7}")  # fmt: skip
    for c in summary:
        speedup = c["fused_ms"] / c["split_ms"]
        print(
            f"{c['head_dim']:>4} {c['causal']!s:>6} {c['fused_ms']:9.3f} {c['best_dv']!s:>12} "
            f"{c['best_dk']!s:>12} {c['split_ms']:9.3f} {speedup:7.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compile", action="store_true", help="cross-compile for sm90")
    args = parser.parse_args()
    if args.compile:
        compile_report()
    else:
        on_gpu(args.out or Path("/tmp"))


if __name__ == "__main__":
    main()
