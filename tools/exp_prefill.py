"""Experiment (H200): variants of the sm90 prefill kernel's inner loop, on the same inputs.

Each variant is the committed module's source with a few lines substituted:
- pointers: TMA turned off (`kv_load_path` forced to pointers), the session-2 baseline;
- tma: the committed module (unmasked K/V blocks through tensor descriptors);
- masked_pointers: the masked (diagonal, window edge, tail) blocks through masked pointer
  loads, as before session 3 (the committed modules read them through TMA too up to D = 128:
  that was variant "tma_diag" here);
- scaled_first: every score scaled before the row max, as before session 3 (the committed
  kernels apply the scale once, in the exponent's FMA; that was variant "fma" here);
- warp_specialize, flatten: `tl.range(..., warp_specialize=True)` / `flatten=True` on the key
  loop (formerly tools/exp_warp_specialize.py);
- fast_exp: exp2 on bf16 pairs (`ex2.approx.ftz.bf16x2`, two per MUFU op) whose
  result is P as the P @ V dot consumes it; measures the headroom of the exponential (it
  rounds the exponent's argument to bf16, so it changes numerics: reported, not adopted).
Each variant is checked against the float64 reference by attngen's rule (one batch entry),
then all are timed in alternation; `--sweep` also times more tile configs at D = 64.

Session 2 measured pointers -> tma: +5% at D64, +6-12% at D128, +6% at D256.
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
# The committed modules read masked blocks through TMA up to D = 128 (session 3, variant
# "tma_diag" then); "masked_pointers" sends them through masked pointer loads again.
MASKED_POINTERS = [("            if USE_TMA and BLOCK_M >= 64:\n"
                    "                # The copy engine zero-fills",
                    "            if False:  # the experiment: masked blocks through pointers\n"
                    "                # The copy engine zero-fills")]
# The committed kernels scale plain scores in the exponent (session 3, variant "fma" then);
# "scaled_first" restores the earlier form, to measure the difference again.
SCALED_FIRST = [
    ("        # Note: plain scores stay unscaled; the scale is applied in the row max and in the\n"
     "        # exponent's FMA (sm_scale > 0, so max(s x qk) = s x max(qk)): one multiply per\n"
     "        # score fewer, 3-6% faster at D = 64 on the H200 (tools/exp_prefill.py, then "
     "\"fma\").\n"
     "        scores = qk\n", "        scores = qk * qk_scale\n"),
    ("        m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)\n",
     "        m_new = tl.maximum(m_i, tl.max(scores, 1))\n"),
    ("        p = tl.math.exp2(scores * qk_scale - m_ref[:, None])\n",
     "        p = tl.math.exp2(scores - m_ref[:, None])\n")]
FAST_EXP = [("        p = tl.math.exp2(scores * qk_scale - m_ref[:, None])\n",
             "        p = tl.inline_asm_elementwise(\n"
             "            \"ex2.approx.ftz.bf16x2 $0, $1;\", \"=r,r\",\n"
             "            [(scores * qk_scale - m_ref[:, None]).to(tl.bfloat16)],\n"
             "            dtype=tl.bfloat16, is_pure=True, pack=2)\n"),
            ("        l_i = l_i * alpha + tl.sum(p, 1)\n",
             "        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)\n")]
# The key loop with Triton's warp specialization or loop flattening (session 2 measured both
# on pointer loads: nothing gained; the PTX had no setmaxnreg, so no specialization on sm90).
KEY_LOOP = "    for start in tl.range(start_n, end_n, BLOCK_N):\n"
WARP_SPECIALIZE = [(KEY_LOOP, KEY_LOOP.replace("BLOCK_N)", "BLOCK_N, warp_specialize=True)"))]
FLATTEN = [(KEY_LOOP, KEY_LOOP.replace("BLOCK_N)", "BLOCK_N, flatten=True)"))]
SUBSTITUTIONS = {"pointers": [], "tma": [], "scaled_first": SCALED_FIRST,
                 "masked_pointers": MASKED_POINTERS, "fast_exp": FAST_EXP,
                 "warp_specialize": WARP_SPECIALIZE, "flatten": FLATTEN}
INTERPRETABLE = ("pointers", "tma", "scaled_first", "masked_pointers")  # no inline PTX


def variant_source(source: str, name: str) -> str | None:
    """The variant's text, or None where it does not apply (masked_pointers at D = 256)."""
    for old, new in SUBSTITUTIONS[name]:
        if source.count(old) != 1:
            return None
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
    module.CONFIGS_BY_SEQLEN = []  # per-length configs off: CONFIG decides every launch
    return module


def committed_source(spec_file: str):
    spec = load_spec_file(ROOT / spec_file)[0]
    source = next(a.source for a in plan_build([spec], ROOT / "tuning")
                  if a.entry["arch"] == "sm90" and a.entry["kind"] == "prefill")
    return spec, source


def modules_for(spec_file: str, variants):
    spec, source = committed_source(spec_file)
    texts = {name: variant_source(source, name) for name in variants}
    return spec, {name: load(text, f"{spec.name}_{name}") for name, text in texts.items()
                  if text is not None}


def cpu_check() -> None:
    """Under the interpreter: every interpretable variant passes the reference rule."""
    from tests import interpreter_bf16  # the interpreter's bf16 needs the test shim

    interpreter_bf16.install()
    for spec_file in ("tools/bench_specs/grid_d64_causal.yaml",
                      "tools/bench_specs/grid_d128_full.yaml"):
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
    from attngen import oracle
    from attngen.tiling import TileConfig

    for spec_file, _ in VARIANT_CASES:
        spec, source = committed_source(spec_file)
        for name in SUBSTITUTIONS:
            text = variant_source(source, name)
            if text is None:
                continue
            module = load(text, f"{spec.name}_{name}")
            config = TileConfig(*(module.CONFIG[key] for key in
                                  ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")))
            record = oracle.compile_source(
                lambda m=module, s=spec, c=config: oracle.kernel_source(s, m._attn_fwd_kernel, c),
                "sm90", config)
            print(spec.name, name, config, {k: record[k] for k in
                                            ("regs", "spill_stores", "shared", "mma", "error")})
            # The committed kernel must compile; a variant that does not is a result (session
            # 3: warp_specialize fails Triton 3.6's NVGPUWarpSpecialization pass on the causal
            # D <= 128 kernels, whose two key loops both read through TMA; elsewhere it
            # compiles to the same registers and shared memory as without it).
            assert name != "tma" or record["error"] is None, record["error"]


def timed(module, q, k, v) -> float:
    return triton.testing.do_bench(lambda: module.attention(q, k, v), warmup=25, rep=100,
                                   return_mode="median")


def measure(spec, name, module, config, seqlen, inputs, rows, out_dir):
    q, k, v = inputs
    module.CONFIG.update(BLOCK_M=config[0], BLOCK_N=config[1], num_warps=config[2],
                         num_stages=config[3])
    flops = 4 * q.shape[0] * q.shape[1] * seqlen * seqlen * spec.head_dim
    flops /= 2 if spec.mask.value == "causal" else 1
    try:
        out, lse = module.attention(q[:1], k[:1], v[:1], return_lse=True)
        problems = compare_to_reference(spec, out, lse, q[:1], k[:1], v[:1])
        tflops, error = flops / timed(module, q, k, v) / 1e9, None
    except Exception as exc:  # a variant that fails to compile is a result
        tflops, problems, error = float("nan"), [], str(exc)[:160]
    rows.append(dict(spec=spec.name, seqlen=seqlen, config=list(config), variant=name,
                     tflops=tflops, problems=problems, error=error))
    print(rows[-1], flush=True)
    (out_dir / "exp_prefill.json").write_text(json.dumps(rows, indent=1))


VARIANT_CASES = [("tools/bench_specs/grid_d64_causal.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d64_full.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d128_causal.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d128_full.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d256_causal.yaml", (1024,))]
SWEEP_CONFIGS = {64: [(128, 64, 4, 2), (128, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3),
                      (64, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3)],
                 128: [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 4)]}


def gpu_bench(out_dir: Path, sweep: bool) -> None:
    rows: list[dict] = []
    for spec_file, seqlens in VARIANT_CASES:
        spec, source = committed_source(spec_file)
        variants = [n for n in SUBSTITUTIONS if n != "pointers"]
        if spec.mask.value == "none":  # no diagonal: masked blocks are only a ragged tail
            variants.remove("masked_pointers")
        spec, modules = modules_for(spec_file, variants)
        config = tuple(modules["tma"].CONFIG[key] for key in
                       ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
        for seqlen in seqlens:
            q, k, v, _ = random_inputs(spec, 16384 // seqlen, seqlen, seqlen, seed=0,
                                       device="cuda")
            for name, module in modules.items():
                measure(spec, name, module, config, seqlen, (q, k, v), rows, out_dir)
            if sweep and spec.head_dim in SWEEP_CONFIGS:
                for other in SWEEP_CONFIGS[spec.head_dim]:
                    measure(spec, "tma", modules["tma"], other, seqlen, (q, k, v), rows, out_dir)
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for r in rows:
        status = r["error"] or ("; ".join(r["problems"]) or "ok")
        print(f"{r['spec']:18s} N={r['seqlen']:5d} {str(r['config']):18s} {r['variant']:15s} "
              f"{r['tflops']:7.1f} TFLOP/s  {status[:90]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-check", action="store_true")
    parser.add_argument("--compile-check", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="more tile configs at D64/D128")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if args.cpu_check:
        cpu_check()
    elif args.compile_check:
        compile_check()
    else:
        gpu_bench(args.out, args.sweep)
