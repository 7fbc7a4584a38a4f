"""`attngen explain`: the tile derivation of each spec on each arch, in words and numbers."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from attngen.arch import ARCHS
from attngen.spec import AttnSpec, KernelKind
from attngen.spec.expression_grad import gradients
from attngen.spec.expressions import declared, parsed, render_mod
from attngen.tiling import gluon_backward as gb
from attngen.tiling.alternatives import nearest_alternative
from attngen.tiling.backward import BackwardDerivation
from attngen.tiling.code_paths import code_paths
from attngen.tiling.decode import derive_decode_tiles, latent_rope_split, split_lines
from attngen.tiling.decode_latent import derive_latent_tiles
from attngen.tiling.gluon import derive_gluon_tiles, gluon_gap
from attngen.tiling.prefill import (
    REFERENCE_TOKENS,
    Candidate,
    Derivation,
    derive_tiles,
    padded_head_dim,
)
from attngen.tuning.database import apply_tuning, lookup, tuned_backward_tiles, tuned_gluon

TOP_FEASIBLE = 6
REJECTED_SAMPLE = 4


def explain_lines(
    specs: Iterable[AttnSpec], archs: Iterable[str] | None = None, tuning_dir: Path | None = None
) -> list[str]:
    wanted = None if archs is None else set(archs)
    lines: list[str] = []
    for spec in specs:
        lines += expression_lines(spec)
        for arch in spec.archs:
            if wanted is None or arch in wanted:
                # Kinds that end with the same config (varlen shares prefill's key loop and,
                # without its own tuning entry, prefill's tuned config) are explained once.
                groups: dict[object, tuple[Derivation, list[str]]] = {}
                for kind in spec.kernels:
                    if kind is KernelKind.decode:
                        continue
                    record = lookup(tuning_dir, spec, kind, arch)
                    derivation = apply_tuning(derive_tiles(spec, arch), record)
                    groups.setdefault(derivation.chosen, (derivation, []))[1].append(kind.value)
                for derivation, kinds in groups.values():
                    section = explain_one(spec, derivation)
                    paths = [
                        f"   code paths ({kind}): "
                        f"{code_paths(spec, arch, KernelKind(kind)).describe()}"
                        for kind in kinds
                    ]
                    forward = [
                        line
                        for kind in kinds
                        for line in forward_lines(spec, arch, KernelKind(kind), tuning_dir)
                    ]
                    lines += [
                        section[0],
                        f"   kernels: {', '.join(kinds)}",
                        *paths,
                        *forward,
                        *section[1:],
                        "",
                    ]
                if spec.backward:
                    backward = tuned_backward_tiles(tuning_dir, spec, arch)
                    lines += [*explain_backward(spec, backward), ""]
                if KernelKind.decode in spec.kernels:
                    lines += [*explain_decode(spec, derive_decode_tiles(spec, arch)), ""]
    return lines


def expression_lines(spec: AttnSpec) -> list[str]:
    """score_mod and mask_mod (attngen.spec.expressions): the parsed tree, its type, the kernel
    text, and score_mod's gradients derived with sympy (attngen.spec.expression_grad)."""
    tensors = declared(spec)
    lines = [
        f"{spec.name}: tensor {t.name}: {t.dtype} [{', '.join(map(str, t.shape))}]"
        + (" (trainable)" if t.trainable else "")
        for t in tensors
    ]
    for field in ("score_mod", "mask_mod"):
        tree = parsed(spec, field)
        if tree is None:
            continue
        lines += [
            f"{spec.name}: {field} = {tree}  ({tree.type})",
            f"   kernel: {render_mod(field, tree, tensors)}",
        ]
        if field == "score_mod":
            for name, grad in gradients(tree, tensors).items():
                lines.append(f"   d {field} / d {name} = {grad}  (multiplies dS)")
    return lines + ([""] if lines else [])


def forward_lines(
    spec: AttnSpec, arch: str, kind: KernelKind, tuning_dir: Path | None = None
) -> list[str]:
    """Which template the `kind` module's forward renders from, and why; with the Gluon
    forward, its derivation (attngen/tiling/gluon.py) and its config's source: tuned (a
    prefill module with a usable "gluon" tuning field), else derived and why."""
    gap = gluon_gap(spec, arch, kind)
    derivation = None
    if not gap and kind is KernelKind.prefill:
        derivation = tuned_gluon(tuning_dir, spec, arch)
    elif not gap:  # varlen modules keep the derived config
        derivation = derive_gluon_tiles(spec, arch, kind)
    if derivation is None or derivation.chosen is None:
        why = gap or "no Gluon config fits"
        return [f"   forward ({kind.value}): tile-level (prefill.py.jinja) only: {why}"]
    return [
        f"   forward ({kind.value}): warp-specialized Gluon (_gluon_kernel.py.jinja) on CUDA "
        "where a call's layout fits TMA; tile-level (prefill.py.jinja) otherwise and under "
        "the interpreter",
        *(f"     {line}" for line in derivation.summary_lines()),
        *(["       config: derived"] if derivation.source == "derived" else []),
    ]


def explain_backward(spec: AttnSpec, backward: BackwardDerivation) -> list[str]:
    """The gradient kernels' models (attngen/tiling/backward.py) and their chosen configs."""
    lines = [f"-- {spec.name} on {backward.dq.arch}: backward (prefill and varlen modules)"]
    for label, derivation in backward.launches():
        feasible = sum(c.feasible for c in derivation.candidates)
        lines += [
            f"   {label}: shared memory = {derivation.expressions['smem']}",
            f"     registers/thr ~= {derivation.expressions['regs']}",
            f"     {feasible} of {len(derivation.candidates)} candidates feasible",
        ]
    lines += [f"   {line}" for line in backward.summary_lines()]
    return lines + gluon_backward_lines(spec, backward.dq.arch)


def gluon_backward_lines(spec: AttnSpec, arch: str) -> list[str]:
    """Whether the prefill module's dK/dV runs the Gluon kernel, and its derivation
    (attngen/tiling/gluon_backward.py), or why not."""
    gap = "no prefill module"
    if KernelKind.prefill in spec.kernels:
        gap = gb.gluon_backward_gap(spec, arch, KernelKind.prefill)
    derivation = None if gap else gb.derive_gluon_backward(spec, arch)
    if derivation is None or derivation.chosen is None:
        why = gap or "no Gluon config fits"
        return [f"   dK/dV (prefill): tile-level only: {why}"]
    short = f", deterministic for causal calls under {gb.SHORT_CAUSAL_KEYS} keys (faster there)"
    short = short if spec.mask.value == "causal" else ""
    return [
        "   dK/dV (prefill): warp-specialized Gluon (_gluon_backward.py.jinja; deterministic=True: "
        "without dQ, the dQ kernel's) on CUDA where a call's layout fits TMA; tile-level "
        f"otherwise and under the interpreter{short}",
        *(f"     {line}" for line in derivation.summary_lines()),
    ]


def explain_one(spec: AttnSpec, derivation: Derivation) -> list[str]:
    arch = ARCHS[derivation.arch]
    d, dv = padded_head_dim(spec.head_dim), padded_head_dim(spec.value_head_dim)
    lines = [
        f"== {spec.name} on {arch.name} ({arch.part}, {arch.sm_count} SMs, "
        f"{arch.smem_budget} B shared/block, {arch.regs_per_sm} registers/SM)",
        f"   dtype {spec.dtype.value} (E = {spec.dtype.itemsize} B), head dims {spec.head_dim}/"
        f"{spec.value_head_dim} padded to D = {d}, DV = {dv} for tl.dot",
        f"   model (D={d}, DV={dv}, E={spec.dtype.itemsize} substituted):",
        f"     shared memory  = {derivation.expressions['smem']}",
        f"     registers/thr ~= {derivation.expressions['regs']}",
        f"     score          = {derivation.expressions['score']} x occupancy x waves",
        f"     waves          = {derivation.expressions['waves']}  (batch 1, "
        f"{REFERENCE_TOKENS} tokens, R programs/SM)",
        "   constraints:",
        *(f"     {label}" for label in derivation.constraints),
    ]
    feasible = sorted(
        (c for c in derivation.candidates if c.feasible), key=lambda c: (-c.score, c.smem_bytes)
    )
    rejected = [c for c in derivation.candidates if not c.feasible]
    counts = f"({len(feasible)} feasible, {len(rejected)} rejected)"
    lines.append(f"   candidates: {len(derivation.candidates)} {counts}")
    lines.append("     BLOCK_M BLOCK_N warps stages   smem B  regs  prog/SM  waves  score  verdict")
    for cand in feasible[:TOP_FEASIBLE]:
        verdict = "CHOSEN" if cand.config == derivation.chosen else "feasible"
        if cand.may_spill(arch):
            verdict += " (may spill)"
        lines.append(_row(cand, verdict))
    for cand in _spread(rejected, REJECTED_SAMPLE):
        lines.append(_row(cand, "rejected: " + "; ".join(cand.rejected)))
    lines += feasible_set_lines(feasible)
    safe = [c for c in feasible if not c.may_spill(arch)]
    best = derivation.chosen_candidate
    if best is None:
        lines.append("   no config fits this arch: " + _nearest_miss(rejected))
        lines.append("   nearest feasible alternative: " + nearest_alternative(spec, arch.name))
        return lines
    lines += [
        f"   chosen: BLOCK_M={best.config.block_m} BLOCK_N={best.config.block_n} "
        f"num_warps={best.config.num_warps} num_stages={best.config.num_stages} "
        f"(source: {derivation.source})",
        *(
            f"   for sequences up to {up_to}: BLOCK_M={c.block_m} BLOCK_N={c.block_n} "
            f"num_warps={c.num_warps} num_stages={c.num_stages} (measured faster there)"
            for up_to, c in derivation.shorter
        ),
        f"   rule: {_rule(derivation, len(safe), len(feasible))}",
        f"   binding constraint: {derivation.binding}",
        f"   waves: {derivation.worked['waves']}",
        f"   headroom: {arch.smem_budget - best.smem_bytes} B shared memory, "
        f"{arch.max_regs_per_thread - best.regs_per_thread} registers/thread "
        f"({100 * (arch.smem_budget - best.smem_bytes) / arch.smem_budget:.0f}% of the "
        "shared-memory budget)",
    ]
    return lines


def _row_tile(derivation: Derivation) -> int:
    """The chosen row tile, else the first candidate's (the spec's own)."""
    chosen = derivation.chosen
    return chosen.block_m if chosen is not None else derivation.candidates[0].config.block_m


def explain_decode(spec: AttnSpec, derivation: Derivation) -> list[str]:
    """The decode tile (same shared-memory and register model, a bandwidth score) and the
    split rule worked out for reference problems on the arch's SM count."""
    arch = ARCHS[derivation.arch]
    ratio = spec.num_q_heads // spec.num_kv_heads
    layout = spec.cache_layout.value + (f", page_size {spec.page_size}" if spec.page_size else "")
    lines = [
        f"== {spec.name} decode on {arch.name} ({arch.part}, {arch.sm_count} SMs, "
        f"{arch.smem_budget} B shared/block)",
        f"   KV layout {layout}; up to {spec.query_tokens} query token(s) per step; a program "
        f"packs the {ratio} query head(s) of a KV head x the tokens into BLOCK_M = "
        f"{_row_tile(derivation)} rows (>= 16 for tl.dot)",
        f"   model ({_decode_model_name(spec)}; D={derivation.dims['D']}, "
        f"DV={derivation.dims['DV']}, E={derivation.dims['E']} substituted):",
        f"     shared memory  = {derivation.expressions['smem']}",
        f"     registers/thr ~= {derivation.expressions['regs']}",
        f"     score          = {derivation.expressions['score']}",
        f"   candidates: {len(derivation.candidates)} "
        f"({sum(c.feasible for c in derivation.candidates)} feasible)",
        "     BLOCK_M BLOCK_N warps stages   smem B  regs  prog/SM  score  verdict",
    ]
    ranked = sorted(derivation.candidates, key=lambda c: (not c.feasible, -c.score, c.smem_bytes))
    for cand in ranked[:TOP_FEASIBLE]:
        verdict = "feasible" if cand.feasible else "rejected: " + "; ".join(cand.rejected)
        verdict = "CHOSEN" if cand.config == derivation.chosen else verdict
        lines.append(_row(cand, verdict, waves=False))
    best = derivation.chosen_candidate
    if best is None:
        return [
            *lines,
            "   no decode config fits this arch",
            "   nearest feasible alternative: "
            + nearest_alternative(spec, arch.name, KernelKind.decode),
        ]
    c = best.config
    lines += [
        f"   decode tile: BLOCK_N={c.block_n} num_warps={c.num_warps} "
        f"num_stages={c.num_stages}, query rows up to {c.block_m} "
        f"(source: {derivation.source})",
        "   rule: predicted not to spill first, then the wider row tile, then the score "
        + (
            "(bytes in flight), then fewer warps, less shared memory (num_stages 2)"
            if latent_rope_split(spec)
            else "(bytes in flight), then BLOCK_N 64, fewer warps, fewer stages, less shared memory"
        ),
        f"   binding: {derivation.binding}",
        *_latent_lines(spec, arch.name),
        *("   " + line for line in split_lines(spec, c, arch.sm_count)),
    ]
    return lines


def _decode_model_name(spec: AttnSpec) -> str:
    if latent_rope_split(spec):
        latent, rope = latent_rope_split(spec) or (0, 0)
        return (
            f"the absorbed MLA decode's, attngen/tiling/decode_latent.py: q.k = {latent} latent "
            f"+ {rope} rope dims over one key tile, V the latent tile when v_cache is "
            "k_cache[..., :DV]"
        )
    return "the prefill loop's, BLOCK_M = the row tile"


def _latent_lines(spec: AttnSpec, arch: str) -> list[str]:
    """The tile a v_cache of its own gets (not k_cache's latent view): DV more per key."""
    if not latent_rope_split(spec):
        return []
    separate = derive_latent_tiles(spec, arch, v_from_k=False)
    c, cand = separate.chosen, separate.chosen_candidate
    if c is None or cand is None:
        return ["   a v_cache of its own: no tile fits"]
    return [
        f"   a v_cache of its own (V read as a tensor): BLOCK_N={c.block_n} "
        f"num_warps={c.num_warps} num_stages={c.num_stages}, query rows up to {c.block_m}, "
        f"smem {cand.smem_bytes} B, regs {cand.regs_per_thread} (SEPARATE_V_CONFIG)"
    ]


def _rule(derivation: Derivation, safe: int, feasible: int) -> str:
    if derivation.source != "heuristic":
        return f"measured best ({derivation.source}), among the feasible candidates"
    return (
        f"predicted not to spill first ({safe} feasible configs are, {feasible - safe} may "
        "spill), then the best score, then less shared memory"
    )


def feasible_set_lines(feasible: list[Candidate]) -> list[str]:
    """The whole feasible set, compactly: per tile shape, the warps and stages that fit."""
    shapes: dict[tuple[int, int], dict[int, list[int]]] = {}
    for cand in feasible:
        c = cand.config
        by_warps = shapes.setdefault((c.block_m, c.block_n), {})
        by_warps.setdefault(c.num_warps, []).append(c.num_stages)
    parts = []
    for (bm, bn), by_warps in sorted(shapes.items(), reverse=True):
        warps = ", ".join(f"w{w} s{_span(sorted(st))}" for w, st in sorted(by_warps.items()))
        parts.append(f"{bm}x{bn} ({warps})")
    lines = [
        f"   feasible set ({len(feasible)}, BLOCK_M x BLOCK_N (warps, stages)):"
        + ("" if parts else " empty")
    ]
    for part in parts:  # a shape's entry is never split across lines
        if len(lines) == 1 or len(lines[-1]) + len(part) > 94:
            lines.append("     " + part + ";")
        else:
            lines[-1] += " " + part + ";"
    if parts:
        lines[-1] = lines[-1].rstrip(";")
    return lines


def _span(stages: list[int]) -> str:
    contiguous = stages == list(range(stages[0], stages[-1] + 1))
    if contiguous and len(stages) > 1:
        return f"{stages[0]}-{stages[-1]}"
    return ",".join(map(str, stages))


def _row(cand: Candidate, verdict: str, waves: bool = True) -> str:
    """A candidate's line; decode has no prefill reference problem, so no waves column."""
    c = cand.config
    wave = f"{cand.wave_efficiency:6.3f} " if waves else ""
    return (
        f"     {c.block_m:7d} {c.block_n:7d} {c.num_warps:5d} {c.num_stages:6d} "
        f"{cand.smem_bytes:8d} {cand.regs_per_thread:5d} {cand.programs_per_sm:8d} "
        f"{wave}{cand.score:6.3f}  {verdict}"
    )


def _spread(items: list[Candidate], count: int) -> list[Candidate]:
    if len(items) <= count:
        return items
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def _nearest_miss(rejected: list[Candidate]) -> str:
    closest = min(rejected, key=lambda c: c.smem_bytes)
    return (
        f"the smallest candidate (BLOCK_M={closest.config.block_m}, "
        f"BLOCK_N={closest.config.block_n}, num_stages={closest.config.num_stages}) is "
        f"rejected: {'; '.join(closest.rejected)}"
    )
