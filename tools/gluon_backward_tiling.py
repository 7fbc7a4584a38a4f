"""The Gluon dK/dV backward's config (tools/gluon_backward.py), derived as
attngen/tiling/gluon.py derives the forward's, and checked against the compiler here.

A CTA has one producer warp and two consumer warpgroups of 64 key rows each (BLOCK_N = 128
keys); the producer streams STAGES slots of (Q, LSE) and (dO, delta), BLOCK_M query rows
apiece. The model (sympy) in BM = BLOCK_M, BN = BLOCK_N, D, E (element bytes), S (stages),
NC (consumers):
- shared memory: K and V [BN, D] resident, S slots of Q and dO [BM, D] and of LSE and delta
  [BM] fp32, the two dS^T slots [BN, BM] of the dQ hand-off, the mbarriers (kv: one, padded
  to 16 B; four [S, 1] arrays and two [2, 1]: 8 B each, every array padded to 16 B) and
  warp_specialize's fixed buffer; exact against the compiler (`--compile`);
- registers per consumer thread: dK_c and dV_c (fp32, [BN / NC, D] over 128 threads), S^T
  and dP^T (fp32, [BN / NC, BM]), P^T and dS^T as 16-bit operands (two values a register),
  the dQ accumulator [BM, D] fp32 on the consumer's turn, and CONSUMER_OVERHEAD: a bound the
  compiler's "no spills" checks at the chosen config (ptxas allocates up to the setmaxnreg
  cap, so the count itself is not read back).

The register split is the forward's (register_split: two consumers 240, the producer 24,
168 at entry). D 256 does not fit: one warpgroup owning 64 key rows holds dK_c and dV_c
[64, 256] in fp32, 256 registers a thread before any score tile, above setmaxnreg's 240
with two consumers (and 64 + 64 KiB of K and V resident at BLOCK_N 128 leave no room for two
stages of 32 KiB Q and dO tiles); it needs dK/dV split along D across the consumers (S^T and
dP^T computed by both), another kernel.

The choice: the widest BLOCK_M whose registers and shared memory fit (each query block costs
five wgmma issues and a barrier round; wider blocks amortise them), then two stages (FA3's
Q and dO depth: a step's five GEMMs cover the next block's load; a third is a benchmark
variant where it fits).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import sympy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen.tiling.evaluate import compiled  # noqa: E402
from attngen.tiling.gluon import register_split  # noqa: E402

NC, BM, BN, D, E, S, C = sympy.symbols("NC BLOCK_M BLOCK_N D E S C", positive=True, integer=True)
SYMBOLS = (NC, BM, BN, D, E, S, C)  # C: dQ columns a consumer computes
SMEM_BUDGET = 232448  # sm90: 227 KiB of dynamic shared memory a CTA
WARPGROUP = 128
CONSUMERS = 2
BLOCK_N = 128  # two consumers x 64 key rows (wgmma's M)
BLOCK_M_CHOICES = (64, 128)
STAGES_CHOICES = (2, 3)
HEAD_DIMS = (64, 128)
# Registers beyond the tiles (addresses, barrier phases, loop state): fitted to the
# compiler at the boundary (D 128 x BLOCK_M 64 compiles without spills without a mask and
# spills 72 B of scalars under causal; D 64 x BLOCK_M 128, 16 above, spills 136 B).
CONSUMER_OVERHEAD = 32
CVT_ROUND_BYTES = 16384  # the compiler's layout conversion goes through 16 KiB rounds
DIVISIBLE = ("n_pad", "stride_kn", "stride_kh")  # multiples of BLOCK_M and of D


def _pad16(n: sympy.Expr) -> sympy.Expr:  # an [n, 1] int64 barrier array, padded to 16 B
    return 16 * sympy.ceiling(n / sympy.Integer(2))


# K, V resident; S slots of Q and dO; dS (two slots) and P [BM, BN]; LSE and delta rows;
# per consumer, the compiler's scratch for dQ's layout change before the 16-byte atomics
# (at most CVT_ROUND_BYTES; it also holds warp_specialize's arguments); the barriers.
SMEM = (
    E * (2 * BN * D + S * 2 * BM * D + 3 * BM * BN)
    + S * 2 * BM * 4
    + NC * sympy.Min(BM * C * 4, CVT_ROUND_BYTES)
    + 16
    + 4 * _pad16(S)
    + 2 * _pad16(sympy.Integer(2))
)
# dK_c, dV_c for the whole loop, plus the larger of the score phase (S and dP in fp32, P or
# dS in 16 bits) and the dQ phase (dQ and its converted copy, fp32).
REGS = (
    2 * BN / NC * D / WARPGROUP
    + sympy.Max(2 * BM * BN / NC + BM * BN / NC / 2, 2 * BM * C) / WARPGROUP
    + CONSUMER_OVERHEAD
)


@dataclass(frozen=True)
class BwdConfig:
    head_dim: int
    block_m: int
    stages: int
    smem: int
    regs: int
    consumer_regs: int
    producer_regs: int
    maxnreg: int
    rejected: tuple[str, ...]

    @property
    def block_n(self) -> int:
        return BLOCK_N

    @property
    def dq_split(self) -> bool:
        """dQ's columns split across the consumers, else dQ whole on alternate consumers."""
        return dq_columns(self.head_dim) < self.head_dim

    def describe(self) -> str:
        return (
            f"D {self.head_dim}: BLOCK_M {self.block_m}, BLOCK_N {BLOCK_N}, {self.stages} "
            f"stages, smem {self.smem} B, consumer regs ~{self.regs} of {self.consumer_regs}"
            + (f" REJECTED ({'; '.join(self.rejected)})" if self.rejected else "")
        )


def dq_columns(d: int) -> int:
    """dQ columns one consumer computes: half of them from D 128 (K's columns sliced at a
    128-byte swizzle atom), all of them below (on alternate steps)."""
    return d // 2 if d >= 128 else d


def candidate(d: int, block_m: int, stages: int, itemsize: int = 2) -> BwdConfig:
    values = (CONSUMERS, block_m, BLOCK_N, d, itemsize, stages, dq_columns(d))
    smem = int(compiled(SMEM, SYMBOLS)(*values))
    regs = int(compiled(REGS, SYMBOLS)(*values))
    consumer, producer, entry = register_split(CONSUMERS)
    rejected = []
    if smem > SMEM_BUDGET:
        rejected.append(f"smem {smem} B > {SMEM_BUDGET} B")
    if regs > consumer:
        rejected.append(f"consumer regs ~{regs} > {consumer}")
    return BwdConfig(d, block_m, stages, smem, regs, consumer, producer, entry, tuple(rejected))


def candidates(d: int) -> list[BwdConfig]:
    return [candidate(d, bm, s) for bm in BLOCK_M_CHOICES for s in STAGES_CHOICES]


def derive(d: int) -> BwdConfig | None:
    """The chosen config for head dim d (None when none fits)."""
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d}: the Gluon dK/dV kernel is laid out for {HEAD_DIMS}")
    feasible = [c for c in candidates(d) if not c.rejected]

    def preference(c: BwdConfig) -> tuple[int, ...]:
        return (c.block_m, -c.stages)

    return max(feasible, key=preference, default=None)


# ---------------------------------------------------------------------------------------
# Cross-compilation for sm90 (no GPU needed)
# ---------------------------------------------------------------------------------------


def _signature(cfg: BwdConfig, dtype: str) -> dict[str, str]:
    from triton.experimental.gluon import language as gl

    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    sig: dict[str, str] = {}
    for name, rows in (
        ("q_desc", cfg.block_m),
        ("do_desc", cfg.block_m),
        ("k_desc", BLOCK_N),
        ("v_desc", BLOCK_N),
    ):
        block = [1, rows, 1, cfg.head_dim]
        layout = gl.NVMMASharedLayout.get_default_for(block, gdt)
        sig[name] = f"tensordesc<{dtype}{block},{layout!r}>".replace(" ", "")
    row_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    for name in ("lse_desc", "delta_desc"):
        sig[name] = f"tensordesc<fp32[{cfg.block_m}],{row_layout!r}>".replace(" ", "")
    sig.update(dq_ptr="*fp32", dk_ptr=f"*{dtype}", dv_ptr=f"*{dtype}")
    ints = (
        "n_q",
        "n_keys",
        "n_heads",
        "group",
        "n_pad",
        "diag",
        "num_n_blocks",
        "stride_kn",
        "stride_kh",
    )
    sig.update(dict.fromkeys(ints, "i32"))
    sig.update(qk_scale="fp32", sm_scale="fp32")
    return sig


def compile_sm90(cfg: BwdConfig, causal: bool, dtype: str = "bf16"):
    """triton.compile of the kernel for sm90 as gluon_backward.prepare launches it; returns
    (compiled, ptxas log)."""
    import gluon_backward as gb
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gb.attn_bwd_dkdv_kernel
    consts = dict(
        CAUSAL=bool(causal),
        STAGES=cfg.stages,
        DQ_SPLIT=cfg.dq_split,
        CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs,
    )
    sig = _signature(cfg, dtype)
    sig.update(dict.fromkeys(consts, "constexpr"))
    sig = {name: sig[name] for name in fn.arg_names}
    # As a launch specialises them: pointers, and the ints that are multiples of 16.
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name].startswith("*") or name in DIVISIBLE
    }
    src = GluonASTSource(
        fn=fn,
        signature=sig,
        attrs=attrs,
        constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()},
    )
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        out = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": cfg.maxnreg}
        )
    return out, log.getvalue()


def resources(compiled_kernel, ptxas_log: str) -> dict:
    """Shared memory, spills, stack, setmaxnreg values and wgmma/atomic counts of a cubin."""
    from attngen.verify.compiler import _parse_ptxas_log, _resource_usage

    info: dict = {}
    info.update(_parse_ptxas_log(ptxas_log))
    info.update(_resource_usage(compiled_kernel.asm["cubin"]))
    ptx = compiled_kernel.asm["ptx"]
    info["shared"] = compiled_kernel.metadata.shared
    info["setmaxnreg"] = sorted(
        {int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
    )
    info["wgmma"] = len(re.findall(r"wgmma\.mma_async", ptx))
    info["atomics"] = {
        op: len(re.findall(re.escape(op) + r"\b", ptx)) for op in ("red.global", "atom.global")
    }
    info["atomic_forms"] = sorted(set(re.findall(r"\b(?:red|atom)\.global[\w.]*", ptx)))
    return info


def judge(cfg: BwdConfig, info: dict) -> list[str]:
    """The model against the cubin: exact shared memory, no spills, the derived registers."""
    problems = []
    if info["shared"] != cfg.smem:
        problems.append(f"shared {info['shared']} B != model {cfg.smem} B")
    if info.get("spill_stores") or info.get("stack"):
        problems.append(f"spills {info.get('spill_stores')} B, stack {info.get('stack')} B")
    wanted = {cfg.consumer_regs, cfg.producer_regs}
    if not wanted <= set(info["setmaxnreg"]):
        problems.append(f"setmaxnreg {info['setmaxnreg']} lacks {sorted(wanted)}")
    if not info["wgmma"]:
        problems.append("no wgmma in the PTX")
    return problems


def verify(configs: list[BwdConfig], dtypes=("bf16",), out_dir: str | None = None) -> list[dict]:
    """Compiles each config (causal and not), one at a time, in a private Triton cache; prints
    and returns one record per compile (problems empty when the model holds)."""
    rows = []
    saved = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="attngen-gluon-bwd-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            for cfg in configs:
                for dtype in dtypes:
                    for causal in (False, True):
                        rows.append(_verify_one(cfg, causal, dtype))
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gluon_backward_compile.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def _verify_one(cfg: BwdConfig, causal: bool, dtype: str) -> dict:
    record = dict(
        D=cfg.head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=BLOCK_N,
        stages=cfg.stages,
        causal=causal,
        dtype=dtype,
        model_smem=cfg.smem,
        model_regs=cfg.regs,
    )
    start = time.perf_counter()
    try:
        kernel, log = compile_sm90(cfg, causal, dtype)
        record.update(resources(kernel, log))
        record["problems"] = judge(cfg, record)
    except Exception as exc:  # noqa: BLE001 - recorded, the others go on
        first = (str(exc).strip().splitlines() or [""])[0]
        record["problems"] = [f"{type(exc).__name__}: {first[:400]}"]
    record["compile_s"] = round(time.perf_counter() - start, 1)
    return record


def proposed() -> list[BwdConfig]:
    """The configs the next GPU session runs: the derived one per head dim, and three stages
    at D 64 (the benchmark's variant)."""
    chosen = [c for c in (derive(d) for d in HEAD_DIMS) if c is not None]
    return [*chosen, candidate(64, derive(64).block_m, 3)]  # type: ignore[union-attr]


def table(rows: list[dict]) -> str:
    """One line per compile: config, shared memory (compiler / model), spills, verdict."""
    lines = [
        f"{'D':>4} {'BM':>4} {'S':>2} {'causal':>6} {'dtype':>5} {'shared':>7} {'model':>7} "
        f"{'spill':>5} {'setmaxnreg':>16} {'wgmma':>5}  verdict"
    ]
    for r in rows:
        verdict = "ok" if not r["problems"] else "; ".join(r["problems"])
        lines.append(
            f"{r['D']:>4} {r['BLOCK_M']:>4} {r['stages']:>2} {r['causal']!s:>6} {r['dtype']:>5} "
            f"{r.get('shared', '-')!s:>7} {r['model_smem']:>7} {r.get('spill_stores')!s:>5} "
            f"{str(r.get('setmaxnreg', '-')):>16} {r.get('wgmma', '-')!s:>5}  {verdict}"
        )
    return "\n".join(lines)
