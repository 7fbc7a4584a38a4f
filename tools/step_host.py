"""Where a training step's host time goes, at FlashAttention-grid cells: the operations that
synchronise with the GPU (torch's sync debug mode, with the stack that issued each), each
half's enqueue time, the host time inside the module's and the ops layer's functions
(WRAPPED, inclusive), and with --profile cProfile's and torch.profiler's tables.

A step whose wall time is near its kernels' sum plus its host time, rather than the larger of
the two, waits on the GPU somewhere: the sync list says where. Shapes as the grid's
(tools/bench_grid.py). Usage on a CUDA machine, from the repository root:

    PYTHONPATH=. python tools/step_host.py --out OUT [--cells 128:1024:1] [--fa4] [--profile]
        [--dynamo] [--after-profiler] [--ab-encodings]

--ab-encodings also runs attngen's step with its module encoding every TMA descriptor at
every launch (as Triton's launcher does; the module keeps each encoding otherwise), the two
alternating, twice each.

The host times of one H100 machine moved by up to 150 us between runs of the same code
(2026-12-06): compare trees in one call, several runs each.

Writes OUT/step_host.json and prints one block per cell.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
import traceback
import warnings
from pathlib import Path

import torch
import triton

import attngen


def _tensors(d: int, n: int):
    batch, heads = max(1, 16384 // n), 2048 // d
    shape = (batch, n, heads, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    return q, k, v, torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def _function(name: str):
    if name == "fa4":
        from flash_attn.cute import flash_attn_func

        return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)[0]
    return lambda q, k, v, causal: attngen.flash_attn_func(q, k, v, causal=causal)


def syncs(step) -> list[str]:
    """The stacks (attngen's and torch's frames) of every synchronising call in one step."""
    found: list[str] = []

    def record(message, *args, **kwargs):
        if "prototype feature" in str(message):  # the mode's own notice, not a sync
            return
        frames = [f for f in traceback.format_stack(limit=14)[:-2] if "warnings" not in f]
        found.append(f"{message}\n" + "".join(frames[-8:]))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        previous, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous
    torch.cuda.synchronize()
    return found


def halves_us(fn, q, k, v, dout, causal, calls: int = 10) -> dict:
    """Best-of-calls host time of the forward (grad on) and of the backward alone, each from
    a synchronised start, so neither waits behind the other's kernels."""
    forward, backward = float("inf"), float("inf")
    for _ in range(calls):
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(q, k, v, causal)
        forward = min(forward, time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out.backward(dout)
        backward = min(backward, time.perf_counter() - start)
    torch.cuda.synchronize()
    return {"forward_host_us": round(forward * 1e6, 1),
            "backward_host_us": round(backward * 1e6, 1)}  # fmt: skip


def profile_top(step, steps: int = 50, top: int = 25) -> str:
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(2 * top)
    return text.getvalue()


def op_table(step, steps: int = 20, rows: int = 30) -> str:
    """torch.profiler's CPU table over `steps` steps: each operator's and autograd node's host
    time (self time first), so the torch calls a step makes are counted and weighed."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


WRAPPED = ("_gluon_bwd_route", "_gluon_bwd_buffers", "_gluon_bwd_run", "_launch", "_backward",
           "attention_backward", "_gradients", "_save", "attention_flash_out", "_run_plan",
           "_gluon_run", "_gluon_descriptor", "_kernel_scale")  # fmt: skip


def wrapped_us(step, steps: int = 50) -> dict:
    """Mean host microseconds a step spends in each of the module's WRAPPED functions and the
    runtime's ops layer (inclusive, perf_counter around each call), and calls a step."""
    import attngen.runtime.ops as ops
    from attngen.runtime.registry import current_registry

    module = current_registry().module(attngen.last_dispatch().key)
    totals: dict = {}

    def wrap(owner, name):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                total = totals.setdefault(name, [0.0, 0])
                total[0] += time.perf_counter() - start
                total[1] += 1

        setattr(owner, name, timed)
        return inner

    saved = [(owner, name, wrap(owner, name))
             for owner, names in ((module, WRAPPED), (ops, ("prefill", "run_prefill",
                                  "prefill_backward", "_prefill_grads")))
             for name in names if hasattr(owner, name)]  # fmt: skip
    try:
        torch.cuda.synchronize()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        for owner, name, inner in saved:
            setattr(owner, name, inner)
    return {name: (round(t / steps * 1e6, 1), n / steps) for name, (t, n) in totals.items()}


class _Forgetful(dict):
    """A module's _ENCODINGS that keeps nothing: every launch encodes its descriptors."""

    def __setitem__(self, key, value) -> None:
        pass


def measure(name: str, d: int, n: int, causal: bool, profile: bool) -> dict:
    fn = _function(name)
    q, k, v, dout = _tensors(d, n)

    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v, causal).backward(dout)

    step()
    if name.startswith("attngen"):
        from attngen.runtime.registry import current_registry

        module = current_registry().module(attngen.last_dispatch().key)
        module._ENCODINGS = _Forgetful() if name == "attngen_encode_each" else {}
    wall = 1e3 * triton.testing.do_bench(step, rep=200, return_mode="median")
    return {"impl": name, "D": d, "N": n, "causal": causal, "step_us": round(wall, 1),
            **halves_us(fn, q, k, v, dout, causal), "syncs": syncs(step),
            "profile": (profile_top(step) + op_table(step)) if profile else "",
            "wrapped_us": wrapped_us(step) if name.startswith("attngen") else {}}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cells", nargs="+", default=["128:1024:1"], help="D:N:causal")
    parser.add_argument("--fa4", action="store_true", help="FA4's step beside attngen's")
    parser.add_argument("--profile", action="store_true", help="cProfile attngen's steps")
    parser.add_argument("--dynamo", action="store_true", help="import torch._dynamo first")
    parser.add_argument("--ab-encodings", action="store_true",
                        help="attngen also encoding its TMA descriptors each launch")  # fmt: skip
    parser.add_argument("--after-profiler", action="store_true",
                        help="run torch.profiler over a few steps first")  # fmt: skip
    args = parser.parse_args(argv)
    if args.fa4:  # imported before any measurement: whether its import slows attngen's host
        import flash_attn.cute  # noqa: F401
    if args.dynamo:
        torch._dynamo.config.cache_size_limit = 1000  # as tools/bench_grid.py does
    if args.after_profiler:
        from torch.profiler import ProfilerActivity, profile

        q, k, v, dout = _tensors(128, 1024)
        with profile(activities=[ProfilerActivity.CUDA]):
            attngen.flash_attn_func(q, k, v, causal=True).backward(dout)
    args.out.mkdir(parents=True, exist_ok=True)
    report = []
    for cell in args.cells:
        d, n, causal = (int(part) for part in cell.split(":"))
        names = ["attngen"] + ["fa4", "attngen"] * args.fa4
        names += ["attngen_encode_each", "attngen", "attngen_encode_each"] * args.ab_encodings
        for name in names:
            row = measure(name, d, n, bool(causal), args.profile and name == "attngen")
            report.append(row)
            print(f"== {name} D {d} N {n} causal {bool(causal)}: step {row['step_us']} us, "
                  f"forward host {row['forward_host_us']} us, backward host "
                  f"{row['backward_host_us']} us, {len(row['syncs'])} syncs")  # fmt: skip
            print("wrapped (us a step, calls a step):", row["wrapped_us"])
            for stack in row["syncs"][:4]:
                print(stack)
            if row["profile"]:
                print(row["profile"])
    (args.out / "step_host.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
