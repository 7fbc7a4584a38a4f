"""Experiment (H200): variants of the sm90 prefill kernel's inner loop, on the same inputs.

Each variant is the committed module's source with a few lines substituted:
- pointers: TMA turned off (`kv_load_path` forced to pointers), TMA's baseline;
- tma: the committed module (unmasked K/V blocks through tensor descriptors);
- masked_pointers: the masked (diagonal, window edge, tail) blocks through masked pointer
  loads, the committed path above D = 128 (up to D = 128 the committed modules read them
  through TMA too: variant "tma_diag" when that was measured);
- scaled_first: every score scaled before the row max (the committed kernels apply the scale
  once, in the exponent's FMA: variant "fma" when that was measured);
- warp_specialize, flatten: `tl.range(..., warp_specialize=True)` / `flatten=True` on the key
  loop;
- fast_exp: exp2 on bf16 pairs (`ex2.approx.ftz.bf16x2`, two per MUFU op) whose
  result is P as the P @ V dot consumes it; measures the headroom of the exponential (it
  rounds the exponent's argument to bf16, so it changes numerics: reported, not adopted).
- softmax_overlap: the unmasked key loop rotated so that the softmax of block j runs while
  the P @ V product of block j-1 is still on the tensor cores (FlashAttention-3's
  intra-warpgroup overlap, in plain Triton): Q @ K^T of block j+1 is issued after the
  softmax of block j, so the compiler's `wgmma.wait_group 0` that follows it is the first
  wait on P @ V_{j-1}; the PTX of the committed loop waits on both before the exponentials.
  Plain scores only (no softcap, no ALiBi); one more K tile of shared memory (the peeled
  first block) and ~30 more registers.
A config may carry a fifth number, maxnreg (registers per thread the compiler may use).
Each variant is checked against the float64 reference by attngen's rule (one batch entry),
then all are timed in alternation; `--sweep` also times more tile configs at D = 64.

Measured on the H200 (docs/performance.md): pointers -> tma: +5% at D64, +6-12% at D128, +6%
at D256. With --compare (docs/results/exp_prefill_2026-11-30_{softmax_overlap,lazy_rescale,
lpt_order}.json), the first two rejected:
- softmax_overlap: no config gains more than 4%, most lose (128x64x8x3 at D64 N4096: 323 vs
  421 TFLOP/s: 142 registers leave one program per SM; with maxnreg 128, 429 vs 422); the
  extra K tile pushes D128 64x64 past two programs per SM and 64x128 past the shared memory.
- lazy_rescale: 5-35% slower everywhere (D64 N4096 128x64x8x3: 403 vs 422; D128 64x64x4x3:
  298 vs 447): the tile-wide max is a shared-memory reduction with two bar.sync per block,
  which costs more than the [BLOCK_M, DV] multiply it skips.
- lpt_group16 (adopted for causal D > 128 on sm90, `lpt_group_heads` in the render context):
  +6.9% at D256 N1024 causal, +6.4% at N4096; -1.6% to +1.4% at D64/D128; lpt_group1024
  (all heads) 10-30% slower.
    PYTHONPATH=. python tools/exp_prefill.py --out DIR [--sweep]     # on the GPU
    TRITON_INTERPRET=1 PYTHONPATH=. python tools/exp_prefill.py --cpu-check   # here
    PYTHONPATH=. python tools/exp_prefill.py --compile-check          # here, sm90 compiles
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
from attngen.reference import compare_to_reference, random_inputs
from attngen.spec import load_spec_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from exp_prefill_variants import (  # noqa: E402  (tools/ is not a package)
    INTERPRETABLE,
    SUBSTITUTIONS,
    variant_source,
)


def load(source: str, name: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if name.endswith("_pointers"):
        module.kv_load_path = lambda k, v: "pointers: forced by the experiment"
    module.CONFIGS_BY_SEQLEN = []  # per-length configs off: CONFIG decides every launch
    return module


def committed_source(spec_file: str):
    spec = load_spec_file(ROOT / spec_file)[0]
    source = next(
        a.source
        for a in plan_build([spec], ROOT / "tuning")
        if a.entry["arch"] == "sm90" and a.entry["kind"] == "prefill"
    )
    return spec, source


def modules_for(spec_file: str, variants):
    spec, source = committed_source(spec_file)
    texts = {name: variant_source(source, name) for name in variants}
    return spec, {
        name: load(text, f"{spec.name}_{name}") for name, text in texts.items() if text is not None
    }


def cpu_check() -> None:
    """Under the interpreter: every interpretable variant passes the reference rule."""
    from tests import interpreter_bf16  # the interpreter's bf16 needs the test shim

    interpreter_bf16.install()
    for spec_file in (
        "tools/bench_specs/grid_d64_causal.yaml",
        "tools/bench_specs/grid_d128_full.yaml",
    ):
        spec, modules = modules_for(spec_file, INTERPRETABLE)
        for seqlen_q, seqlen_k in ((40, 40), (130, 130), (50, 97)):
            q, k, v, _ = random_inputs(spec, 1, seqlen_q, seqlen_k, seed=1)
            for name, module in modules.items():
                module.CONFIG.update(BLOCK_M=32, BLOCK_N=32)
                out, lse = module.attention(q, k, v, return_lse=True)
                problems = compare_to_reference(spec, out, lse, q, k, v)
                print(spec.name, seqlen_q, seqlen_k, name, problems or "ok")
                assert not problems, (name, problems)


def compile_check() -> None:
    """Without the interpreter: compile every variant for sm90 at the committed config of each
    spec and print registers, spills and shared memory (or the error)."""
    from attngen.tiling.prefill import TileConfig
    from attngen.verify import compiler

    for spec_file, _ in VARIANT_CASES:
        spec, source = committed_source(spec_file)
        for name in SUBSTITUTIONS:
            text = variant_source(source, name)
            if text is None:
                continue
            module = load(text, f"{spec.name}_{name}")
            config = TileConfig(
                *(module.CONFIG[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
            )
            record = compiler.compile_source(
                lambda m=module, s=spec, c=config: compiler.kernel_source(s, m._attn_fwd_kernel, c),
                "sm90",
                config,
            )
            print(
                spec.name,
                name,
                config,
                {k: record[k] for k in ("regs", "spill_stores", "shared", "mma", "error")},
            )
            # The committed kernel must compile; a variant that does not is a result
            # (warp_specialize fails Triton 3.6's NVGPUWarpSpecialization pass on the causal
            # D <= 128 kernels, whose two key loops both read through TMA; elsewhere it
            # compiles to the same registers and shared memory as without it).
            assert name != "tma" or record["error"] is None, record["error"]


def timed(module, q, k, v) -> float:
    return triton.testing.do_bench(
        lambda: module.attention(q, k, v), warmup=25, rep=100, return_mode="median"
    )


def measure(spec, name, module, config, seqlen, inputs, rows, out_dir):
    q, k, v = inputs
    module.CONFIG.update(
        BLOCK_M=config[0],
        BLOCK_N=config[1],
        num_warps=config[2],
        num_stages=config[3],
        maxnreg=config[4] if len(config) > 4 else None,
    )
    flops = 4 * q.shape[0] * q.shape[1] * seqlen * seqlen * spec.head_dim
    flops /= 2 if spec.mask.value == "causal" else 1
    try:
        out, lse = module.attention(q[:1], k[:1], v[:1], return_lse=True)
        problems = compare_to_reference(spec, out, lse, q[:1], k[:1], v[:1])
        tflops, error = flops / timed(module, q, k, v) / 1e9, None
    except Exception as exc:  # a variant that fails to compile is a result
        tflops, problems, error = float("nan"), [], str(exc)[:400]
    rows.append(
        dict(
            spec=spec.name,
            seqlen=seqlen,
            config=list(config),
            variant=name,
            tflops=tflops,
            problems=problems,
            error=error,
        )
    )
    print(rows[-1], flush=True)
    (out_dir / "exp_prefill.json").write_text(json.dumps(rows, indent=1))


VARIANT_CASES = [
    ("tools/bench_specs/grid_d64_causal.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d64_full.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d128_causal.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d128_full.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d256_causal.yaml", (1024,)),
]
SWEEP_CONFIGS = {
    64: [
        (128, 64, 4, 2),
        (128, 64, 4, 4),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (64, 128, 4, 3),
        (128, 128, 8, 3),
        (256, 64, 8, 3),
    ],
    128: [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 4)],
}


# --compare: one variant against the committed loop (tma), config by config. N <= 4096: the
# float64 reference check of a 16k sequence would not fit in GPU memory.
COMPARE_CASES = [
    ("tools/bench_specs/grid_d64_full.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d64_causal.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d128_causal.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d128_full.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d256_causal.yaml", (1024, 4096)),
    ("tools/bench_specs/grid_d256_full.yaml", (1024,)),
]
COMPARE_CONFIGS = {
    64: [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
}


def compare_bench(out_dir: Path, variants: list[str], causal_only: bool = False) -> None:
    """`variants` against the committed loop (tma) on the same inputs, per config."""
    rows: list[dict] = []
    for spec_file, seqlens in COMPARE_CASES:
        if causal_only and "causal" not in spec_file:
            continue
        spec, modules = modules_for(spec_file, ("tma", *variants))
        for seqlen in seqlens:
            q, k, v, _ = random_inputs(spec, 16384 // seqlen, seqlen, seqlen, seed=0, device="cuda")
            for config in COMPARE_CONFIGS[spec.head_dim]:
                for name, module in modules.items():
                    measure(spec, name, module, config, seqlen, (q, k, v), rows, out_dir)
    print_rows(rows)


def print_rows(rows: list[dict]) -> None:
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for r in rows:
        status = r["error"] or ("; ".join(r["problems"]) or "ok")
        print(
            f"{r['spec']:18s} N={r['seqlen']:5d} {str(r['config']):22s} {r['variant']:15s} "
            f"{r['tflops']:7.1f} TFLOP/s  {status[:90]}"
        )


def gpu_bench(out_dir: Path, sweep: bool) -> None:
    rows: list[dict] = []
    for spec_file, seqlens in VARIANT_CASES:
        spec, source = committed_source(spec_file)
        variants = [n for n in SUBSTITUTIONS if n != "pointers"]
        if spec.mask.value == "none":  # no diagonal: masked blocks are only a ragged tail
            variants.remove("masked_pointers")
        spec, modules = modules_for(spec_file, variants)
        config = tuple(
            modules["tma"].CONFIG[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
        )
        for seqlen in seqlens:
            q, k, v, _ = random_inputs(spec, 16384 // seqlen, seqlen, seqlen, seed=0, device="cuda")
            for name, module in modules.items():
                measure(spec, name, module, config, seqlen, (q, k, v), rows, out_dir)
            if sweep and spec.head_dim in SWEEP_CONFIGS:
                for other in SWEEP_CONFIGS[spec.head_dim]:
                    measure(spec, "tma", modules["tma"], other, seqlen, (q, k, v), rows, out_dir)
    print_rows(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-check", action="store_true")
    parser.add_argument("--compile-check", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="more tile configs at D64/D128")
    parser.add_argument(
        "--compare",
        choices=sorted(SUBSTITUTIONS),
        nargs="+",
        help="only these variants against tma, over COMPARE_CONFIGS",
    )
    parser.add_argument("--causal-only", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if args.cpu_check:
        cpu_check()
    elif args.compile_check:
        compile_check()
    elif args.compare:
        compare_bench(args.out, args.compare, args.causal_only)
    else:
        gpu_bench(args.out, args.sweep)
