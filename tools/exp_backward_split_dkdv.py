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
torch.profiler for the fused launch and for every split pair of CONFIGS, and the split
gradients against the fused ones.
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

CONFIGS = (  # (BLOCK_M, BLOCK_N, warps, stages) of the dV launch, then of the dK launch
    ((64, 64, 8, 2), (64, 64, 8, 2)),
    ((64, 128, 8, 2), (32, 64, 8, 2)),
    ((32, 128, 8, 2), (32, 128, 8, 2)),
    ((64, 64, 8, 2), (32, 64, 8, 2)),
    ((32, 64, 4, 2), (32, 64, 4, 2)),
    ((64, 128, 8, 2), (64, 64, 8, 2)),
)


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
    jobs = sorted({("dv", pair[0]) for pair in CONFIGS} | {("dk", pair[1]) for pair in CONFIGS})
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


def kernel_ms(run, repeats: int = 10) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:40]
            totals[name] = totals.get(name, 0.0) + event.device_time / repeats / 1e3
    return totals


def on_gpu(out: Path, shape=(4, 8, 4096, 256), device="cuda", timer=None) -> None:
    """shape (B, H, N, D): the backward grid's D 256 cell; device and timer (kernel_ms) are
    parameters so that a CPU smoke run can take a small shape."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_backward import load_module  # the grid cell's module, with its tuned configs

    kernel_ms_of = timer or kernel_ms
    rows = []
    for causal in (False, True):
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4))
        module = load_module(shape[-1], causal)

        def gradients(module=module, q=q, k=k, v=v, dout=dout):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            module.attention(*leaves).backward(dout)
            return leaves[1].grad.float(), leaves[2].grad.float()

        fused = gradients()
        rows.append(
            {
                "causal": causal,
                "split": None,
                "config": module.BWD_DKDV_CONFIG,
                "kernels_ms": kernel_ms_of(gradients),
            }  # fmt: skip
        )
        print(rows[-1], flush=True)
        for pair in CONFIGS:
            module.BWD_DKDV_SPLIT = tuple(as_config(config) for config in pair)
            try:
                split = gradients()
                errors = [
                    ((a - b).abs().max() / b.abs().max()).item()
                    for a, b in zip(split, fused, strict=True)
                ]
                row = {"causal": causal, "split": pair, "kernels_ms": kernel_ms_of(gradients),
                       "relative_difference_dk_dv": errors}  # fmt: skip
            except Exception as exc:  # a pair that does not fit: reported, the others run
                row = {"causal": causal, "split": pair, "error": str(exc)[:300]}
            finally:
                module.BWD_DKDV_SPLIT = None
            rows.append(row)
            print(row, flush=True)
    result = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp_backward_split_dkdv.json").write_text(json.dumps(result, indent=1))


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
