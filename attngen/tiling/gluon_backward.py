"""The warp-specialized Gluon dK/dV backward on Hopper: which specs it serves, and its config.

A CTA of the kernel (attngen/templates/_gluon_backward.py.jinja) owns BLOCK_N = 128 keys of one
(batch, KV head): a producer warp loads K and V once and streams STAGES slots of (Q, LSE) and
(dO, delta), BLOCK_M query rows apiece, of every query head of the group; two consumer
warpgroups own 64 key rows each (wgmma's M) and keep dK and dV in fp32 registers for the loop;
they compute S^T = K Q^T and dP^T = V dO^T, so that P^T and dS^T are dV's and dK's register
operands (only dS^T goes to shared memory, for dQ); dQ = dS K goes to an fp32 accumulator by
TMA reduce-adds (five products, not seven). The register split is the forward's
(register_split: 240 a consumer, 24 the producer, 168 at entry).

The model (sympy, gluon_model.py) in BM = BLOCK_M, BN = BLOCK_N, D, E (element bytes),
S (stages), NC (consumers) and C (dQ columns a consumer computes):
- shared memory: K and V [BN, D] resident, S slots of Q and dO [BM, D] and of LSE and delta
  [BM] fp32, two dS^T slots [BN, BM], per consumer dQ's fp32 staging [BM, C] that the TMA
  reduce reads, the partitions' captured arguments (WS_CAPTURE_BYTES), the barriers (three
  [S, 1] and two [2, 1] arrays of 8 B, each padded to 16 B; K and V's one barrier adds no
  bytes: the compiler fits its 8 B into an alignment gap, at S 2 and 3); exact against the
  compiler (`attngen verify-tiling --gluon`);
- registers per consumer thread: dK_c and dV_c ([BN / NC, D] fp32 over 128 threads), plus the
  larger of the score phase (S^T and dP^T fp32, delta by column: BM / 4 a thread) and the dQ
  phase (its accumulator), plus OVERHEAD: a bound the compiler's spills check at the chosen config.

The choice: the widest BLOCK_M that fits (each query block costs five wgmma issues and a
barrier round; FASTER_SPILLING past the register count where measured faster), then the fewest
stages (two: a step's five GEMMs cover the next block's load); plain specs at D 128 issue
each step's dQ GEMM a step late (DQ_LATE_HEAD_DIMS). D 256 has a form of its own
(_gluon_backward_d256.py.jinja; dK_c and dV_c [64, 256] fp32 would be 256 registers a thread):
BLOCK_N 64, the warpgroups split by role (one keeps dV, the other dK: D x BN / 128 registers
each), dQ staged in [BM, 32] pieces (C 32 in the model), three [2, 1] barrier arrays; BLOCK_M
64 (its prototype's, d256_proto@21f4bb68).

score_mod / mask_mod (EXPRESSIONS): the steps come from the key block's lists, whose listing
and the expressions' tensors add captured arguments (expression_capture_bytes, exact); at D 128
their tiles spill past the 240-register cap (28-256 B, tests/test_gluon_backward.py
EXPRESSION_SPILLS), at D 64 nothing. Served (GPU-tested: tests/test_gluon_backward_gpu.py)
but for causal calls with fewer than SHORT_CAUSAL_KEYS keys, which take the tile-level
kernels. Pure Python (evaluate.py reads the model).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace
from functools import cache
from itertools import product

from attngen.arch import ARCHS
from attngen.spec import AttnSpec, KernelKind
from attngen.spec.expressions import parsed
from attngen.spec.files import unverified_variants_on
from attngen.tiling.evaluate import Model, compiled, formula_text
from attngen.tiling.gluon import GLUON_UNVERIFIED, gluon_gap, register_split

SYMBOL_NAMES = ("NC", "BLOCK_M", "BLOCK_N", "D", "E", "S", "C")  # the compiled model's arguments
BACKWARD = "backward"  # its name in GLUON_VARIANTS / GLUON_UNVERIFIED
D256 = "backward d256"  # the D 256 form's
EXPRESSIONS = "backward score_mod/mask_mod"  # score_mod / mask_mod and block masks
D256_CONSUMER_REGS = 232
HEAD_DIMS = (64, 128, 256)
CONSUMERS = 2
BLOCK_N = 128  # two consumers x 64 key rows
BLOCK_M_CHOICES = (64, 128)
STAGES_CHOICES = (2, 3)
# Registers beyond the tiles (addresses, barrier phases, loop state), fitted to the compiler
# at the boundary: D 64 x BLOCK_M 128 (16 above the cap) spills 136 B.
OVERHEAD = 32
# warp_specialize's captured arguments, in the compiler's scratch (the same at every config)
WS_CAPTURE_BYTES = 416
ALIBI_CAPTURE_BYTES = 16  # ALiBi's slopes pointer and batch stride beside them (16 B padded)
# score_mod / mask_mod: the lists' listing (two pointers, six ints) and the step count replace
# the query range's two ints, net LISTING_BYTES; the capture area, packed without gaps, ends
# CAPTURE_PHASE bytes into a 16-byte granule (fitted to the compiler; exact for the 24
# expression kernels of tests/test_gluon_backward.py's compile test).
LISTING_BYTES, CAPTURE_PHASE = 40, 6
# (D, BLOCK_M) past the model's registers for plain specs (no softcap, ALiBi or expressions):
# D 64 x 128 spills 60-68 B and ran 1.05-1.07x as fast as x 64 at N 4k-16k (docs/performance.md),
# causal too, but lost 9% at N 1k (half its steps meet the diagonal): causal calls take it from
# LONG_CAUSAL_KEYS keys (the module's long causal form), BLOCK_M 64 below.
FASTER_SPILLING = frozenset({(64, 128)})
LONG_CAUSAL_KEYS = 4096
# Plain specs (none or causal, no softcap, ALiBi or expressions) at these head dims issue each
# step's dQ GEMM a step late, so the consumers meet at dS^T a step apart: on an H100 (A/B of
# tools/ab_alt/bwd_dq_one_step_late.patch@83ac9e2d, N 4k / 16k) 1.10 / 1.075x without a mask,
# 1.01 / 1.00x causal; at D 64 BLOCK_M 128 it spills 188 B (not measured there).
DQ_LATE_HEAD_DIMS = (128,)
_DQ_FORMS = ("by turns", "split by columns", "split by rows")
# Against the tile-level backward in one process (H100, tools/ab_templates.py --short-causal):
# causal, the Gluon kernel ran 1.11-1.16x its time at N 256, 0.99-1.02x N 512, 0.87-0.89x N 1k.
SHORT_CAUSAL_KEYS = 1024
# Causal key blocks of this many (batch, KV head)s interleaved, heavy first: greedy scheduling
# on 132 SMs models a tail of 3-7% at N 2k-8k head by head, 0.2% for 4 (their Q, dO in L2).
HEAVY_FIRST = 4


def gluon_backward_gap(spec: AttnSpec, arch: str, kind: KernelKind) -> str:
    """Why the `kind` module of `spec` on `arch` has no Gluon backward ("" when it has one):
    it needs the Gluon forward's conditions, no mask, causal or a window (ALiBi and softcap
    served with each), D 64 or 128, no sinks or sink tokens."""
    if not spec.backward:
        return "backward: false"
    gap = gluon_gap(spec, arch, kind)
    if gap or kind is not KernelKind.prefill:
        return gap or f"{kind.value}: the dK/dV kernel reads padded batches only"
    if spec.head_dim not in HEAD_DIMS:
        return f"head dim {spec.head_dim}: the backward kernel is laid out for 64, 128 and 256"
    d256 = spec.head_dim == 256
    expressions = spec.score_mod is not None or spec.mask_mod is not None
    forms = {BACKWARD, D256 if d256 else BACKWARD, EXPRESSIONS if expressions else BACKWARD}
    if (waiting := forms & GLUON_UNVERIFIED) and not unverified_variants_on():
        return f"{min(waiting)}: not verified on a GPU yet (built with ATTNGEN_GLUON_VARIANTS=1)"
    unserved = (
        (d256 and (spec.mask.value == "sliding_window" or spec.softcap or spec.alibi),
         "head dim 256 with a window, softcap or ALiBi"),
        (spec.mask.value not in ("none", "causal", "sliding_window"), f"mask {spec.mask.value}"),
        (spec.sink_tokens, "sink tokens"),
        (spec.sinks, "sinks"),
        (expressions and (spec.softcap or spec.alibi or d256),
         "score_mod/mask_mod with softcap, ALiBi or head dim 256"),
        (any(t.trainable for t in spec.tensors), "a trainable tensor"),
        (spec.head_dim != spec.value_head_dim, "head_dim != head_dim_v"),
    )  # fmt: skip
    for present, feature in unserved:
        if present:
            return f"{feature}: not in the Gluon backward yet"
    return ""


def dq_columns(d: int, block_m: int = 64) -> int:
    """dQ columns one consumer computes: half of them from D 128 (K's columns sliced at a
    128-byte swizzle atom), all of them below (the consumers take turns); at BLOCK_M 128 the
    consumers split dQ's rows, as many elements as half of its columns."""
    return d // 2 if d >= 128 or block_m == 128 else d


def smem_model() -> Model:
    return Model("gluon_model.backward_smem_expression")


def regs_model(d256: bool = False) -> Model:
    return Model("gluon_model.backward_regs_expression", (d256,))


D256_SMEM_EXTRA = 16  # D 256's third [2, 1] barrier array (P ready), padded to 16 B


@dataclass(frozen=True)
class BwdConfig:
    block_m: int
    block_n: int
    stages: int
    dq_split: bool  # dQ's columns (rows at BLOCK_M 128) split, else whole on alternate ones
    consumer_regs: int
    producer_regs: int
    maxnreg: int
    dq_late: bool = False  # each step issues the step before's dQ (DQ_LATE_HEAD_DIMS)

    def describe(self) -> str:
        roles = "2 consumer warpgroups x 64 keys" if self.block_n == 128 else "P and dS roles"
        return (
            f"BLOCK_M {self.block_m}, BLOCK_N {self.block_n} ({roles}), "
            f"{self.stages} stages, dQ {_DQ_FORMS[self.dq_split + (self.block_m == 128)]}"
            f"{' a step late' if self.dq_late else ''}, "
            f"setmaxnreg {self.consumer_regs}/{self.producer_regs} (entry {self.maxnreg})"
        )


@dataclass(frozen=True)
class BwdCandidate:
    config: BwdConfig
    smem_bytes: int
    regs_needed: int
    rejected: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return not self.rejected


def candidate(d: int, itemsize: int, block_m: int, stages: int, budget: int, captured: int = 0,
              plain: bool = False) -> BwdCandidate:  # fmt: skip
    block_n, columns = (64, 32) if d == 256 else (BLOCK_N, dq_columns(d, block_m))
    values = (CONSUMERS, block_m, block_n, d, itemsize, stages, columns)
    smem = int(compiled(smem_model(), SYMBOL_NAMES)(*values)) + captured
    smem += D256_SMEM_EXTRA * (d == 256)
    regs = int(compiled(regs_model(d == 256), SYMBOL_NAMES)(*values))
    consumer, producer, entry = register_split(CONSUMERS)
    # D 256 at 232: 20 B spilled at 240, not at 232 (docs/d256_backward_study.md's compile table)
    consumer = D256_CONSUMER_REGS if d == 256 else consumer
    rejected = [f"smem {smem} B > {budget} B"] if smem > budget else []
    measured = plain and (d, block_m) in FASTER_SPILLING  # the model's count, but measured
    rejected += [f"consumer regs ~{regs} > {consumer}"] if regs > consumer and not measured else []
    rejected += ["D 256: BLOCK_M 64 only (its prototype's)"] if d == 256 and block_m != 64 else []
    config = BwdConfig(block_m, block_n, stages, columns < d, consumer, producer, entry)
    return BwdCandidate(config, smem, regs, tuple(rejected))


@dataclass(frozen=True)
class BwdDerivation:
    arch: str
    candidates: tuple[BwdCandidate, ...]
    chosen: BwdCandidate | None
    long_causal: BwdCandidate | None = None  # causal calls from LONG_CAUSAL_KEYS keys

    def summary_lines(self) -> tuple[str, ...]:
        """The header's and explain's lines: the model and the chosen config's numbers."""
        lines = [
            "Gluon dK/dV backward (warp-specialized, sm90; deterministic=False):",
            f"  shared memory = {formula_text(smem_model())}",
            f"  consumer registers ~ {formula_text(regs_model())}",
        ]
        if (best := self.chosen) is None:
            lines.append(f"  no config fits ({len(self.candidates)} candidates)")
        else:
            feasible = sum(c.feasible for c in self.candidates)
            lines += [
                f"  {best.config.describe()}",
                f"  = {best.smem_bytes} B of {ARCHS[self.arch].smem_budget} B, consumer "
                f"registers ~{best.regs_needed} of {best.config.consumer_regs}",
                f"  {feasible} of {len(self.candidates)} feasible; rule: the widest BLOCK_M "
                "(FASTER_SPILLING's past the registers: measured faster), the fewest stages",
            ]
        if (long := self.long_causal) is not None:
            lines.append(f"  causal, {LONG_CAUSAL_KEYS} keys or more: {long.config.describe()}")
        # Wrapped to 88 columns (the header's lines stay within 100).
        return tuple(w for line in lines for w in textwrap.wrap(line, 88, subsequent_indent="    "))


def expression_capture_bytes(spec: AttnSpec) -> int:
    """Shared memory that score_mod / mask_mod add to the captured arguments: LISTING_BYTES,
    less qk_scale (a score_mod reads sm_scale), plus the diagonal (causal or kv_idx read), the
    group's first head (h read), and each read tensor's pointer (8 B), strides and named dims
    (4 B each); the area grows in 16-byte granules from CAPTURE_PHASE."""
    trees = [t for t in (parsed(spec, "score_mod"), parsed(spec, "mask_mod")) if t is not None]
    if not trees:
        return 0
    nodes = [n for tree in trees for n in tree.nodes()]
    names = {str(n.value) for n in nodes if n.op == "var"}
    read = {str(n.value) for n in nodes if n.op == "load"}
    tensors = [t for t in spec.tensors if t.name in read]
    dims = {d for t in tensors for d in t.shape if isinstance(d, str)}
    added = LISTING_BYTES - 4 * (spec.score_mod is not None) + 4 * ("h" in names)
    added += 4 * (spec.mask.value == "causal" or "kv_idx" in names) + 4 * len(dims)
    added += sum(8 + 4 * len(t.shape) for t in tensors)
    return -(-(added + CAPTURE_PHASE) // 16) * 16 - 16


def derive_gluon_backward(spec: AttnSpec, arch: str) -> BwdDerivation | None:
    """The Gluon backward's derivation for a prefill module of `spec` on `arch`, or None when
    gluon_backward_gap says the module has none."""
    if gluon_backward_gap(spec, arch, KernelKind.prefill):
        return None
    captured = ALIBI_CAPTURE_BYTES * spec.alibi + expression_capture_bytes(spec)
    plain = spec.mask.value in ("none", "causal") and not (spec.softcap or captured)
    values = (spec.head_dim, spec.dtype.itemsize, arch, captured)
    derivation = _derive(*values, plain and spec.mask.value == "none")
    long = _derive(*values, True).chosen if plain and spec.mask.value == "causal" else None
    if plain and spec.head_dim in DQ_LATE_HEAD_DIMS:
        derivation = replace(derivation, chosen=_late(derivation.chosen))
        long = _late(long)
    if long is None or derivation.chosen is None or long.config == derivation.chosen.config:
        return derivation
    return BwdDerivation(derivation.arch, derivation.candidates, derivation.chosen, long)


def _late(chosen: BwdCandidate | None) -> BwdCandidate | None:
    return chosen and replace(chosen, config=replace(chosen.config, dq_late=True))


@cache
def _derive(d: int, itemsize: int, arch: str, captured: int, plain: bool) -> BwdDerivation:
    budget, choices = ARCHS[arch].smem_budget, product(BLOCK_M_CHOICES, STAGES_CHOICES)
    candidates = tuple(candidate(d, itemsize, bm, s, budget, captured, plain) for bm, s in choices)
    feasible = [c for c in candidates if c.feasible]
    best = max(feasible, key=lambda c: (c.config.block_m, -c.config.stages), default=None)
    return BwdDerivation(arch, candidates, best)
