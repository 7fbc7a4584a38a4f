"""The tuning database: measured winners, one JSON file per arch, kept in the repository.

`attngen autotune` writes it on a GPU; `attngen build` reads it (this module imports neither
torch nor triton). An entry is keyed by the hash of the spec fields the kernel depends on
(TUNED_ON: not the name, the arch list or the other kernels a spec asks for, so adding
`decode` to a spec keeps its prefill tuning) and holds, per kernel kind, the winning
tile config, the times measured for every candidate tried, the GPU's name, Triton's version and
the date; optionally `shorter`, configs measured faster on shorter sequences (`up_to`: the
longest sequence each serves), which the module picks by length. A file carries a schema
version; a file of another schema is refused, not guessed at.

    tuning/sm90.json = {"schema": 1, "arch": "sm90",
                        "entries": {"<kernel fields hash>/prefill": {"config": {...}, ...}}}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from attngen.spec import AttnSpec, KernelKind, SpecError
from attngen.tiling.prefill import Derivation, TileConfig, choose

TUNING_SCHEMA = 2  # 2: entries keyed by the kernel fields' hash (1: the whole spec's)
# Spec fields that do not change what a prefill kernel computes or how fast (backward adds
# gradient kernels beside an unchanged forward kernel).
NOT_TUNED_ON = frozenset({"name", "archs", "kernels", "kv_layout", "page_size",
                          "max_query_tokens", "backward"})
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


def entry_key(spec: AttnSpec, kind: KernelKind) -> str:
    fields = {k: v for k, v in spec.canonical().items() if k not in NOT_TUNED_ON}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return f"{hashlib.sha256(text.encode()).hexdigest()[:16]}/{kind.value}"


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
        raise TuningError(f"{path}: tuning schema {schema!r}; this attngen reads schema "
                          f"{TUNING_SCHEMA} (re-run attngen autotune)")
    if data.get("arch") != arch or not isinstance(data.get("entries"), dict):
        raise TuningError(f"{path}: expected arch {arch!r} and an 'entries' mapping")
    checked: dict[str, Any] = data
    return checked


def render_tuning_file(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def lookup(tuning_dir: Path | None, spec: AttnSpec, kind: KernelKind, arch: str
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
    if entry is None:
        return None
    try:
        config = TileConfig.from_dict(entry["config"])
        shorter = tuple((int(item["up_to"]), TileConfig.from_dict(item["config"]))
                        for item in entry.get("shorter", []))
        programs = {TileConfig.from_dict(item["config"]): int(item["programs_per_sm"])
                    for item in [entry, *entry.get("shorter", [])] if "programs_per_sm" in item}
        if [up_to for up_to, _ in shorter] != sorted({up_to for up_to, _ in shorter}) or any(
                up_to < 1 for up_to, _ in shorter):
            raise ValueError("'shorter' lengths must be positive and strictly ascending")
        return TuningRecord(config, str(entry["gpu"]), str(entry["triton"]), str(entry["date"]),
                            bool(entry["complete"]), dict(entry["median_ms"]), borrowed,
                            shorter, programs)
    except (KeyError, TypeError, ValueError) as exc:
        raise TuningError(f"{tuning_path(tuning_dir, arch)}: entry {entry_key(spec, kind)} is "
                          f"malformed ({exc!r})") from None


def apply_tuning(derivation: Derivation, record: TuningRecord | None) -> Derivation:
    """The derivation with the tuned config chosen, or unchanged without a record.

    A tuned config must still be feasible under the current model; otherwise the entry is
    stale and the build says so rather than silently using it or the heuristic.
    """
    if record is None:
        return derivation
    for config in (record.config, *(c for _, c in record.shorter)):
        candidate = next((c for c in derivation.candidates if c.config == config), None)
        if candidate is None or not candidate.feasible:
            why = "not a candidate" if candidate is None else "; ".join(candidate.rejected)
            raise TuningError(f"tuned config {config.as_dict()} for {derivation.arch} is "
                              f"infeasible under the current model ({why}); re-run attngen "
                              "autotune")
        measured_at = record.programs_per_sm.get(config)
        if measured_at is not None and candidate.programs_per_sm < measured_at:
            raise TuningError(f"tuned config {config.as_dict()} for {derivation.arch} was "
                              f"measured at {measured_at} programs per SM; the current "
                              f"template fits {candidate.programs_per_sm} (it needs "
                              f"{candidate.smem_bytes} B of shared memory, "
                              f"{candidate.regs_per_thread} registers per thread), so its "
                              "timing no longer holds; re-run attngen autotune")
    chosen = choose(derivation, record.config, record.describe())
    return dataclasses.replace(chosen, shorter=record.shorter)
