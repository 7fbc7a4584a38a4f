"""Experiment (H200): does `tl.range(..., warp_specialize=True)` speed up attngen's prefill loop?

Builds the tuned modules of some grid specs, derives a variant by text substitution of the key
loop, checks it gives the same output, and times both in alternation. Prints a table.
    PYTHONPATH=. python tools/exp_warp_specialize.py
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
import triton

from attngen.build import plan_build
from attngen.reference import random_inputs
from attngen.spec import load_spec_file

ROOT = Path(__file__).resolve().parent.parent
LOOP = "for start in tl.range(start_n, end_n, BLOCK_N):"
VARIANTS = {
    "baseline": LOOP,
    "warp_specialize": "for start in tl.range(start_n, end_n, BLOCK_N, warp_specialize=True):",
    "flatten": "for start in tl.range(start_n, end_n, BLOCK_N, flatten=True):",
}


def load(source: str, name: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    rows = []
    for spec_file, seqlens in (("grid_d128_full", (4096, 16384)), ("grid_d64_full", (4096,)),
                               ("grid_d128_causal", (4096,))):
        spec = load_spec_file(ROOT / f"tools/bench_specs/{spec_file}.yaml")[0]
        source = plan_build([spec], ROOT / "tuning")[0].source
        assert LOOP in source
        modules = {}
        for name, loop in VARIANTS.items():
            try:
                modules[name] = load(source.replace(LOOP, loop), f"{spec.name}_{name}")
            except Exception as exc:
                print(name, "failed to load", exc)
        for seqlen in seqlens:
            q, k, v, _ = random_inputs(spec, 16384 // seqlen, seqlen, seqlen, seed=0,
                                       device="cuda")
            reference = modules["baseline"].attention(q, k, v)
            flops = 4 * q.shape[0] * q.shape[1] * seqlen * seqlen * spec.head_dim
            flops /= 2 if spec.mask.value == "causal" else 1
            for name, module in modules.items():
                try:
                    out = module.attention(q, k, v)
                    diff = (out.float() - reference.float()).abs().max().item()
                    ms = triton.testing.do_bench(lambda m=module, a=(q, k, v): m.attention(*a),
                                                 warmup=25, rep=100, return_mode="median")
                    rows.append((spec.name, seqlen, name, flops / ms / 1e9, diff))
                except Exception as exc:
                    rows.append((spec.name, seqlen, name, float("nan"), str(exc)[:80]))
                print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for row in rows:
        print(f"{row[0]:20s} N={row[1]:6d} {row[2]:16s} {row[3]:7.1f} TFLOP/s  diff {row[4]}")


if __name__ == "__main__":
    main()
