"""Each GPU kernel's time in one forward + backward of attngen and compiled Flex, at chosen cells
of the backward grid (tools/bench_backward.py's modules and anchors, the same inputs).

bench_backward gives a cell's totals; this says which launches make them, e.g. why a cell's
ratio to Flex differs from its neighbours' (the gradient kernels, the delta pre-pass, the
forward). Usage on a CUDA machine, from the repository root:

    PYTHONPATH=. python tools/profile_backward_cells.py --out OUT_DIR [--cells 64:1024:full ...]

Writes OUT_DIR/profile_backward_cells.json and prints a table per cell last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backward import TOKENS, WIDTH, implementations  # noqa: E402
from profile_decode_graph import kernel_times  # noqa: E402

DEFAULT_CELLS = ("64:1024:full", "64:4096:full", "128:4096:full")
STEPS = 10


def profile_cell(head_dim: int, seqlen: int, causal: bool) -> dict:
    batch, heads = TOKENS // seqlen, WIDTH // head_dim
    shape = (batch, heads, seqlen, head_dim)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    cell: dict = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal, "impls": {}}
    impls = implementations(head_dim, causal, use_flex=True)
    for name in ("attngen", "flex"):
        forward = impls[name]
        if isinstance(forward, str):
            cell["impls"][name] = {"skipped": forward}
            continue

        def step(forward=forward):
            out = forward(q, k, v)
            torch.autograd.grad(out, (q, k, v), dout)

        step()  # compile outside the profile
        times = {kernel: us / 1e3 for kernel, us in kernel_times(step, STEPS).items()}
        times = dict(sorted(times.items(), key=lambda item: -item[1]))
        cell["impls"][name] = {"kernels_ms": times, "total_ms": sum(times.values())}
    return cell


def table(cell: dict) -> str:
    mask = "causal" if cell["causal"] else "full"
    lines = [f"D {cell['head_dim']} N {cell['seqlen']} {mask}: device ms per fwd + bwd"]
    for name, result in cell["impls"].items():
        if "skipped" in result:
            lines.append(f"  {name}: skipped ({result['skipped'][:80]})")
            continue
        lines.append(f"  {name}: {result['total_ms']:.3f} ms")
        lines += [f"    {ms:7.3f}  {kernel}" for kernel, ms in result["kernels_ms"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cells", nargs="*", default=list(DEFAULT_CELLS), help="D:N:full|causal")
    args = parser.parse_args()
    torch.manual_seed(0)
    cells = []
    for text in args.cells:
        head_dim, seqlen, mask = text.split(":")
        cells.append(profile_cell(int(head_dim), int(seqlen), mask == "causal"))
    report = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cells": cells,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_backward_cells.json").write_text(json.dumps(report, indent=1))
    print("\n".join(table(cell) for cell in cells))


if __name__ == "__main__":
    main()
