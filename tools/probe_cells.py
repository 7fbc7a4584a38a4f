"""Where a grid cell's forward time goes: the kernels one `attngen.flash_attn_func` call
launches, with their GPU time, beside the call's do_bench median and its host time (20 calls
enqueued back to back: near the GPU time when a call waits for the device), with grad enabled
(as tools/bench_grid.py times training's forward) and under no_grad; forward_path() and
last_dispatch() say which module and kernel served it. The cells: the grid's slow N 1k ones
(D 128 causal, D 256 both) and a control (D 128 not causal), then D 256 at N 2k and 4k.

    PYTHONPATH=. python tools/probe_cells.py --out DIR [--backward]

Writes DIR/probe_cells.json and prints one line per cell and mode. --backward probes one
backward per cell instead (deterministic=False; its median, host time, kernels and which
dK/dV kernel ran: the sm90 modules' Gluon one but for causal calls with fewer than 1024 keys)
into DIR/probe_cells_backward.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import attngen
from attngen.runtime import last_backward
from attngen.runtime.registry import current_registry

TOKENS, WIDTH = 16384, 2048
CELLS = [(128, 1024, False), (128, 1024, True), (256, 1024, False), (256, 1024, True),
         (256, 2048, False), (256, 4096, False)]  # fmt: skip


def kernels_of(fn) -> list[tuple[str, float]]:
    """(kernel name, GPU microseconds) of one call of fn, after a warm call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name[:80], round(e.device_time, 1)) for e in prof.events()
            if e.device_type.name == "CUDA" and e.device_time > 0]  # fmt: skip


def timed(fn) -> tuple[float, float]:
    """(do_bench median ms, host microseconds a call over 20 enqueued back to back)."""
    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        fn()
    host_us = (time.perf_counter() - start) / 20 * 1e6
    torch.cuda.synchronize()
    return ms, host_us


def probe_backward(head_dim: int, seqlen: int, causal: bool) -> dict:
    """One backward of a flash_attn_func forward (deterministic=False, the graph retained):
    its median, host time, kernels and which dK/dV kernel ran (backward_path())."""
    batch, heads = TOKENS // seqlen, WIDTH // head_dim
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda",
                                 dtype=torch.bfloat16) for _ in range(4))  # fmt: skip
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = attngen.flash_attn_func(*leaves, causal=causal, deterministic=False)

    def bwd():
        for t in leaves:
            t.grad = None
        out.backward(dout, retain_graph=True)

    ms, host_us = timed(bwd)
    run = last_backward()
    module = current_registry().module(run.key) if run else None
    return {
        "head_dim": head_dim, "seqlen": seqlen, "causal": causal, "backward": True, "ms": ms,
        "tflops": 2.5 * 4 * batch * heads * seqlen**2 * head_dim * (0.5 if causal else 1.0)
        / ms / 1e9, "host_us": host_us, "path": run.path if run else None,
        "backward_path": module.backward_path() if hasattr(module, "backward_path") else None,
        "kernels": kernels_of(bwd),
    }  # fmt: skip


def probe(head_dim: int, seqlen: int, causal: bool, grad: bool) -> dict:
    batch, heads = TOKENS // seqlen, WIDTH // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=grad) for _ in range(3))  # fmt: skip

    def fwd():
        with torch.set_grad_enabled(grad):
            return attngen.flash_attn_func(q, k, v, causal=causal)

    ms, host_us = timed(fwd)
    chosen = attngen.last_dispatch()
    module = current_registry().module(chosen.key) if chosen and chosen.key else None
    return {
        "head_dim": head_dim, "seqlen": seqlen, "causal": causal, "grad": grad, "batch": batch,
        "heads": heads, "ms": ms, "tflops": 4 * batch * heads * seqlen**2 * head_dim
        * (0.5 if causal else 1.0) / ms / 1e9, "module": chosen.module if chosen else None,
        "forward": chosen.forward if chosen else None, "reason": chosen.reason if chosen else None,
        "forward_path": module.forward_path() if hasattr(module, "forward_path") else None,
        "host_us": host_us, "kernels": kernels_of(fwd),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backward", action="store_true", help="probe one backward instead")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    runs = [(cell, None) for cell in CELLS] if args.backward else [
        (cell, grad) for cell in CELLS for grad in (True, False)]  # fmt: skip
    for cell, grad in runs:
        try:
            row = probe_backward(*cell) if grad is None else probe(*cell, grad)
        except Exception as exc:  # noqa: BLE001 - recorded, the other cells still run
            row = {"cell": cell, "grad": grad, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        name = "probe_cells_backward.json" if args.backward else "probe_cells.json"
        (args.out / name).write_text(json.dumps(rows, indent=1))
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}))
        print("   ", row.get("kernels"))


if __name__ == "__main__":
    main()
