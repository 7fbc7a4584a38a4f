"""Experiment (H200): do tensor descriptors (TMA) for K/V, and warp specialization on top of
them, speed up attngen's prefill loop?

Renders the tuned module of some grid specs and derives variants by text substitution:
- tma: the unmasked key phase loads K and V through host-built 4D tensor descriptors
  ([B, H, N, D], block [1, 1, BLOCK_N, D]); masked phases keep pointer loads (they zero keys
  no row sees, for NaN safety);
- tma_ws: the same with `warp_specialize=True` on the unmasked loop.
Each variant is checked against the baseline's output, then all are timed in alternation,
over a few tile configs. Prints a table and writes JSON.
    PYTHONPATH=. python tools/exp_tma.py --out DIR          # on the GPU
    TRITON_INTERPRET=1 PYTHONPATH=. python tools/exp_tma.py --cpu-check   # correctness here
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton

from attngen.build import plan_build
from attngen.reference import random_inputs
from attngen.spec import load_spec_file

ROOT = Path(__file__).resolve().parent.parent

SUBSTITUTIONS = {
    "tma": [
        ("k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,",
         "k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc, v_desc, "
         "desc_b, desc_h,"),
        ("            k = tl.load(k_ptrs)\n            v = tl.load(v_ptrs)\n",
         "            k = tl.trans(k_desc.load([desc_b, desc_h, start, 0])"
         ".reshape(BLOCK_N, _BLOCK_D))\n"
         "            v = v_desc.load([desc_b, desc_h, start, 0]).reshape(BLOCK_N, _BLOCK_DV)\n"),
        ("    Q, K, V, Out, Lse, Slopes,\n", "    Q, K, V, Out, Lse, Slopes, k_desc, v_desc,\n"),
        ("    o_base = Out + off_b * stride_ob + off_h * stride_oh\n",
         "    o_base = Out + off_b * stride_ob + off_h * stride_oh\n"
         "    desc_b = off_b.to(tl.int32)\n    desc_h = off_hkv.to(tl.int32)\n"),
        ("            q, k, v, out, lse_arg, slopes_arg,\n",
         "            q, k, v, out, lse_arg, slopes_arg,\n"
         "            TensorDescriptor(k, list(k.shape), list(k.stride()),\n"
         "                             [1, 1, CONFIG['BLOCK_N'], _BLOCK_D.value]),\n"
         "            TensorDescriptor(v, list(v.shape), list(v.stride()),\n"
         "                             [1, 1, CONFIG['BLOCK_N'], _BLOCK_DV.value]),\n"),
        ("import triton.language as tl\n",
         "import triton.language as tl\n"
         "from triton.tools.tensor_descriptor import TensorDescriptor\n"),
    ],
}
SUBSTITUTIONS["tma_ws"] = SUBSTITUTIONS["tma"] + [
    ("    BLOCK_N: tl.constexpr,\n):\n    offs_n",
     "    BLOCK_N: tl.constexpr,\n    WARP_SPEC: tl.constexpr = False,\n):\n    offs_n"),
    ("for start in tl.range(start_n, end_n, BLOCK_N):",
     "for start in tl.range(start_n, end_n, BLOCK_N, warp_specialize=WARP_SPEC):"),
    ("MASKED=False, BLOCK_N=BLOCK_N,", "MASKED=False, BLOCK_N=BLOCK_N, WARP_SPEC=True,"),
]
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
           (128, 128, 4, 2)]


def variant_source(source: str, name: str) -> str:
    for old, new in SUBSTITUTIONS.get(name, []):
        assert old in source, (name, old)
        source = source.replace(old, new)
    return source


def load(source: str, name: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def modules_for(spec_file: str):
    spec = load_spec_file(ROOT / spec_file)[0]
    source = plan_build([spec], ROOT / "tuning")[0].source
    return spec, {name: load(variant_source(source, name), f"{spec.name}_{name}")
                  for name in ("baseline", "tma")}  # tma_ws: no setmaxnreg in sm90's PTX


def cpu_check() -> None:
    from tests import interpreter_bf16  # the interpreter's bf16 needs the test shim

    interpreter_bf16.install()
    for spec_file in ("tools/bench_specs/grid_d64_causal.yaml",):
        spec, modules = modules_for(spec_file)
        for seqlen in (40, 130):
            q, k, v, _ = random_inputs(spec, 1, seqlen, seqlen, seed=1)
            outs = {}
            for name, module in modules.items():
                module.CONFIG.update(BLOCK_M=32, BLOCK_N=32)
                outs[name] = module.attention(q, k, v)
            for name, out in outs.items():
                diff = (out.float() - outs["baseline"].float()).abs().max().item()
                print(spec.name, seqlen, name, "max diff vs baseline", diff)
                assert diff <= 2.0**-8, name  # bf16: an ulp or two of summation order


def gpu_bench(out_dir: Path) -> None:
    rows = []
    cases = [("tools/bench_specs/grid_d64_full.yaml", (1024, 4096)),
             ("tools/bench_specs/grid_d128_full.yaml", (1024, 4096, 16384)),
             ("tools/bench_specs/grid_d128_causal.yaml", (1024, 4096)),
             ("tools/bench_specs/grid_d256_full.yaml", (4096,))]
    for spec_file, seqlens in cases:
        spec, modules = modules_for(spec_file)
        for seqlen in seqlens:
            q, k, v, _ = random_inputs(spec, 16384 // seqlen, seqlen, seqlen, seed=0,
                                       device="cuda")
            reference = modules["baseline"].attention(q, k, v)
            flops = 4 * q.shape[0] * q.shape[1] * seqlen * seqlen * spec.head_dim
            flops /= 2 if spec.mask.value == "causal" else 1
            for config in CONFIGS if spec.head_dim <= 128 else [(128, 64, 8, 2), (64, 64, 4, 2)]:
                for name, module in modules.items():
                    module.CONFIG.update(BLOCK_M=config[0], BLOCK_N=config[1],
                                         num_warps=config[2], num_stages=config[3])
                    try:
                        out = module.attention(q, k, v)
                        diff = (out.float() - reference.float()).abs().max().item()
                        ms = triton.testing.do_bench(lambda m=module, a=(q, k, v): m.attention(*a),
                                                     warmup=25, rep=100, return_mode="median")
                        tflops, error = flops / ms / 1e9, None
                    except Exception as exc:  # a variant that fails to compile is a result
                        tflops, diff, error = float("nan"), float("nan"), str(exc)[:160]
                    rows.append(dict(spec=spec.name, seqlen=seqlen, config=config, variant=name,
                                     tflops=tflops, diff=diff, error=error))
                    print(rows[-1], flush=True)
                    (out_dir / "exp_tma.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for r in rows:
        print(f"{r['spec']:18s} N={r['seqlen']:6d} {str(r['config']):18s} {r['variant']:9s} "
              f"{r['tflops']:7.1f} TFLOP/s diff {r['diff']:.4f} {r['error'] or ''}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-check", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    cpu_check() if args.cpu_check else gpu_bench(args.out)
