"""Where a training step's time goes: each GPU kernel's time in attngen.flash_attn_func's forward
+ backward at chosen FlashAttention-grid cells, beside the step's wall time and its host time.

The grid (tools/bench_grid.py) gives a cell's totals; this says whether a slow cell is its
kernels (their sum near the step's time) or the host (the step's enqueue near its time, the
GPU idle between launches). Shapes as the grid's: [B, N, H, D] bf16, B = 16384 / N,
H = 2048 / D. Usage on a CUDA machine, from the repository root:

    PYTHONPATH=. python tools/profile_step.py --out OUT [--cells 128:1024:1 64:1024:1]
        [--deterministic]

Writes OUT/profile_step.json and prints one block per cell.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

import attngen
from attngen.runtime import last_backward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_templates import enqueue_us  # noqa: E402
from profile_decode_graph import kernel_times  # noqa: E402


def _step_closure(d: int, n: int, causal: bool, deterministic: bool):
    batch, heads = max(1, 16384 // n), 2048 // d
    shape = (batch, n, heads, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        q.grad = k.grad = v.grad = None
        out = attngen.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        out.backward(dout)

    return step


def profile_cell(d: int, n: int, causal: bool, deterministic: bool) -> dict:
    step = _step_closure(d, n, causal, deterministic)
    step()
    kernels = kernel_times(step, repeats=10)
    return {
        "D": d,
        "N": n,
        "causal": causal,
        "deterministic": deterministic,
        "backward": str(last_backward()),
        "step_us": 1e3 * triton.testing.do_bench(step, rep=200, return_mode="median"),
        "host_us": enqueue_us(step, calls=10),
        "kernel_sum_us": sum(kernels.values()),
        "kernels_us": {name: round(us, 1) for name, us in sorted(kernels.items(),
                                                                  key=lambda kv: -kv[1])},
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cells", nargs="+", default=["128:1024:1", "64:1024:1"],
                        help="D:N:causal")  # fmt: skip
    parser.add_argument("--deterministic", action="store_true", help="also deterministic=True")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for text in args.cells:
        d, n, causal = (int(x) for x in text.split(":"))
        for det in (False, True) if args.deterministic else (False,):
            cell = profile_cell(d, n, bool(causal), det)
            results.append(cell)
            (args.out / "profile_step.json").write_text(json.dumps(results, indent=1))
    for cell in results:
        print(f"D {cell['D']} N {cell['N']} causal {cell['causal']} det {cell['deterministic']}: "
              f"step {cell['step_us']:.0f} us, host {cell['host_us']:.0f} us, kernels "
              f"{cell['kernel_sum_us']:.0f} us ({cell['backward']})")  # fmt: skip
        for name, us in cell["kernels_us"].items():
            print(f"    {us:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
