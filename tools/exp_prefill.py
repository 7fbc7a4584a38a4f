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
# The committed modules read masked blocks through TMA up to D = 128 (variant "tma_diag" when
# that was measured); "masked_pointers" sends them through masked pointer loads again.
MASKED_POINTERS = [("            if USE_TMA and BLOCK_M >= 64:\n"
                    "                # The copy engine zero-fills",
                    "            if False:  # the experiment: masked blocks through pointers\n"
                    "                # The copy engine zero-fills")]
# The committed kernels scale plain scores in the exponent (variant "fma" when that was
# measured); "scaled_first" restores the earlier form, to measure the difference again.
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
# The key loop with Triton's warp specialization or loop flattening (both measured on pointer
# loads: nothing gained; the PTX had no setmaxnreg, so no specialization on sm90).
KEY_LOOP = "    for start in tl.range(start_n, end_n, BLOCK_N):\n"
WARP_SPECIALIZE = [(KEY_LOOP, KEY_LOOP.replace("BLOCK_N)", "BLOCK_N, warp_specialize=True)"))]
FLATTEN = [(KEY_LOOP, KEY_LOOP.replace("BLOCK_N)", "BLOCK_N, flatten=True)"))]
OVERLAPPED_INNER = '''
@triton.jit
def _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc, v_desc,
                   desc_b, desc_h, start, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
                   WANT_K: tl.constexpr):
    if USE_TMA:
        if WANT_K:
            return tl.trans(k_desc.load([desc_b, desc_h, start, 0]).reshape(BLOCK_N, _BLOCK_D))
        return v_desc.load([desc_b, desc_h, start, 0]).reshape(BLOCK_N, _BLOCK_DV)
    rows = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
    if WANT_K:
        dims = tl.arange(0, _BLOCK_D)
        return tl.load(k_base + rows[None, :] * stride_kn + dims[:, None] * stride_kd)
    dims = tl.arange(0, _BLOCK_DV)
    return tl.load(v_base + rows[:, None] * stride_vn + dims[None, :] * stride_vd)


@triton.jit
def _attn_fwd_inner_overlapped(
    acc, l_i, m_i, q, q_pos, first_q_pos, last_q_pos,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc, v_desc, desc_b, desc_h,
    start_n, end_n, seqlen_k, qk_scale, slope_log2,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # Every block here is unmasked and full; m_i may be -inf only before the first block,
    # whose row max is finite, so m_new is finite throughout.
    if end_n > start_n:
        k = _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc,
                           v_desc, desc_b, desc_h, start_n, BLOCK_N, USE_TMA, True)
        qk = tl.dot(q, k)
        for start in tl.range(start_n, end_n - BLOCK_N, BLOCK_N):
            start = tl.multiple_of(start, BLOCK_N)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            k = _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               k_desc, v_desc, desc_b, desc_h, start + BLOCK_N, BLOCK_N,
                               USE_TMA, True)
            qk = tl.dot(q, k)
            acc = acc * alpha[:, None]
            v = _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               k_desc, v_desc, desc_b, desc_h, start, BLOCK_N, USE_TMA, False)
            acc = tl.dot(p.to(q.dtype), v, acc)
            m_i = m_new
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc,
                           v_desc, desc_b, desc_h, end_n - BLOCK_N, BLOCK_N, USE_TMA, False)
        acc = tl.dot(p.to(q.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


'''
KERNEL_DEF = "@triton.jit\ndef _attn_fwd_kernel("
UNMASKED_CALL = ("    acc, l_i, m_i = _attn_fwd_inner(\n", "MASKED=False,")


def overlapped_source(source: str) -> str | None:
    """The committed source with the unmasked key loop replaced (plain scores only)."""
    if "        scores = qk\n" not in source or source.count(KERNEL_DEF) != 1:
        return None
    head, _, kernel = source.partition(KERNEL_DEF)
    flag = kernel.index(UNMASKED_CALL[1])
    call = kernel.rindex(UNMASKED_CALL[0], 0, flag)
    kernel = (kernel[:call] + UNMASKED_CALL[0].replace("_inner(", "_inner_overlapped(")
              + kernel[call + len(UNMASKED_CALL[0]):])
    return head + OVERLAPPED_INNER.lstrip("\n") + KERNEL_DEF + kernel


# FlashAttention-4's conditional rescaling: in unmasked blocks the running max m_i is moved
# (and acc, l_i rescaled) only when some row's max grew by more than 8 (log2 domain), so P
# stays <= 2^8 (exact in bf16's exponent range) and the [BLOCK_M, DV] multiply by alpha is
# skipped in nearly every block after the first. The decision is one tile-wide max.
LAZY_RESCALE = [("""        p = tl.math.exp2(scores * qk_scale - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(""", """        if MASKED:
            p = tl.math.exp2(scores * qk_scale - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        else:
            if tl.max(m_new - m_i, 0) > 8.0:
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
            else:
                m_new = m_i
            p = tl.math.exp2(scores * qk_scale - m_new[:, None])
            l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(""")]
# Causal schedules: the committed order runs the query blocks of one head as adjacent
# programs, heaviest first (they share K/V in L2). lpt_groupG orders G heads at a time
# heaviest block first across the group (longest-processing-time first, for a shorter tail
# at few waves) while the group's K/V still fits in L2; G = 1 is the committed order.
PROGRAM_ORDER = """    m_block = num_m_blocks - 1 - pid % num_m_blocks
    batch_head = pid // num_m_blocks
"""


def lpt_group(size: int) -> list[tuple[str, str]]:
    return [(PROGRAM_ORDER, f"""    group_programs = {size} * num_m_blocks
    group_first = (pid // group_programs) * {size}
    group_heads = tl.minimum({size}, tl.num_programs(0) // num_m_blocks - group_first)
    rank = pid % group_programs
    m_block = num_m_blocks - 1 - rank // group_heads
    batch_head = group_first + rank % group_heads
""")]


MAXNREG = [("            num_stages=CONFIG[\"num_stages\"],\n",
            "            num_stages=CONFIG[\"num_stages\"],\n"
            "            **({\"maxnreg\": CONFIG[\"maxnreg\"]}"
            " if CONFIG.get(\"maxnreg\") else {}),\n")]
SUBSTITUTIONS = {"pointers": [], "tma": [], "scaled_first": SCALED_FIRST,
                 "masked_pointers": MASKED_POINTERS, "fast_exp": FAST_EXP,
                 "warp_specialize": WARP_SPECIALIZE, "flatten": FLATTEN,
                 "softmax_overlap": overlapped_source, "lazy_rescale": LAZY_RESCALE,
                 "lpt_group4": lpt_group(4), "lpt_group16": lpt_group(16),
                 "lpt_group1024": lpt_group(1024)}
INTERPRETABLE = ("pointers", "tma", "scaled_first", "masked_pointers",
                 "softmax_overlap", "lazy_rescale", "lpt_group4", "lpt_group16",
                 "lpt_group1024")  # no inline PTX


def variant_source(source: str, name: str) -> str | None:
    """The variant's text, or None where it does not apply (masked_pointers at D = 256)."""
    for old, new in MAXNREG:  # every variant may be launched with a register cap
        source = source.replace(old, new)
    if callable(SUBSTITUTIONS[name]):
        return SUBSTITUTIONS[name](source)
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
    from attngen.tiling.prefill import TileConfig
    from attngen.verify import compiler

    for spec_file, _ in VARIANT_CASES:
        spec, source = committed_source(spec_file)
        for name in SUBSTITUTIONS:
            text = variant_source(source, name)
            if text is None:
                continue
            module = load(text, f"{spec.name}_{name}")
            config = TileConfig(*(module.CONFIG[key] for key in
                                  ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")))
            record = compiler.compile_source(
                lambda m=module, s=spec, c=config: compiler.kernel_source(s, m._attn_fwd_kernel,
                                                                          c),
                "sm90", config)
            print(spec.name, name, config, {k: record[k] for k in
                                            ("regs", "spill_stores", "shared", "mma", "error")})
            # The committed kernel must compile; a variant that does not is a result
            # (warp_specialize fails Triton 3.6's NVGPUWarpSpecialization pass on the causal
            # D <= 128 kernels, whose two key loops both read through TMA; elsewhere it
            # compiles to the same registers and shared memory as without it).
            assert name != "tma" or record["error"] is None, record["error"]


def timed(module, q, k, v) -> float:
    return triton.testing.do_bench(lambda: module.attention(q, k, v), warmup=25, rep=100,
                                   return_mode="median")


def measure(spec, name, module, config, seqlen, inputs, rows, out_dir):
    q, k, v = inputs
    module.CONFIG.update(BLOCK_M=config[0], BLOCK_N=config[1], num_warps=config[2],
                         num_stages=config[3], maxnreg=config[4] if len(config) > 4 else None)
    flops = 4 * q.shape[0] * q.shape[1] * seqlen * seqlen * spec.head_dim
    flops /= 2 if spec.mask.value == "causal" else 1
    try:
        out, lse = module.attention(q[:1], k[:1], v[:1], return_lse=True)
        problems = compare_to_reference(spec, out, lse, q[:1], k[:1], v[:1])
        tflops, error = flops / timed(module, q, k, v) / 1e9, None
    except Exception as exc:  # a variant that fails to compile is a result
        tflops, problems, error = float("nan"), [], str(exc)[:400]
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


# --compare: one variant against the committed loop (tma), config by config. N <= 4096: the
# float64 reference check of a 16k sequence would not fit in GPU memory.
COMPARE_CASES = [("tools/bench_specs/grid_d64_full.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d64_causal.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d128_causal.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d128_full.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d256_causal.yaml", (1024, 4096)),
                 ("tools/bench_specs/grid_d256_full.yaml", (1024,))]
COMPARE_CONFIGS = {64: [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4)],
                   128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)],
                   256: [(128, 64, 8, 2), (64, 64, 4, 2)]}


def compare_bench(out_dir: Path, variants: list[str], causal_only: bool = False) -> None:
    """`variants` against the committed loop (tma) on the same inputs, per config."""
    rows: list[dict] = []
    for spec_file, seqlens in COMPARE_CASES:
        if causal_only and "causal" not in spec_file:
            continue
        spec, modules = modules_for(spec_file, ("tma", *variants))
        for seqlen in seqlens:
            q, k, v, _ = random_inputs(spec, 16384 // seqlen, seqlen, seqlen, seed=0,
                                       device="cuda")
            for config in COMPARE_CONFIGS[spec.head_dim]:
                for name, module in modules.items():
                    measure(spec, name, module, config, seqlen, (q, k, v), rows, out_dir)
    print_rows(rows)


def print_rows(rows: list[dict]) -> None:
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for r in rows:
        status = r["error"] or ("; ".join(r["problems"]) or "ok")
        print(f"{r['spec']:18s} N={r['seqlen']:5d} {str(r['config']):22s} {r['variant']:15s} "
              f"{r['tflops']:7.1f} TFLOP/s  {status[:90]}")


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
    print_rows(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-check", action="store_true")
    parser.add_argument("--compile-check", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="more tile configs at D64/D128")
    parser.add_argument("--compare", choices=sorted(SUBSTITUTIONS), nargs="+",
                        help="only these variants against tma, over COMPARE_CONFIGS")
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
