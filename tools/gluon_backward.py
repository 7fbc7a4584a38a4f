"""The modules' Gluon dK/dV backward on the H200, through flash_attn_func, against the tile-level
backward, cuDNN and FlashAttention-4.

The kernel is in attngen/templates/_gluon_backward.py.jinja (config and the short causal rule:
attngen/tiling/gluon_backward.py). Each cell's spec (bf16, D 64/128, N 1k/4k/16k, B = 16384 /
N, H = 2048 / D, causal bottom-right or none, backward: true) is built into a folder of its
own, with the module's short causal rule turned off (GLUON_BWD_SHORT_CAUSAL_KEYS = 0) so that
deterministic=False runs the Gluon kernel in every cell: the rule is decided from these
numbers. "tile" is the same module with deterministic=True: the tile-level two-kernel backward
that deterministic=False runs where the Gluon kernel does not. Each implementation's backward
time is (forward + backward) - forward (tools/bench_backward.py's measure), through
attngen.flash_attn_func, SDPA's cuDNN backend, and FA4's flash_attn.cute (`source
tools/gpu_fa4.sh` first; skipped when not importable). The Gluon module's backward_path() is
recorded, and its gradients are compared with the tile-level ones (max abs difference over
dq, dk, dv). --softcap C builds every spec with softcap C and passes it to flash_attn_func and
FA4 (cuDNN is skipped: SDPA has no softcap). On a CUDA machine, from the repository root:

    PYTHONPATH=. python tools/gluon_backward.py --out DIR [--n 1024 4096] [--d 128] [--softcap C]

Writes DIR/gluon_backward_bench.json and prints one line per cell. `attngen verify-tiling
--gluon` cross-compiles the kernels without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_backward import measure  # noqa: E402

import attngen  # noqa: E402
from attngen.build import plan_build, write_build  # noqa: E402
from attngen.runtime import last_backward  # noqa: E402
from attngen.runtime.registry import current_registry, load_kernels  # noqa: E402
from attngen.spec import specs_from_data  # noqa: E402

TOKENS, WIDTH = 16384, 2048


def load(d: int, heads: int, causal: bool, softcap: float = 0.0):
    """The cell's module, built into a folder of its own and served alone, rule off."""
    fields = dict(name="gluon_bwd_bench", archs=["sm90"], dtype="bf16", head_dim=d,
                  num_q_heads=heads, num_kv_heads=heads, mask="causal" if causal else "none",
                  kernels=["prefill"], backward=True, softcap=softcap)  # fmt: skip
    if causal:
        fields["causal_align"] = "bottom_right"
    folder = Path(tempfile.mkdtemp(prefix="gluon-bwd-"))
    write_build(plan_build(specs_from_data(fields)), folder)
    registry = load_kernels(folder, replace=True)
    for entry in registry.entries:
        if Path(entry.key).is_relative_to(folder.resolve()):
            registry.module(entry.key).GLUON_BWD_SHORT_CAUSAL_KEYS = 0
    return registry


def _attngen(causal: bool, deterministic: bool, softcap: float = 0.0):
    def run(q, k, v):
        return attngen.flash_attn_func(q, k, v, causal=causal, softcap=softcap,
                                       deterministic=deterministic)  # fmt: skip

    return run


def _others(causal: bool, softcap: float = 0.0) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            heads = [t.transpose(1, 2) for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=causal)
            return out.transpose(1, 2)

    impls: dict = {"cudnn": "skipped: SDPA has no softcap" if softcap else cudnn}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            out = flash_attn_func(
                q, k, v, causal=causal, **({"softcap": softcap} if softcap else {})
            )
            return out[0] if isinstance(out, tuple) else out

        impls["fa4"] = fa4
    except Exception as exc:  # noqa: BLE001 - recorded, the others still run
        impls["fa4"] = f"unavailable: {type(exc).__name__}: {exc}"[:200]
    return impls


def _grads(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fn(*leaves).backward(dout)
    return [t.grad for t in leaves]


def run_cell(d: int, n: int, causal: bool, reps: int, softcap: float = 0.0) -> dict:
    batch, heads = TOKENS // n, WIDTH // d
    flops = 2.5 * 4 * batch * heads * n * n * d * (0.5 if causal else 1)
    cell: dict = {"D": d, "N": n, "B": batch, "H": heads, "causal": causal, "softcap": softcap,
                  "tflops": {}}  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(batch, n, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(4)
    )
    load(d, heads, causal, softcap)
    impls = {"gluon": _attngen(causal, False, softcap), "tile": _attngen(causal, True, softcap),
             **_others(causal, softcap)}  # fmt: skip
    reference = _grads(impls["tile"], q, k, v, dout)
    gluon = _grads(impls["gluon"], q, k, v, dout)
    cell["gluon_path"] = current_registry().module(last_backward().key).backward_path()
    cell["max_diff_vs_tile"] = max(
        (a - b).abs().max().item() for a, b in zip(gluon, reference, strict=True)
    )
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    for name, fn in impls.items():
        if isinstance(fn, str):
            cell["tflops"][name] = fn
            continue
        try:
            ms = measure(fn, *leaves, dout, reps)["backward_ms"]
            cell["tflops"][name] = round(flops / ms / 1e9, 1)
        except Exception as exc:  # noqa: BLE001 - recorded, the cell goes on
            cell["tflops"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        torch.cuda.empty_cache()
    ours = cell["tflops"].get("gluon")
    for other in ("tile", "cudnn", "fa4"):
        theirs = cell["tflops"].get(other)
        if isinstance(ours, float) and isinstance(theirs, float):
            cell[f"gluon/{other}"] = round(ours / theirs, 3)
    return cell


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--softcap", type=float, default=0.0, help="the specs' softcap (0: none)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "softcap": args.softcap,
    }
    cells = []
    for d in args.d:
        for n in args.n:
            for causal in (False, True):
                try:
                    cell = run_cell(d, n, causal, args.reps, args.softcap)
                except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
                    cell = {"D": d, "N": n, "causal": causal, "error": repr(exc)[:400]}
                cells.append(cell)
                print(json.dumps(cell), flush=True)
                report = {"meta": meta, "cells": cells}
                (args.out / "gluon_backward_bench.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
