"""`attngen verify-tiling`: the tiling model against Triton's compiler, config by config.

For every spec x arch x candidate config that `derive_tiles` enumerates (feasible or not), the
model's shared memory and registers are compared with what Triton 3.6 compiles. Measurements
come from the committed data file (attngen/verify/data/prefill_compile_triton-<version>.json,
keyed as attngen.verify.measurements explains) or from a live cross-compile
(attngen.verify.compiler, lazily imported).

Each row is then held to the policy in attngen.verify.policy; any failure makes the command
exit 1.

The backward kernels (spec `backward: true`) are held to the same policy, row by row, with
their own plan (attngen.verify.backward) and data file (BackwardKey records).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attngen.arch import ARCHS
from attngen.spec import AttnSpec, KernelKind, Mask
from attngen.tiling.prefill import Candidate, derive_tiles
from attngen.verify.measurements import (
    AnyKey,
    Measurements,
    current_template_hash,
    measurement_key,
    save_measurements,
    spec_ref,
)
from attngen.verify.policy import SAFE_SPILL_BYTES, judge

# fp32 dots are FMA loops; ptxas needs minutes for the configs that spill tens of KiB (all
# predicted above 400), and those are rejected by the register bound anyway. Above this
# prediction an fp32 config is not compiled live (it is still checked when the data has it).
FP32_LIVE_MAX_REGS = 400
CHUNK = 48  # live compiles between progress reports (and data saves)
SAMPLE_MAX_COMPILE_S = 3.0  # --sample draws configs that compiled this fast (tests stay quick)


@dataclass
class Row:
    """One deduplicated (arch, dtype, D, DV, config): the model's verdict and the compiler's."""

    key: AnyKey
    specs: list[str]
    candidate: Candidate
    may_spill: bool
    measured: dict[str, Any] | None = None
    source: str = "none"  # "data", "live" or "none" (not compiled)
    problems: list[str] = field(default_factory=list)  # failures: exit 1
    notes: list[str] = field(default_factory=list)  # findings that are not failures

    @property
    def smem_class(self) -> str:
        if not self.measured or self.measured.get("shared") is None:
            return "-"
        delta = self.candidate.smem_bytes - self.measured["shared"]
        return "exact" if delta == 0 else ("over" if delta > 0 else "UNDER")


@dataclass
class Plan:
    rows: dict[Any, Row]  # by key: MeasurementKey, or BackwardKey in a backward plan
    representative: dict[Any, AttnSpec]  # the spec a missing key is compiled from
    chosen: list[tuple[str, str, AnyKey | None]]  # (spec, arch, the chosen config's key)
    specs: dict[str, AttnSpec] = field(default_factory=dict)  # by name

    def add(self, key: AnyKey, spec: AttnSpec, cand: Candidate) -> None:
        """`spec`'s candidate `cand` as the row of `key` (one row per key, its first candidate
        judged; the heaviest spec of a key is the one it is compiled from)."""
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = Row(key, [], cand, cand.may_spill(ARCHS[key.arch]))
        if spec.name not in row.specs:
            row.specs.append(spec.name)
        heaviest = self.representative.get(key)
        if heaviest is None or representative_weight(spec) > representative_weight(heaviest):
            self.representative[key] = spec


def representative_weight(spec: AttnSpec) -> int:
    """More score code, more registers: a key is compiled from its heaviest spec. A guess,
    not a bound: ptxas varies by up to +-75 registers between the example specs of one key
    (`--every-spec` compiles them all; docs/tiling.md has what that found)."""
    return (
        4 * (spec.softcap > 0)
        + 4 * spec.alibi
        + 2 * (spec.mask is Mask.sliding_window)
        + (spec.mask is not Mask.none)
        + (spec.num_q_heads != spec.num_kv_heads)
    )


def plan_rows(specs: Iterable[AttnSpec], archs: Sequence[str] | None) -> Plan:
    """Every candidate of every (spec, arch), deduplicated on the measurement key."""
    plan = Plan({}, {}, [])
    for spec in specs:
        if not {KernelKind.prefill, KernelKind.varlen} & set(spec.kernels):
            continue  # decode-only (MLA's absorbed 576/512): tools/decode_compile_check.py
        plan.specs[spec.name] = spec
        for arch in archs or spec.archs:
            derivation = derive_tiles(spec, arch)
            best = derivation.chosen
            key = None if best is None else measurement_key(spec, arch, best)
            plan.chosen.append((spec.name, arch, key))
            for cand in derivation.candidates:
                plan.add(measurement_key(spec, arch, cand.config), spec, cand)
    return plan


def live_jobs(
    plan: Plan,
    data: Measurements,
    recompile: bool,
    sample: int,
    seed: int,
    every_spec: bool = False,
) -> tuple[list[tuple[AnyKey, AttnSpec]], list[AnyKey]]:
    """What to compile now (key and the spec to compile it from), and what to leave out.

    Missing keys are compiled from the plan's heaviest spec; --recompile compiles every key
    from the plan's specs; --every-spec also compiles every other spec of each feasible key
    (held to the same policy; the data keeps one record per key); --sample N recompiles N
    random keys that the data has (half of them configs the model rejects, 16-bit: fp32 is
    slow) from the spec each was recorded from, so the result must equal the record exactly
    (configs that took over SAMPLE_MAX_COMPILE_S to compile are left to --recompile)."""
    jobs, skipped = [], []
    for key, row in plan.rows.items():
        if every_spec and row.candidate.feasible:
            first = plan.representative[key]  # the one a missing key is recorded from
            recorded = (data.get(key) or {}).get("spec")
            specs = [first, *(plan.specs[n] for n in row.specs if n != first.name)]
            jobs += [(key, spec) for spec in specs if recompile or spec_ref(spec) != recorded]
        elif recompile or data.get(key) is None:
            slow = key.dtype == "fp32" and row.candidate.regs_per_thread > FP32_LIVE_MAX_REGS
            if slow and data.get(key) is None:
                skipped.append(key)
            else:
                jobs.append((key, plan.representative[key]))
    if sample and not recompile:
        rng = random.Random(seed)
        known = [
            k
            for k in sorted(plan.rows)
            if (record := data.get(k)) is not None
            and k.dtype != "fp32"
            and record["compile_s"] <= SAMPLE_MAX_COMPILE_S
        ]
        rejected = [k for k in known if not plan.rows[k].candidate.feasible]
        feasible = [k for k in known if plan.rows[k].candidate.feasible]
        half = sample // 2
        picked = rng.sample(rejected, min(half, len(rejected)))
        picked += rng.sample(feasible, min(sample - len(picked), len(feasible)))
        jobs += [(k, data.spec_of(k)) for k in picked]
    return jobs, skipped


Others = dict[AnyKey, list[tuple[str, dict[str, Any]]]]  # other specs' compiles of a key


def measure(
    data: Measurements,
    jobs: list[tuple[AnyKey, AttnSpec]],
    processes: int,
    progress: Callable[[str], None] | None = None,
    replace_other: bool = False,
) -> tuple[dict[AnyKey, list[str]], Others]:
    """Compile the jobs. A key's first record goes into `data`; a recompile from the recorded
    spec replaces it and must equal it; one from another spec replaces it with
    `replace_other` (--recompile), else (--every-spec) it is kept aside in `others`, to be
    judged too. Returns, per compiled key, what contradicts the data (stale fields, or shared
    memory that differs by spec), and the others. `progress(message)` runs every CHUNK jobs
    (verify_tiling saves the data there, so a long sweep can be resumed)."""
    changed: dict[AnyKey, list[str]] = {}
    others: Others = {}
    if not jobs:
        return changed, others
    from attngen.verify.compiler import compile_iter  # imports triton

    records = compile_iter([key.job(spec) for key, spec in jobs], processes)
    for done, ((key, spec), record) in enumerate(zip(jobs, records, strict=True), start=1):
        _merge(data, key, spec, record, changed, others, replace_other)
        if progress is not None and (done % CHUNK == 0 or done == len(jobs)):
            progress(f"compiled {done} of {len(jobs)} configs live")
    return changed, others


def _merge(
    data: Measurements,
    key: AnyKey,
    spec: AttnSpec,
    record: dict[str, Any],
    changed: dict[AnyKey, list[str]],
    others: Others,
    replace_other: bool,
) -> None:
    before = data.get(key)
    changed.setdefault(key, [])
    if before is None:
        data.add(key, spec, record)
        return
    if before["spec"] == spec_ref(spec):
        changed[key] += [
            f"data file is stale: {f} {before.get(f)} -> {record.get(f)}"
            for f in ("shared", "regs", "spill_stores")
            if before.get(f) != record.get(f)
        ]
        data.add(key, spec, record)
        return
    if before["shared"] != record["shared"]:
        changed[key].append(
            f"shared memory differs by spec: {before['shared']} for "
            f"{before['spec']}, {record['shared']} for {spec_ref(spec)}"
        )
    if replace_other:
        data.add(key, spec, record)
    else:
        others.setdefault(key, []).append((spec_ref(spec), record))


@dataclass
class Summary:
    """Counts over rows of one arch (or all): what the report table and the docs show."""

    rows: int = 0
    compiled: int = 0
    exact: int = 0
    over: int = 0
    under: int = 0
    feasible: int = 0
    safe_ok: int = 0
    safe: int = 0
    may_spill: int = 0
    may_spill_spilled: int = 0
    rejected: int = 0
    rejected_checked: int = 0
    rejected_confirmed: int = 0
    mma_agree: int = 0
    failures: int = 0
    regs_err: list[float] = field(default_factory=list)

    @property
    def exact_rate(self) -> float:
        return self.exact / self.compiled if self.compiled else math.nan

    @property
    def regs_rms(self) -> float:
        errs = self.regs_err
        return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else math.nan


def summarize(rows: Iterable[Row]) -> Summary:
    s = Summary()
    for row in rows:
        s.rows += 1
        s.failures += bool(row.problems)
        cand, m = row.candidate, row.measured
        s.feasible += cand.feasible
        s.rejected += not cand.feasible
        if not m or m.get("shared") is None:
            continue
        s.compiled += 1
        s.exact += row.smem_class == "exact"
        s.over += row.smem_class == "over"
        s.under += row.smem_class == "UNDER"
        s.mma_agree += m.get("mma") == row.key.expected_mma()  # the family the model assumes
        spills = m["spill_stores"] or 0
        if not spills and m.get("regs"):
            s.regs_err.append(cand.regs_per_thread - m["regs"])
        if cand.feasible and row.may_spill:
            s.may_spill += 1
            s.may_spill_spilled += spills > SAFE_SPILL_BYTES
        elif cand.feasible:
            s.safe += 1
            s.safe_ok += spills <= SAFE_SPILL_BYTES
        else:
            checkable = [n for n in row.notes if "rejection" in n]
            s.rejected_checked += bool(checkable)
            s.rejected_confirmed += bool(checkable) and any("confirmed" in n for n in checkable)
    return s


@dataclass
class Report:
    plan: Plan
    skipped: list[AnyKey]
    live: int
    seconds: float
    data_triton: str
    data_template: str
    template_hash: str

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.plan.rows.values() if r.problems]

    def by_arch(self) -> dict[str, Summary]:
        archs = sorted({k.arch for k in self.plan.rows}, key=list(ARCHS).index)
        return {a: summarize(r for k, r in self.plan.rows.items() if k.arch == a) for a in archs}


Planner = Callable[[Iterable[AttnSpec], Sequence[str] | None], Plan]


def verify_tiling(
    specs: Sequence[AttnSpec],
    archs: Sequence[str] | None,
    data: Measurements,
    *,
    recompile: bool = False,
    sample: int = 0,
    seed: int = 0,
    processes: int = 2,
    progress: Callable[[str], None] | None = None,
    save_to: Path | None = None,
    every_spec: bool = False,
    planner: Planner = plan_rows,
) -> Report:
    """Plan, measure (data first, compiler for what is missing or asked for), judge. The
    forward's plan_rows, or attngen.verify.backward.plan_backward_rows (with the backward's
    data).

    `progress(message)` hears of the live compiles every CHUNK jobs. With `save_to`, `data`
    and what was compiled live are saved there at the same points, so an interrupted sweep
    keeps what it compiled, and a live result that contradicts a record replaces it instead of
    failing the run."""
    start = time.perf_counter()
    plan = planner(specs, archs)
    jobs, skipped = live_jobs(plan, data, recompile, sample, seed, every_spec)

    def after_chunk(message: str) -> None:
        if progress is not None:
            progress(message)
        if save_to is not None:
            save_measurements(data, save_to)

    changed, others = measure(data, jobs, processes, after_chunk, replace_other=recompile)
    judge(plan, data, changed, stale_fails=save_to is None, others=others)
    hashes = (data.triton, data.template_hash, current_template_hash())
    return Report(plan, skipped, len(changed), time.perf_counter() - start, *hashes)
