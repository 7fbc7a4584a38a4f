"""The tuning database: measured winners, one JSON file per arch, kept in the repository.

`attngen autotune` writes it on a GPU; `attngen build` reads it (this module imports neither
torch nor triton). An entry is keyed by the hash of the spec fields the kernel depends on
(TUNED_ON: not the name, the arch list or the other kernels a spec asks for, so adding
`decode` to a spec keeps its prefill tuning) and holds, per kernel kind, the winning
tile config, the times measured for every candidate tried, the GPU's name, Triton's version and
the date; optionally `shorter`, configs measured faster on shorter sequences (`up_to`: the
longest sequence each serves), which the module picks by length. A file carries a schema
version; a file of another schema is refused, not guessed at.

    tuning/sm90.json = {"schema": 2, "arch": "sm90",
                        "entries": {"<kernel fields hash>/prefill": {"config": {...}, ...}}}

The gradient kernels of a spec with `backward: true` have entries of their own, kinds
`backward_dq`, `backward_dkdv`, and `backward_dv` / `backward_dk` for the one-gradient
launches (BACKWARD_KINDS), under the same fields hash: the module's BWD_DQ_CONFIG,
BWD_DKDV_CONFIG and BWD_DKDV_SPLIT come from them when present (tuned_backward_tiles). An sm90
prefill entry may hold "gluon", the Gluon forward's knobs (tuned_gluon; an entry may hold only it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from attngen.spec import AttnSpec, KernelKind, SpecError
from attngen.tiling.backward import KERNELS, BackwardDerivation, derive_backward_tiles
from attngen.tiling.gluon import GluonConfig, GluonDerivation, derive_gluon_tiles
from attngen.tiling.prefill import Derivation, TileConfig, choose

TUNING_SCHEMA = 2  # 2: entries keyed by the kernel fields' hash (1: the whole spec's)
# Spec fields that do not change what a prefill kernel computes or how fast (backward adds
# gradient kernels beside an unchanged forward kernel).
NOT_TUNED_ON = frozenset(
    {"name", "archs", "kernels", "kv_layout", "page_size", "max_query_tokens", "backward"}
)
DEFAULT_TUNING_DIR = Path("tuning")


class TuningError(SpecError):
    """A tuning file that cannot be used as it is (schema, shape, an infeasible config)."""


@dataclasses.dataclass(frozen=True)
class TuningRecord:
    config: TileConfig
    gpu: str
    triton: str
    date: str
    complete: bool  # False when the budget ran out before every candidate was timed
    median_ms: dict[str, float]  # bucket -> the winner's median time
    borrowed_from: str | None = None  # the kind whose entry this is, when not the asked kind
    # (longest sequence, config) measured faster than `config` on shorter sequences, ascending
    shorter: tuple[tuple[int, TileConfig], ...] = ()
    # The model's programs per SM of each config when it was measured; an entry may lack it
    # (autotune wrote entries without it before it recorded occupancy), and then nothing is
    # checked against it
    programs_per_sm: dict[TileConfig, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        partial = "" if self.complete else ", partial search"
        borrowed = f" (of the {self.borrowed_from} kernel)" if self.borrowed_from else ""
        return f"tuning{borrowed} on {self.gpu}, triton {self.triton}, {self.date}{partial}"


# The database kind of each backward kernel (attngen/tiling/backward.py's KERNELS).
BACKWARD_KINDS = {kernel: f"backward_{kernel}" for kernel in KERNELS}


def _fields_hash(spec: AttnSpec) -> str:
    fields = {k: v for k, v in spec.canonical().items() if k not in NOT_TUNED_ON}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_key(spec: AttnSpec, kind: KernelKind) -> str:
    return f"{_fields_hash(spec)}/{kind.value}"


def backward_entry_key(spec: AttnSpec, kernel: str) -> str:
    """The key of a gradient kernel's entry: `kernel` is "dq" or "dkdv"."""
    if kernel not in BACKWARD_KINDS:
        raise ValueError(f"kernel: {kernel!r}; expected one of {', '.join(BACKWARD_KINDS)}")
    return f"{_fields_hash(spec)}/{BACKWARD_KINDS[kernel]}"


def tuning_path(tuning_dir: Path, arch: str) -> Path:
    return Path(tuning_dir) / f"{arch}.json"


def read_tuning_file(path: Path) -> dict[str, Any]:
    """The whole file, or an empty one of the current schema when it does not exist."""
    arch = path.stem
    if not path.is_file():
        return {"schema": TUNING_SCHEMA, "arch": arch, "entries": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TuningError(f"{path}: not JSON ({exc})") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != TUNING_SCHEMA:
        reads = f"this attngen reads schema {TUNING_SCHEMA} (re-run attngen autotune)"
        raise TuningError(f"{path}: tuning schema {schema!r}; {reads}")
    if data.get("arch") != arch or not isinstance(data.get("entries"), dict):
        raise TuningError(f"{path}: expected arch {arch!r} and an 'entries' mapping")
    checked: dict[str, Any] = data
    return checked


def render_tuning_file(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def lookup(
    tuning_dir: Path | None, spec: AttnSpec, kind: KernelKind, arch: str
) -> TuningRecord | None:
    if tuning_dir is None:
        return None
    entries = read_tuning_file(tuning_path(tuning_dir, arch))["entries"]
    entry = entries.get(entry_key(spec, kind))
    borrowed = None
    if entry is None and kind is KernelKind.varlen:
        # The varlen kernel is the prefill kernel with another way to find its sequence: the
        # same key loop, registers and shared memory. Until it is tuned on its own, it takes
        # prefill's measured config, and its header says so.
        entry, borrowed = entries.get(entry_key(spec, KernelKind.prefill)), "prefill"
    if entry is None or "config" not in entry:  # none, or only the Gluon forward's (tuned_gluon)
        return None
    return _parse_record(
        entry, borrowed, f"{tuning_path(tuning_dir, arch)}: entry {entry_key(spec, kind)}"
    )


def _parse_record(entry: Any, borrowed: str | None, where: str) -> TuningRecord:
    try:
        config = TileConfig.from_dict(entry["config"])
        shorter = tuple(
            (int(item["up_to"]), TileConfig.from_dict(item["config"]))
            for item in entry.get("shorter", [])
        )
        programs = {
            TileConfig.from_dict(item["config"]): int(item["programs_per_sm"])
            for item in [entry, *entry.get("shorter", [])]
            if "programs_per_sm" in item
        }
        lengths = [up_to for up_to, _ in shorter]
        if lengths != sorted(set(lengths)) or any(up_to < 1 for up_to in lengths):
            raise ValueError("'shorter' lengths must be positive and strictly ascending")
        where_when = (str(entry["gpu"]), str(entry["triton"]), str(entry["date"]))
        timing = (bool(entry["complete"]), dict(entry["median_ms"]))
        return TuningRecord(config, *where_when, *timing, borrowed, shorter, programs)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TuningError(f"{where} is malformed ({exc!r})") from None


def apply_tuning(derivation: Derivation, record: TuningRecord | None) -> Derivation:
    """The derivation with the tuned config chosen, or unchanged without a record.

    A tuned config must still be feasible under the current model; otherwise the entry is
    stale and the build says so rather than silently using it or the heuristic.
    """
    if record is None:
        return derivation
    for config in (record.config, *(c for _, c in record.shorter)):
        _check_tuned("", config, derivation, record)
    chosen = choose(derivation, record.config, record.describe())
    return dataclasses.replace(chosen, shorter=record.shorter)


def _check_tuned(
    what: str, config: TileConfig, derivation: Derivation, record: TuningRecord
) -> None:
    """Refuse a tuned config the current model rejects or fits at fewer programs per SM than
    it was measured at (its timing no longer holds)."""
    candidate = next((c for c in derivation.candidates if c.config == config), None)
    if candidate is None or not candidate.feasible:
        why = "not a candidate" if candidate is None else "; ".join(candidate.rejected)
        raise TuningError(
            f"tuned {what}config {config.as_dict()} for {derivation.arch} is infeasible under "
            f"the current model ({why}); re-run attngen autotune"
        )
    measured_at = record.programs_per_sm.get(config)
    if measured_at is not None and candidate.programs_per_sm < measured_at:
        raise TuningError(
            f"tuned {what}config {config.as_dict()} for {derivation.arch} was measured at "
            f"{measured_at} programs per SM; the current model fits {candidate.programs_per_sm} "
            f"(it needs {candidate.smem_bytes} B of shared memory, {candidate.regs_per_thread} "
            "registers per thread), so its timing no longer holds; re-run attngen autotune"
        )


def tuned_backward_tiles(tuning_dir: Path | None, spec: AttnSpec, arch: str) -> BackwardDerivation:
    """The gradient kernels' derivations, each kernel's config from its tuning entry when
    there is one (else the heuristic's). A tuned config must be a feasible candidate of the
    current backward model, at the programs per SM it was measured at, like the forward's."""
    heuristic = derive_backward_tiles(spec, arch)
    if tuning_dir is None:
        return heuristic
    entries = read_tuning_file(tuning_path(tuning_dir, arch))["entries"]
    tuned = []
    for kernel in KERNELS:
        derivation = getattr(heuristic, kernel)
        key = backward_entry_key(spec, kernel)
        if key not in entries:
            continue
        record = _parse_record(entries[key], None, f"{tuning_path(tuning_dir, arch)}: entry {key}")
        if record.shorter:
            raise TuningError(
                f"{tuning_path(tuning_dir, arch)}: entry {key} has 'shorter' "
                "configs; the backward kernels have one config for every length"
            )
        _check_tuned(f"{kernel} backward ", record.config, derivation, record)
        tuned.append((kernel, record.config, record.describe()))
    return derive_backward_tiles(spec, arch, tuple(tuned)) if tuned else heuristic


def gluon_knobs(config: GluonConfig) -> dict[str, int]:
    """The Gluon forward's tuned knobs, named as the module's GLUON_CONFIG names them (the
    register split follows from the consumers: tiling.gluon.register_split)."""
    return {"NUM_CONSUMERS": config.consumers, "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n, "STAGES": config.stages}  # fmt: skip


def tuned_gluon(tuning_dir: Path | None, spec: AttnSpec, arch: str) -> GluonDerivation | None:
    """The prefill module's Gluon forward derivation (None without one), its config the tuned
    one from the "gluon" field of the spec's prefill entry when that is still a feasible
    candidate of the current model; else the derived one, its source saying why the tuned one
    is ignored (a template or model change can make it infeasible; re-tuning fixes it)."""
    derivation = derive_gluon_tiles(spec, arch)
    if derivation is None or derivation.chosen is None or tuning_dir is None:
        return derivation
    key, path = entry_key(spec, KernelKind.prefill), tuning_path(tuning_dir, arch)
    record = read_tuning_file(path)["entries"].get(key, {}).get("gluon")
    if record is None:
        return derivation
    try:
        names = gluon_knobs(derivation.chosen.config)
        knobs = {name: int(record["config"][name]) for name in names}
        measured = f"{record['gpu']}, {record['date']}"
        partial = "" if bool(record["complete"]) else ", partial search"
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TuningError(f"{path}: entry {key}: 'gluon' is malformed ({exc!r})") from None
    candidate = next((c for c in derivation.candidates if gluon_knobs(c.config) == knobs), None)
    why = "not a candidate" if candidate is None else "; ".join(candidate.rejected)
    if why:
        ignored = f"derived; the tuned {knobs} ({measured}) is ignored: {why}"
        return dataclasses.replace(derivation, source=ignored)
    return dataclasses.replace(derivation, chosen=candidate, source=f"tuned on {measured}{partial}")
