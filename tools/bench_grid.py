"""The FlashAttention grid, forward and backward, through attngen's public function beside
FlashAttention-4, cuDNN, FA2 and compiled Flex, in one process on the same inputs.

Columns: `attngen.flash_attn_func(q, k, v, causal=c)` ([B, N, H, D]; attngen_det passes
deterministic=True, backward only), FA4 (`flash_attn.cute.flash_attn_func`, [B, N, H, D]), torch
SDPA with the cuDNN and flash (FA2) backends and `torch.compile(flex_attention)` (causal block
mask), these three on the transposed [B, H, N, D] views. bf16, D 64/128/256, N 1k/4k/16k,
B = 16384 / N, H = 2048 / D, causal and not; FLOPs = 4*B*H*N*N*D (halved when causal), backward
2.5x; `do_bench` medians. With the backward measured, the forward is timed as training runs it
(grad enabled) and backward = (forward + backward) - forward; with --no-backward the forward runs
under no_grad. In a cell every implementation is timed forward, then every one forward + backward,
so host drift hits all alike, in --rounds rounds (3), each starting at the next implementation:
a cell's figures are the medians over the rounds, whose values are kept (`*_ms_rounds`; one H100
read the same backward 10.5 and 12.8 ms in one process, 2026-12-07) and whose spread the table
reports last. Before timing, each output is compared with cuDNN's (max abs diff;
gradients: max abs diff over the reference's max abs); above 2e-2 it is flagged ("!") and left out
of the ratios. Peak memory: the forward (+ backward) peak above what was allocated before.
attngen's cells record `last_dispatch()` (module and forward kernel), the backward's path
(`backward_path()` below), that module's backward timed alone ("module_bwd_ms",
module_backward_ms) and its forward timed once
more after every other ("fwd_ms_again": a slow first timing that recovers is the neighbours' doing,
not the kernel's). A missing or refusing implementation is recorded with its reason. The JSON is
rewritten after every cell; --budget-s stops starting cells after that many seconds. On a CUDA
machine, from the repository root (FA4 on the path: `source tools/gpu_fa4.sh`):

    PYTHONPATH=. python tools/bench_grid.py --out DIR [--d 128 --n 16384 --causal 1]
        [--impls attngen,fa4,cudnn] [--no-backward] [--rep-ms 100] [--rounds 3] [--budget-s 500]

Writes DIR/bench_grid.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.metadata
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import triton

import attngen
from attngen.runtime import last_backward
from attngen.runtime.registry import current_registry

HEAD_DIMS = (64, 128, 256)
SEQLENS = (1024, 4096, 16384)
TOKENS, WIDTH = 16384, 2048
IMPLS = ("attngen", "attngen_det", "fa4", "cudnn", "fa2", "flex")
FORWARD_COLUMNS = ("attngen", "fa4", "cudnn", "fa2", "flex")  # attngen_det: same forward call
FLAG = 2e-2
DEVICE = "cuda"


def flops(head_dim: int, seqlen: int, causal: bool) -> float:
    batch, heads = TOKENS // seqlen, WIDTH // head_dim
    return 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
        return out.transpose(1, 2)

    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict = {}

    def run(q, k, v, causal):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        if not causal:
            return compiled(qh, kh, vh).transpose(1, 2)
        n = q.shape[1]
        if n not in masks:
            masks[n] = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n)
        return compiled(qh, kh, vh, block_mask=masks[n]).transpose(1, 2)

    return run


def _fa4():
    from flash_attn.cute import flash_attn_func

    def run(q, k, v, causal):
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out  # (out, lse)

    return run


def implementations(names) -> dict:
    """name -> fn(q, k, v, causal) -> out [B, N, H, D], or the reason it cannot run."""
    from torch.nn.attention import SDPBackend

    makers = {
        "attngen": lambda: lambda q, k, v, c: attngen.flash_attn_func(q, k, v, causal=c),
        "attngen_det": lambda: (
            lambda q, k, v, c: attngen.flash_attn_func(q, k, v, causal=c, deterministic=True)
        ),
        "fa4": _fa4,
        "cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION),
        "fa2": lambda: _sdpa(SDPBackend.FLASH_ATTENTION),
        "flex": _flex,
    }
    impls: dict = {}
    for name in names:
        try:
            impls[name] = makers[name]()
        except Exception as exc:  # noqa: BLE001 - recorded, the others still run
            impls[name] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    return impls


def median_ms(fn, rep_ms: int) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench)."""
    warmup = max(10, rep_ms // 4)
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep_ms, return_mode="median"))


def closures(fn, q, k, v, dout, causal, backward: bool):
    """(forward, forward + backward) closures on the cell's tensors; grads reset in the latter."""

    def fwd():
        with torch.set_grad_enabled(backward):
            return fn(q, k, v, causal)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        out = fn(q, k, v, causal)
        out.backward(dout)
        return out.detach(), (q.grad, k.grad, v.grad)

    return fwd, fwd_bwd


def backward_path() -> str | None:
    """The latest backward call's path (atomic or deterministic) and, where its module has
    the Gluon dK/dV kernel, that module's backward_path()."""
    run = last_backward()
    if run is None:
        return None
    module = current_registry().module(run.key)
    gluon = getattr(module, "backward_path", None)  # modules without the Gluon kernel lack it
    return f"{run.path}: {gluon()}" if gluon else run.path


def module_backward_ms(q, k, v, dout, causal, deterministic: bool, rep_ms: int) -> float:
    """The backward of the module the last backward call ran, alone: its attention_backward on
    the [B, H, N, D] views, with one forward's out and LSE (as tools/ab_templates.py times a
    kernel change). Beside the cell's (forward + backward) - forward, it says whether a slow
    backward is the module's kernels or what surrounds them in a training step."""
    module = current_registry().module(last_backward().key)
    with torch.no_grad():
        out, lse, _ = attngen.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    views = [t.detach().transpose(1, 2) for t in (dout, q, k, v, out)]
    return median_ms(lambda: module.attention_backward(*views, lse, deterministic=deterministic),
                     rep_ms)  # fmt: skip


def step_kernels(step) -> dict:
    """The five longest GPU kernels of one training step (us, torch.profiler over three): which
    kernels a cell's step ran, beside module_bwd_ms (a step slower than its module's backward
    alone, with the same kernels, is the process; with others, the route)."""
    from profile_decode_graph import kernel_times  # tools/, beside this script

    kernels = sorted(kernel_times(step, repeats=3).items(), key=lambda kv: -kv[1])
    return {name[:100]: round(us, 1) for name, us in kernels[:5]}


def probe(fn, q, k, v, dout, causal, backward: bool):
    """After a warm-up call (JIT compile, autotune): one call's output, gradients (or None) and
    the peak MiB it allocated above what was allocated before it."""
    fwd, fwd_bwd = closures(fn, q, k, v, dout, causal, backward)
    call = fwd_bwd if backward else (lambda: (fwd().detach(), None))
    call()
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, grads = call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    q.grad = k.grad = v.grad = None
    return out, grads, peak


def diffs(out, grads, ref) -> dict:
    """Max abs diff of the output and max relative diff of the gradients against cuDNN's."""
    if ref is None:
        return {}
    result = {"out_diff": float((out.float() - ref[0].float()).abs().max())}
    if grads is not None and ref[1] is not None:
        result["grad_diff"] = max(
            float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30))
            for g, r in zip(grads, ref[1], strict=True)
        )
    result["flagged"] = any(value > FLAG for value in result.values())
    return result


def check_all(impls, q, k, v, dout, causal, backward) -> tuple[dict, dict]:
    """Warm up and check every implementation (cuDNN first: the reference); -> (results, ready)."""
    results: dict = {}
    ready: dict = {}
    ref = None
    for name in sorted(impls, key=lambda n: n != "cudnn"):
        fn = impls[name]
        if isinstance(fn, str):
            results[name] = {"skipped": fn}
            continue
        try:
            out, grads, peak = probe(fn, q, k, v, dout, causal, backward)
            if name == "cudnn":
                ref = (out, grads)
            results[name] = {"peak_mib": peak, **diffs(out, grads, ref)}
            ready[name] = fn
        except Exception as exc:  # noqa: BLE001 - skip the implementation, keep its reason
            results[name] = {
                "skipped": f"{type(exc).__name__}: {exc}"[:300],
                "trace": traceback.format_exc(limit=3)[-1500:],
            }
        torch.cuda.empty_cache()
    return results, ready


def run_cell(impls, head_dim, seqlen, causal, args) -> dict:
    batch, heads = TOKENS // seqlen, WIDTH // head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim * seqlen + causal)
    backward = not args.no_backward
    shape = (batch, seqlen, heads, head_dim)
    q, k, v, dout = (
        torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_(backward)
    results, ready = check_all(impls, q, k, v, dout, causal, backward)
    work = flops(head_dim, seqlen, causal)
    for turn in range(args.rounds):  # each round starts at the next implementation
        names = list(ready)[turn % len(ready) :] + list(ready)[: turn % len(ready)]
        time_round(ready, results, names, (q, k, v, dout, causal, backward), args.rep_ms)
    for name in ready:  # which kernels served the calls; the forward again, the others done
        fwd, step = closures(ready[name], q, k, v, dout, causal, backward)
        profiled = backward and results[name].get("fwd_bwd_rounds")
        if name == "fa4" and profiled:
            try:  # its main kernels beside attngen's (_kernel_lines)
                results[name]["step_kernels_us"] = step_kernels(step)
            except Exception as exc:  # noqa: BLE001 - recorded, the cell still completes
                results[name]["error"] = f"step kernels: {type(exc).__name__}: {exc}"[:300]
        if name.startswith("attngen"):
            if profiled:
                step()
                results[name]["backward"] = backward_path()
                results[name]["step_kernels_us"] = step_kernels(step)
                try:
                    results[name]["module_bwd_ms"] = module_backward_ms(
                        q, k, v, dout, causal, name == "attngen_det", args.rep_ms
                    )
                except Exception as exc:  # noqa: BLE001 - recorded, the cell still completes
                    results[name]["error"] = f"module backward: {type(exc).__name__}: {exc}"[:300]
            chosen = attngen.last_dispatch()  # None only if no call went through the registry
            if chosen is not None:
                results[name]["dispatch"] = {"module": chosen.module, "forward": chosen.forward}
            results[name]["fwd_ms_again"] = median_ms(fwd, args.rep_ms)
    for res in results.values():
        rounds = {phase: res.pop(f"{phase}_rounds", []) for phase in ("fwd", "fwd_bwd")}
        if rounds["fwd"]:
            res["fwd_ms"], res["fwd_ms_rounds"] = statistics.median(rounds["fwd"]), rounds["fwd"]
            res["fwd_tflops"] = work / res["fwd_ms"] / 1e9
        if rounds["fwd_bwd"] and len(rounds["fwd_bwd"]) == len(rounds["fwd"]):
            res["fwd_bwd_ms"] = statistics.median(rounds["fwd_bwd"])
            each = [max(b - f, 1e-6) for f, b in zip(rounds["fwd"], rounds["fwd_bwd"], strict=True)]
            res["bwd_ms"], res["bwd_ms_rounds"] = statistics.median(each), each
            res["bwd_tflops"] = 2.5 * work / res["bwd_ms"] / 1e9
    cell = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal, "batch": batch}
    cell["l2_persisting_bytes"] = l2_persisting_bytes()
    return {**cell, "heads": heads, "results": results}


def time_round(ready, results, names, tensors, rep_ms: int) -> None:
    """One round: every implementation forward, then every one forward + backward, in the
    order of `names`; each median appended to its implementation's `<phase>_rounds`."""
    q, k, v, dout, causal, backward = tensors
    for phase in ("fwd", "fwd_bwd") if backward else ("fwd",):
        for name in names:
            res = results[name]
            if "error" in res:
                continue
            fwd, fwd_bwd = closures(ready[name], q, k, v, dout, causal, backward)
            try:
                value = median_ms(fwd if phase == "fwd" else fwd_bwd, rep_ms)
                res.setdefault(f"{phase}_rounds", []).append(value)
            except Exception as exc:  # noqa: BLE001 - recorded, the others still run
                res["error"] = f"{phase}: {type(exc).__name__}: {exc}"[:300]


def l2_persisting_bytes() -> int | None:
    """The device's persisting-L2 set-aside (cudaLimitPersistingL2CacheSize) after the cell:
    a library in the process that sets it aside shrinks the L2 every other kernel sees (the
    causal N 16k backward cells read slower with FA4 in the process; this says whether FA4
    touched it). None where the CUDA runtime library cannot be loaded."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(name)
        except OSError:
            continue
        value = ctypes.c_size_t(0)
        return value.value if runtime.cudaDeviceGetLimit(ctypes.byref(value), 6) == 0 else None
    return None


def _ratio(cell: dict, other: str, key: str) -> float | None:
    """attngen's TFLOP/s over other's in this cell; None where either is missing or flagged."""
    ours, theirs = (cell["results"].get(name, {}) for name in ("attngen", other))
    if ours.get("flagged") or theirs.get("flagged") or not (ours.get(key) and theirs.get(key)):
        return None
    return ours[key] / theirs[key]


def _fmt(value: float | None, width: int, digits: int = 0) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else " " * (width - 1) + "-"


def summary(report: dict) -> str:
    """Per cell TFLOP/s forward and backward, attngen's ratios to FA4 and cuDNN, geomeans."""
    sides = [("fwd", FORWARD_COLUMNS)] + [("bwd", IMPLS)] * report["backward"]
    keys = [f"{side}_tflops" for side, _ in sides]
    head = "D    N     causal"
    for side, names in sides:
        head += f" | {side} " + " ".join(f"{name.replace('attngen_', ''):>7}" for name in names)
    lines = ["TFLOP/s, bf16 (! = differs from cuDNN > 2e-2, left out of the ratios)"]
    lines.append(
        head
        + "".join(f" | /{o} " + " ".join(f"{k[:3]:>5}" for k in keys) for o in ("fa4", "cudnn"))
    )
    ratios: dict = {(other, key): [] for other in ("fa4", "cudnn") for key in keys}
    for cell in report["cells"]:
        row = f"{cell['head_dim']:<4} {cell['seqlen']:<5} {'yes' if cell['causal'] else 'no':6}"
        for (side, names), key in zip(sides, keys, strict=True):
            res = [cell["results"].get(name, {}) for name in names]
            row += f" | {side} " + " ".join(
                _fmt(r.get(key), 6) + ("!" if r.get("flagged") else " ") for r in res
            )
        for other in ("fa4", "cudnn"):
            pair = [_ratio(cell, other, key) for key in keys]
            row += f" | /{other} " + " ".join(_fmt(ratio, 5, 2) for ratio in pair)
            for key, ratio in zip(keys, pair, strict=True):
                if ratio is not None:
                    ratios[other, key].append(ratio)
        lines.append(row)
    for (other, key), values in ratios.items():
        if values:
            mean = geomean(values)
            lines.append(f"geomean attngen/{other} {key[:3]}: {mean:.3f} over {len(values)} cells")
    cells = report["cells"]
    return "\n".join(lines + _module_lines(cells) + _kernel_lines(cells) + _spread_lines(cells))


def main_kernels(kernels: dict) -> dict:
    """A step's forward and backward main kernels' times (us), by name: the longest with
    "fwd", and the longest with "bwd" that is not a pre- or postprocess (attngen's dQ pass,
    FA4's flash_bwd_preprocess / postprocess)."""
    found: dict = {}
    for name, us in kernels.items():
        low = name.lower()
        side = "fwd" if "fwd" in low else "bwd" if "bwd" in low else None
        if side == "bwd" and any(word in low for word in ("process", "_dq_")):
            continue
        if side is not None and us > found.get(side, 0.0):
            found[side] = us
    return found


def _kernel_lines(cells: list[dict]) -> list[str]:
    """Per cell, FA4's main kernel time over attngen's (> 1: attngen's faster), forward and
    backward, from one profiled step each: the kernels apart from the small ones and the
    host (the issue's per-kernel account)."""
    lines, ratios = [], {"fwd": [], "bwd": []}
    for cell in cells:
        ours, theirs = (main_kernels(cell["results"].get(name, {}).get("step_kernels_us", {}))
                        for name in ("attngen", "fa4"))  # fmt: skip
        pair = {
            side: theirs[side] / ours[side] for side in ratios if side in ours and side in theirs
        }
        for side, ratio in pair.items():
            ratios[side].append(ratio)
        if pair:
            where = (
                f"{cell['head_dim']:<4} {cell['seqlen']:<5} {'yes' if cell['causal'] else 'no':6}"
            )
            lines.append(f"{where} main kernels fa4/attngen: " + ", ".join(
                f"{side} {ratio:.2f}" for side, ratio in pair.items()))  # fmt: skip
    means = [f"{side} {geomean(v):.3f}" for side, v in ratios.items() if v]
    return lines + ([f"geomean main kernels fa4/attngen: {', '.join(means)}"] if means else [])


def _spread_lines(cells: list[dict]) -> list[str]:
    """Per implementation, the median over cells of its rounds' spread ((max - min) / median):
    a ratio closer to 1 than this is within the noise of one implementation's own timings."""
    lines = []
    for side in ("fwd", "bwd"):
        spreads: dict = {}
        for cell in cells:
            for name, res in cell["results"].items():
                rounds = res.get(f"{side}_ms_rounds") or []
                if len(rounds) > 1:
                    spread = (max(rounds) - min(rounds)) / statistics.median(rounds)
                    spreads.setdefault(name, []).append(spread)
        text = ", ".join(f"{n} {statistics.median(v):.1%}" for n, v in spreads.items())
        lines += [f"median spread of the rounds, {side}: {text}"] if text else []
    return lines


def _module_lines(cells: list[dict]) -> list[str]:
    """attngen's backward in the step over its module's backward alone, and the latter's
    ratio to FA4's: a step that adds time to the kernels shows here."""
    ours = [(c["results"]["attngen"], c["results"].get("fa4", {})) for c in cells
            if "module_bwd_ms" in c["results"].get("attngen", {})]  # fmt: skip
    ratios = {
        "attngen step backward/module backward alone": [
            a["bwd_ms"] / a["module_bwd_ms"] for a, _ in ours if "bwd_ms" in a
        ],
        "attngen module backward alone vs fa4": [
            f["bwd_ms"] / a["module_bwd_ms"] for a, f in ours if "bwd_ms" in f
        ],
    }
    return [f"geomean {name}: {geomean(values):.3f}" for name, values in ratios.items() if values]


def metadata(args) -> dict:
    versions = {"torch": torch.__version__, "triton": triton.__version__}
    versions["attngen"] = attngen.__version__
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "versions": versions,
        "rep_ms": args.rep_ms,
        "backward": not args.no_backward,
    }


def _list(kind):
    return lambda text: tuple(kind(item) for item in text.split(",") if item)


def _bool(text: str) -> bool:
    if text.lower() not in ("0", "1", "false", "true", "no", "yes"):
        raise argparse.ArgumentTypeError(f"causal must be 0/1/false/true/no/yes, got {text!r}")
    return text.lower() in ("1", "true", "yes")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--d", type=_list(int), default=HEAD_DIMS, help="head dims, e.g. 64,128")
    parser.add_argument("--n", type=_list(int), default=SEQLENS, help="seqlens, e.g. 16384")
    parser.add_argument("--causal", type=_list(_bool), default=(False, True), help="e.g. 1")
    parser.add_argument("--impls", type=_list(str), default=IMPLS, help=",".join(IMPLS))
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every timing")
    parser.add_argument("--budget-s", type=float, default=None, help="no new cell after this")
    args = parser.parse_args(argv)
    unknown = [name for name in args.impls if name not in IMPLS]
    if unknown:
        parser.error(f"--impls: unknown {unknown}; allowed: {', '.join(IMPLS)}")
    if args.no_backward:
        args.impls = tuple(name for name in args.impls if name != "attngen_det")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.monotonic()
    # Flex compiles once per cell; past dynamo's default limit (8) it would silently run the
    # eager path (17 TFLOP/s, tens of GB) while the table still said "flex".
    torch._dynamo.config.cache_size_limit = 1000
    torch._dynamo.config.accumulated_cache_size_limit = 1000
    impls = implementations(args.impls)
    report = {**metadata(args), "cells": []}
    args.out.mkdir(parents=True, exist_ok=True)
    grid = [(d, n, c) for d in args.d for n in args.n for c in args.causal]
    for index, (head_dim, seqlen, causal) in enumerate(grid):
        if args.budget_s is not None and time.monotonic() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {index} of {len(grid)} cells done")
            break
        report["cells"].append(run_cell(impls, head_dim, seqlen, causal, args))
        (args.out / "bench_grid.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"cell {index + 1}/{len(grid)} done, {time.monotonic() - start:.0f} s", flush=True)
    print(f"{report['gpu']}, {report['versions']}, {report['date']}")
    print(summary(report))


if __name__ == "__main__":
    main()
