"""The warp-specialized Gluon forward on Hopper: which specs it serves, and its derived config.

A CTA of the Gluon kernel (attngen/templates/_gluon_kernel.py.jinja) has one producer warp
that streams K/V blocks of BLOCK_N rows through a STAGES-deep shared-memory ring with TMA,
and NUM_CONSUMERS consumer warpgroups (128 threads each) that own BLOCK_M query rows apiece
(wgmma's M is 64 per warpgroup) and run QK^T, the online softmax and PV. Registers are moved
from the producer to the consumers with setmaxnreg: the CTA starts with MAXNREG registers per
thread (the register file over every warpgroup, the producer's included), the producer drops
to PRODUCER_REGS and each consumer rises to CONSUMER_REGS.

The model (sympy, gluon_model.py) in BM = BLOCK_M, BN = BLOCK_N, D, DV, E (element
bytes), S (stages) and NC (consumers):
- shared memory: the NC Q tiles (O goes back through them; with DV != D a slot of max(D, DV)
  columns, o_tile), S stages of K and V, the mbarrier arrays (two of NC, four of S: 8 B each,
  every array padded to 16 B but the smallest, placed last) and warp_specialize's buffer of
  the values the partitions take (WS_FIXED_BYTES, the compiler's count, 4 B more with a third
  consumer; a variant's extra 32-bit scalars, capture_words, grow it in 16-byte steps past
  its first 4 free bytes); exact against the compiler (`attngen verify-tiling`);
- registers per consumer thread: the fp32 O accumulator (BM x DV over 128 threads), the fp32
  score tile, P packed two 16-bit values a register, and CONSUMER_OVERHEAD for addresses,
  row statistics and loop state: a bound checked by the compiler's "no spills" at the chosen
  config (ptxas allocates up to the setmaxnreg cap whatever the kernel needs, so the count
  itself cannot be read back). With both a window and ALiBi the compiler keeps about two more
  [BM, BN] 32-bit tiles live (extra_tiles: at BLOCK_N 128 D 64 spilled 492 B, D 128 876 B;
  both compile clean at BLOCK_N 64, which the term then selects; D 256 has no config).

The choice: two consumers, or three at D 64 without a mask (preferred_consumers: measured on
an H100, three fit only with 160 registers each), the widest key block whose registers and
shared memory fit, then the fewest stages (at least two: one loading while one is read) whose
ring holds RING_BYTES of K/V. With two consumers that rule reproduces the tiles measured best
(D 64: 64x128, 3 stages; D 128: 64x128, 2; D 256: 64x64, 2).

Pure Python: nothing here imports sympy, torch or triton (evaluate.py reads the model).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from functools import cache
from itertools import product

from attngen.arch import ARCHS
from attngen.spec import AttnSpec, KernelKind, Mask
from attngen.spec.expressions import parsed
from attngen.spec.files import unverified_variants_on
from attngen.tiling.evaluate import Model, compiled, formula_text

SYMBOL_NAMES = ("NC", "BLOCK_M", "BLOCK_N", "D", "DV", "E", "S")  # the compiled model's arguments
GLUON_ARCH = "sm90"
# Head dims the kernel serves (D and DV each). O's wgmma takes N = DV, the TMA boxes are
# [BLOCK_N, D] and [BLOCK_N, DV] and the kernel has no head-dim padding or masks, so a dim
# needs its own layouts, register budget and a GPU check; these three are the ones checked on
# the H200 (tools/gluon_forward_check.py@31eda103), D == DV. With D != DV ("head_dim !=
# head_dim_v"), Q's slot holds the wider of the two tiles and Q and O are views of it.
GLUON_HEAD_DIMS = (64, 128, 256)
WARPGROUP = 128  # threads
REGISTER_FILE = 65536  # 32-bit registers per SM, one CTA per SM
PRODUCER_REGS = 24  # setmaxnreg's minimum: the producer only issues TMA copies
MAX_SETMAXNREG = 256
# Registers beyond the tiles (addresses, row statistics, loop state); at the boundary D 64 x
# three consumers x BLOCK_N 128 (tiles 128 a thread, the cap 160) compiles with no spill.
CONSUMER_OVERHEAD = 32
WS_FIXED_BYTES = 280  # warp_specialize's own shared memory (the compiler's, every config)
RING_BYTES = 96 * 1024  # K/V bytes the ring holds at least (covers the load latency)
BLOCK_M_CHOICES = (64,)  # one warpgroup's wgmma M
BLOCK_N_CHOICES = (64, 128)
STAGES_CHOICES = (2, 3, 4)
CONSUMER_CHOICES = (2, 3)
WINDOWED = ("sliding_window", "chunked")  # masks whose CTA reads a key range of its own
VARLEN_WORDS = 4  # q_first, k_first, out's row pointer and stride: one more 16-byte step
LISTING_WORDS = 9  # a block mask's: two list pointers, their strides, counts and block sizes
# Variants the kernel implements, named as gluon_gap names them ("backward": gluon_backward.py's
# dK/dV kernel). Those in GLUON_UNVERIFIED wait for their GPU tests: built only with
# ATTNGEN_GLUON_VARIANTS=1 (on-demand builds cached apart) until they pass and leave the set.
GLUON_VARIANTS = frozenset({"mask sliding_window", "mask chunked", "sink tokens", "softcap",
    "ALiBi", "sinks", "backward", "varlen", "head_dim != head_dim_v", "backward d256",
    "score_mod/mask_mod", "backward score_mod/mask_mod"})  # fmt: skip
GLUON_UNVERIFIED: frozenset[str] = frozenset()


def gluon_gap(spec: AttnSpec, arch: str, kind: KernelKind) -> str:
    """Why the `kind` module of `spec` on `arch` has no Gluon forward ("" when it has one).
    Each reason is a feature the kernel does not implement yet; those calls stay on the
    tile-level kernel, which serves every spec."""
    if arch != GLUON_ARCH:
        return f"{arch} has no warp-specialized kernel (wgmma, TMA and setmaxnreg are sm90's)"
    served = GLUON_VARIANTS - (frozenset() if unverified_variants_on() else GLUON_UNVERIFIED)
    if kind is not KernelKind.prefill and (kind is not KernelKind.varlen or "varlen" not in served):
        return f"{kind.value}: packed sequences need per-sequence descriptors (not written yet)"
    if spec.dtype.itemsize != 2:
        return f"{spec.dtype.value}: wgmma takes 16-bit operands"
    unserved = sorted({spec.head_dim, spec.value_head_dim} - set(GLUON_HEAD_DIMS))
    if unserved:
        dims = ", ".join(map(str, GLUON_HEAD_DIMS))
        return f"head dim {unserved[0]}: the kernel is laid out and checked for {dims} only"
    expressions = spec.score_mod is not None or spec.mask_mod is not None
    if expressions and (kind is KernelKind.varlen or spec.mask.value in WINDOWED
                        or spec.sink_tokens):  # fmt: skip
        return "score_mod/mask_mod with varlen, a window or sink tokens: not in the kernel yet"
    for present, feature in (
        (spec.head_dim != spec.value_head_dim, "head_dim != head_dim_v"),
        (spec.mask.value not in ("none", "causal"), f"mask {spec.mask.value}"),
        (spec.softcap, "softcap"),
        (spec.alibi, "ALiBi"),
        (spec.sinks, "sinks"),
        (spec.dropout, "dropout"),
        (expressions, "score_mod/mask_mod"),
        (spec.sink_tokens, "sink tokens"),
    ):
        if present and feature not in served:
            return f"{feature}: not in the warp-specialized kernel yet"
    return ""


@dataclass(frozen=True)
class GluonConfig:
    consumers: int
    block_m: int  # rows per consumer warpgroup
    block_n: int
    stages: int
    consumer_regs: int
    producer_regs: int
    maxnreg: int  # registers per thread at entry (the launch's maxnreg)

    def describe(self) -> str:
        return (
            f"{self.consumers} consumer warpgroups x {self.block_m} rows, BLOCK_N "
            f"{self.block_n}, {self.stages} stages, setmaxnreg {self.consumer_regs}/"
            f"{self.producer_regs} (entry {self.maxnreg})"
        )


@dataclass(frozen=True)
class GluonCandidate:
    config: GluonConfig
    smem_bytes: int
    consumer_regs_needed: int
    rejected: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return not self.rejected


@dataclass(frozen=True)
class GluonDerivation:
    arch: str
    candidates: tuple[GluonCandidate, ...]
    chosen: GluonCandidate | None
    words: int = 0  # capture_words of the spec
    tiles: int = 0  # extra_tiles of the spec
    o_tile: bool = False  # Q's slots hold max(D, DV) columns, O a view (DV != D)
    source: str = "derived"  # or "tuned on <GPU>, <date>" (tuning.database.tuned_gluon), or why not

    def summary_lines(self) -> tuple[str, ...]:
        """The header's and explain's lines: the model and the chosen config's numbers."""
        budget = ARCHS[self.arch].smem_budget
        feasible = sum(c.feasible for c in self.candidates)
        smem = f"shared memory = {formula_text(smem_model(self.words, self.o_tile))}"
        lines = [
            "Gluon forward (warp-specialized, sm90):",
            *textwrap.wrap(smem, 88, initial_indent="  ", subsequent_indent="    "),
            f"  consumer registers ~ {formula_text(regs_model(self.tiles))}",
        ]
        best = self.chosen
        if best is None:
            return (*lines, f"  no config fits ({len(self.candidates)} candidates)")
        return (
            *lines,
            f"  {best.config.describe()}",
            f"  = {best.smem_bytes} B of {budget} B, consumer registers ~"
            f"{best.consumer_regs_needed} of {best.config.consumer_regs}",
            f"  {feasible} of {len(self.candidates)} feasible; rule: two consumers (three at D 64",
            f"  unmasked), the widest BLOCK_N, the fewest stages holding {RING_BYTES // 1024} KiB",
            *(() if self.source == "derived" else (f"  config: {self.source}",)),
        )


def capture_words(spec: AttnSpec, kind: KernelKind = KernelKind.prefill) -> int:
    """The 32-bit scalars the variant's kernel hands its partitions beyond the plain one's:
    the window's (or chunk's) first key, first seen key and first unmasked block; the ALiBi
    slope; the sink; the sink tokens' block count; varlen's VARLEN_WORDS (the first key row,
    out's pointer and strides); score_mod / mask_mod's tensors (a pointer, its strides, the
    named dims) and a block mask's listing (LISTING_WORDS)."""
    words = 3 * (spec.mask.value in WINDOWED) + spec.alibi + spec.sinks + bool(spec.sink_tokens)
    if spec.score_mod is not None or spec.mask_mod is not None:  # the tensors' and the listing's
        dims = {d for t in spec.tensors for d in t.shape if isinstance(d, str)}
        words += sum(2 + len(t.shape) for t in spec.tensors) + len(dims) + LISTING_WORDS
    return words + VARLEN_WORDS * (kind is KernelKind.varlen)


def extra_tiles(spec: AttnSpec) -> int:
    """[BM, BN] 32-bit tiles a consumer keeps beyond S and P: two with a window (or chunks)
    and ALiBi; two for each tensor score_mod or mask_mod reads at both q_idx and kv_idx (a
    gather: its 64-bit addresses; cross-compiled: a relative bias table spills 724 B at D 128
    BLOCK_N 128 without them)."""
    reads = 0
    for tree in (parsed(spec, "score_mod"), parsed(spec, "mask_mod")):
        for node in tree.nodes() if tree is not None else ():
            used = {str(n.value) for n in node.nodes() if n.op == "var"}
            reads += node.op == "load" and {"q_idx", "kv_idx"} <= used
    return 2 * (spec.mask.value in WINDOWED and spec.alibi) + 2 * reads


def smem_model(words: int = 0, o_tile: bool = False) -> Model:
    return Model("gluon_model.smem_expression", (words, o_tile))


def regs_model(tiles: int = 0) -> Model:
    return Model("gluon_model.consumer_regs_expression", (tiles,))


def register_split(consumers: int) -> tuple[int, int, int]:
    """(consumer, producer, entry) registers per thread: the register file over every
    warpgroup at entry, rounded down to 8; the producer keeps PRODUCER_REGS and the consumers
    share the rest (setmaxnreg takes multiples of 8 up to 256)."""
    per_thread = REGISTER_FILE // WARPGROUP
    entry = per_thread // (consumers + 1) // 8 * 8
    consumer = min(MAX_SETMAXNREG, (per_thread - PRODUCER_REGS) // consumers // 8 * 8)
    return consumer, PRODUCER_REGS, entry


def _candidate(d: int, dv: int, itemsize: int, consumers: int, block_m: int, block_n: int,
               stages: int, budget: int, words: int, tiles: int) -> GluonCandidate:  # fmt: skip
    values = (consumers, block_m, block_n, d, dv, itemsize, stages)
    smem = int(compiled(smem_model(words, d != dv), SYMBOL_NAMES)(*values))
    regs = compiled(regs_model(tiles), SYMBOL_NAMES)(*values)
    consumer_regs, producer_regs, entry = register_split(consumers)
    rejected = [f"smem {smem} B > {budget} B"] if smem > budget else []
    rejected += [f"consumer regs ~{int(regs)} > {consumer_regs}"] if regs > consumer_regs else []
    config = GluonConfig(consumers, block_m, block_n, stages, consumer_regs, producer_regs, entry)
    return GluonCandidate(config, smem, int(regs), tuple(rejected))


def preferred_consumers(spec: AttnSpec, kind: KernelKind) -> int:
    """Three consumers at D 64 without a mask or a variant (prefill), else two. Measured on an
    H100 (ab_templates.py --b-gluon, docs/performance.md): three x BLOCK_N 128 ran 0.88-0.98x
    of two's time at N 16k-1k; causal 0.94-1.54x (each consumer runs all its CTA's key blocks:
    96 consumer-blocks at N 1k to two's 72), so a mask keeps two; varlen, variants unmeasured."""
    variant = spec.softcap or spec.alibi or spec.sinks or spec.score_mod or spec.mask_mod
    plain_d64 = spec.head_dim == spec.value_head_dim == 64 and spec.mask is Mask.none
    return 3 if plain_d64 and not variant and kind is KernelKind.prefill else 2


def _preference(candidate: GluonCandidate, itemsize: int, d: int, dv: int) -> tuple[int, ...]:
    config = candidate.config
    ring = config.stages * config.block_n * (d + dv) * itemsize
    enough = ring >= RING_BYTES
    stages = -config.stages if enough else config.stages  # the fewest that hold RING_BYTES
    return (config.block_n, enough, stages)


def derive_gluon_tiles(
    spec: AttnSpec, arch: str, kind: KernelKind = KernelKind.prefill
) -> GluonDerivation | None:
    """The Gluon forward's derivation for the `kind` module (prefill or varlen) of `spec` on
    `arch`, or None when gluon_gap says the module has no Gluon forward."""
    return _derive_gluon_tiles(spec, arch, kind, unverified_variants_on())


@cache
def _derive_gluon_tiles(spec: AttnSpec, arch: str, kind: KernelKind,
                        unverified: bool) -> GluonDerivation | None:  # fmt: skip
    if gluon_gap(spec, arch, kind):
        return None
    d, dv, itemsize = spec.head_dim, spec.value_head_dim, spec.dtype.itemsize
    words, tiles, budget = capture_words(spec, kind), extra_tiles(spec), ARCHS[arch].smem_budget
    choices = product(CONSUMER_CHOICES, BLOCK_M_CHOICES, BLOCK_N_CHOICES, STAGES_CHOICES)
    candidates = tuple(_candidate(d, dv, itemsize, *c, budget, words, tiles) for c in choices)
    feasible = [c for c in candidates if c.feasible]
    consumers = preferred_consumers(spec, kind)
    rank = lambda c: (c.config.consumers == consumers, *_preference(c, itemsize, d, dv))  # noqa: E731
    chosen = max(feasible, key=rank, default=None)
    return GluonDerivation(arch, candidates, chosen, words, tiles, d != dv)
