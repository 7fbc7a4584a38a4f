"""Experiment (H200): K/V loads of the sm90 prefill kernel, three ways, on the same inputs.

- pointers: the committed module with TMA turned off (`kv_load_path` forced to pointers);
- tma: the committed module (unmasked blocks through tensor descriptors; masked edge blocks
  through masked pointer loads);
- tma_diag: TMA for the masked blocks too. The copy engine zero-fills rows past the tensor
  (the sequence end); keys inside the tensor that no row of the tile sees are zeroed in
  registers (`tl.where` on V), so NaN there still cannot reach P @ V, and K's are masked in
  the scores as before.
Each variant is checked against the committed module's output, then all are timed in
alternation over a few tile configs. Prints a table and writes JSON.

Session 2 measured pointers -> tma: +5% at D64, +6-12% at D128, +6% at D256 (the committed
modules use TMA since). tma_diag targets the causal N = 1024 cells, where masked diagonal
blocks are about a fifth of the key blocks; it is correct under the interpreter and not yet
timed.
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
MASKED_LOADS = ("            k = tl.load(k_ptrs, mask=k_mask, other=0.0)\n"
                "            v = tl.load(v_ptrs, mask=v_mask, other=0.0)\n")
SUBSTITUTIONS = {
    "tma_diag": [(MASKED_LOADS,
                  "            if USE_TMA:\n"
                  "                k = tl.trans(k_desc.load([desc_b, desc_h, start, 0])"
                  ".reshape(BLOCK_N, _BLOCK_D))\n"
                  "                v = v_desc.load([desc_b, desc_h, start, 0])"
                  ".reshape(BLOCK_N, _BLOCK_DV)\n"
                  "                v = tl.where(v_mask, v, 0.0)\n"
                  "            else:\n"
                  + "".join("    " + line + "\n" for line in MASKED_LOADS.splitlines()))],
}
VARIANTS = ("pointers", "tma", "tma_diag")
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)]


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
    if name.endswith("_pointers"):
        module.kv_load_path = lambda k, v: "pointers: forced by the experiment"
    return module


def modules_for(spec_file: str):
    spec = load_spec_file(ROOT / spec_file)[0]
    source = next(a.source for a in plan_build([spec], ROOT / "tuning")
                  if a.entry["arch"] == "sm90" and a.entry["kind"] == "prefill")
    return spec, {name: load(variant_source(source, name), f"{spec.name}_{name}")
                  for name in VARIANTS}


def cpu_check() -> None:
    """Under the interpreter: every variant equals the committed module's output, and NaN
    stored in keys past the sequence (top-left causal: keys no query reaches) stays out."""
    from tests import interpreter_bf16  # the interpreter's bf16 needs the test shim

    interpreter_bf16.install()
    spec, modules = modules_for("tools/bench_specs/grid_d64_causal.yaml")
    for seqlen_q, seqlen_k in ((40, 40), (130, 130), (50, 97)):
        q, k, v, _ = random_inputs(spec, 1, seqlen_q, seqlen_k, seed=1)
        k[:, :, seqlen_q:], v[:, :, seqlen_q:] = float("nan"), float("nan")  # unseen keys
        outs = {}
        for name, module in modules.items():
            module.CONFIG.update(BLOCK_M=32, BLOCK_N=32)
            outs[name] = module.attention(q, k, v)
        for name, out in outs.items():
            diff = (out.float() - outs["tma"].float()).abs().max().item()
            print(spec.name, seqlen_q, seqlen_k, name, "max diff vs tma", diff)
            assert not out.isnan().any(), name
            assert diff <= 2.0**-8, name  # bf16: an ulp or two of summation order


def gpu_bench(out_dir: Path) -> None:
    rows = []
    cases = [("tools/bench_specs/grid_d64_causal.yaml", (1024, 4096)),
             ("tools/bench_specs/grid_d128_causal.yaml", (1024, 4096)),
             ("tools/bench_specs/grid_d256_causal.yaml", (1024,)),
             ("tools/bench_specs/grid_d128_full.yaml", (1024,))]
    for spec_file, seqlens in cases:
        spec, modules = modules_for(spec_file)
        for seqlen in seqlens:
            q, k, v, _ = random_inputs(spec, 16384 // seqlen, seqlen, seqlen, seed=0,
                                       device="cuda")
            reference = modules["tma"].attention(q, k, v)
            flops = 4 * q.shape[0] * q.shape[1] * seqlen * seqlen * spec.head_dim
            flops /= 2 if spec.mask.value == "causal" else 1
            configs = CONFIGS if spec.head_dim <= 128 else [(128, 64, 8, 2), (64, 64, 4, 2)]
            for config in configs:
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
