"""Backward benchmark: attngen's generated gradient kernels against SDPA's backends (cuDNN, flash,
efficient) and compiled FlexAttention, side by side in one process on the same inputs.

The FlashAttention grid: bf16, D 64/128/256, N 1k/4k/16k (batch = 16384 / N, heads = 2048 / D),
causal and not. Backward time = (forward + backward) - forward, both measured here; backward
FLOPs = 2.5 x the forward's (4 * B * H * N * N * D, halved when causal). Peak memory is the
forward + backward peak above the inputs. An anchor that errors (a backend missing for a head
dim, out of memory) is skipped with its reason in the JSON. Usage on a CUDA machine, from the
repository root:

    PYTHONPATH=. python tools/bench_backward.py --out OUT_DIR [--quick] [--no-flex] [--atomic]

--atomic times the module's two backward paths side by side against cuDNN alone (no flash,
efficient or Flex anchors): `attngen` deterministic=True (the atomics-free kernels, seven
products) and `attngen_atomic` deterministic=False (dQ by fp32 atomics, five products).
Writes OUT_DIR/bench_backward.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngen.build import plan_build
from attngen.spec import load_spec_file

HEAD_DIMS = (64, 128, 256)
SEQLENS = (1024, 4096, 16384)
TOKENS, WIDTH = 16384, 2048
SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


ROOT = Path(__file__).resolve().parent.parent
GRID_SPECS = ROOT / "tools" / "bench_specs" / "backward_grid.yaml"
TUNING = ROOT / "tuning"


def load_module(head_dim: int, causal: bool, arch: str = "sm90"):
    """The prefill module of this grid cell's spec (tools/bench_specs/backward_grid.yaml),
    built as `attngen build` builds it, with the tuning database (tuning/<arch>.json) where it
    has the cell's entries (`attngen autotune` on that file), written to a file and imported.
    Its configs say where they came from (CONFIG_SOURCE and the header)."""
    variant = f"backward_grid_d{head_dim}_{'causal' if causal else 'full'}"
    spec = next(s for s in load_spec_file(GRID_SPECS) if s.name == variant)
    tuning = TUNING if TUNING.is_dir() else None
    artifact = next(a for a in plan_build([spec], tuning) if a.entry["arch"] == arch)
    path = Path(tempfile.mkdtemp(prefix="attngen-bench-bwd-")) / f"{spec.name}.py"
    path.write_text(artifact.source)
    module_spec = importlib.util.spec_from_file_location(spec.name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[spec.name] = module
    module_spec.loader.exec_module(module)
    print(
        f"{spec.name}: forward {module.CONFIG}, dQ {module.BWD_DQ_CONFIG}, "
        f"dK/dV {module.BWD_DKDV_CONFIG if module.BWD_DKDV_SPLIT is None else 'unused'}, "
        f"split (dV, dK) {module.BWD_DKDV_SPLIT}, "
        f"atomic dK/dV {getattr(module, 'BWD_DKDV_ATOMIC_CONFIG', 'absent')}",
        flush=True,
    )
    return module


def _time(fn, reps: int) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=5, rep=reps, return_mode="median"))


def measure(forward, q, k, v, dout, reps: int) -> dict:
    """forward(q, k, v) -> out: forward ms, forward + backward ms, backward ms, peak MiB."""

    def fwd():
        with torch.no_grad():
            forward(q, k, v)

    def fwd_bwd():
        out = forward(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    fwd_bwd()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    forward_ms = _time(fwd, reps)
    total_ms = _time(fwd_bwd, reps)
    return {
        "forward_ms": forward_ms,
        "fwd_bwd_ms": total_ms,
        "backward_ms": max(total_ms - forward_ms, 1e-6),
        "peak_mib": peak,
    }


def implementations(head_dim: int, causal: bool, use_flex: bool, atomic: bool = False):
    """name -> forward(q, k, v) or the reason it cannot run. `atomic`: both of attngen's
    backward paths and cuDNN only."""
    impls: dict = {}
    try:
        module = load_module(head_dim, causal)
        impls["attngen"] = lambda q, k, v: module.attention(q, k, v, deterministic=True)
        if atomic and getattr(module, "BWD_DKDV_ATOMIC_CONFIG", None) is None:
            impls["attngen_atomic"] = "no atomic config (BWD_DKDV_ATOMIC_CONFIG None)"
        elif atomic:
            impls["attngen_atomic"] = lambda q, k, v: module.attention(q, k, v, deterministic=False)
    except Exception as exc:  # noqa: BLE001 - recorded, the other anchors still run
        impls["attngen"] = f"build failed: {exc!r}"
    for name, backend in SDPA_BACKENDS.items():
        if atomic and name != "cudnn":
            continue

        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        impls[f"sdpa_{name}"] = sdpa
    if use_flex and not atomic:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            compiled = torch.compile(flex_attention)
            masks: dict = {}

            def flex(q, k, v):
                if not causal:
                    return compiled(q, k, v)
                n = q.shape[2]
                if n not in masks:
                    masks[n] = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n)
                return compiled(q, k, v, block_mask=masks[n])

            impls["flex"] = flex
        except Exception as exc:  # noqa: BLE001
            impls["flex"] = f"unavailable: {exc!r}"
    return impls


def run(args) -> dict:
    torch.manual_seed(0)
    seqlens = SEQLENS[:2] if args.quick else SEQLENS
    cells = []
    for head_dim in HEAD_DIMS:
        for seqlen in seqlens:
            for causal in (False, True):
                batch, heads = TOKENS // seqlen, WIDTH // head_dim
                flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1)
                shape = (batch, heads, seqlen, head_dim)
                q, k, v = (
                    torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(3)
                )
                dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                cell = {
                    "head_dim": head_dim,
                    "seqlen": seqlen,
                    "causal": causal,
                    "batch": batch,
                    "heads": heads,
                    "results": {},
                }
                anchors = implementations(head_dim, causal, not args.no_flex, args.atomic)
                for name, impl in anchors.items():
                    if isinstance(impl, str):
                        cell["results"][name] = {"skipped": impl}
                        continue
                    try:
                        result = measure(impl, q, k, v, dout, args.reps)
                        result["backward_tflops"] = 2.5 * flops / result["backward_ms"] / 1e9
                        result["forward_tflops"] = flops / result["forward_ms"] / 1e9
                        cell["results"][name] = result
                    except Exception as exc:  # noqa: BLE001 - skip the anchor, keep its reason
                        cell["results"][name] = {
                            "skipped": f"{type(exc).__name__}: {str(exc)[:300]}",
                            "trace": traceback.format_exc(limit=3)[-1500:],
                        }
                    torch.cuda.empty_cache()
                cells.append(cell)
                print(_row(cell), flush=True)
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cells": cells,
    }


NAMES = ("attngen", "attngen_atomic", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex")


def _row(cell: dict) -> str:
    mask = "causal" if cell["causal"] else "full  "
    parts = [f"D{cell['head_dim']:>3} N{cell['seqlen']:>5} {mask}"]
    for name in NAMES:
        result = cell["results"].get(name, {})
        value = result.get("backward_tflops")
        parts.append(f"{value:7.1f}" if value else "    n/a")
    return " ".join(parts)


def summary(report: dict) -> str:
    lines = [
        "backward TFLOP/s (2.5x forward FLOPs), bf16; peak MiB attngen / cudnn",
        "cell               " + " ".join(f"{n[:7]:>7}" for n in NAMES),
    ]
    ratios, atomic_ratios, atomic_gain = [], [], []
    for cell in report["cells"]:
        res = cell["results"]
        peaks = " / ".join(
            f"{res.get(n, {}).get('peak_mib', float('nan')):.0f}" for n in ("attngen", "sdpa_cudnn")
        )
        lines.append(f"{_row(cell)}   {peaks}")
        ours, cudnn = (res.get(n, {}).get("backward_tflops") for n in ("attngen", "sdpa_cudnn"))
        if ours and cudnn:
            ratios.append(ours / cudnn)
        atomic = res.get("attngen_atomic", {}).get("backward_tflops")
        if atomic and cudnn:
            atomic_ratios.append(atomic / cudnn)
        if atomic and ours:
            atomic_gain.append(atomic / ours)
    for label, values in (
        ("attngen / cuDNN", ratios),
        ("attngen_atomic / cuDNN", atomic_ratios),
        ("attngen_atomic / attngen", atomic_gain),
    ):
        if values:
            geomean = math.exp(sum(math.log(r) for r in values) / len(values))
            lines.append(f"geomean {label} backward: {geomean:.2f} over {len(values)} cells")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="N 1k and 4k only")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument(
        "--atomic", action="store_true", help="deterministic=False and True vs cuDNN only"
    )
    parser.add_argument("--reps", type=int, default=100, help="do_bench rep (ms)")
    args = parser.parse_args()
    # Each cell compiles Flex anew; past dynamo's default limit (8) it would run the eager
    # path (8-47 TFLOP/s and out of memory at N 16k) while the table still said "flex".
    torch._dynamo.config.cache_size_limit = 1000
    torch._dynamo.config.accumulated_cache_size_limit = 1000
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    (args.out / "bench_backward.json").write_text(json.dumps(report, indent=1) + "\n")
    print(summary(report))


if __name__ == "__main__":
    main()
