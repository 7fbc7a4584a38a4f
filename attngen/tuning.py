"""The tuning database: measured winners, one JSON file per arch, kept in the repository.

`attngen autotune` writes it on a GPU; `attngen build` reads it (this module imports neither
torch nor triton). An entry is keyed by the spec hash and holds, per kernel kind, the winning
tile config, the times measured for every candidate tried, the GPU's name, Triton's version and
the date. A file carries a schema version; a file of another schema is refused, not guessed at.

    tuning/sm90.json = {"schema": 1, "arch": "sm90",
                        "entries": {"<spec hash>/prefill": {"config": {...}, ...}}}
"""

from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from attngen.spec import AttnSpec, KernelKind, SpecError
from attngen.tiling import Derivation, TileConfig, choose

TUNING_SCHEMA = 1
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

    def describe(self) -> str:
        partial = "" if self.complete else ", partial search"
        return f"tuning on {self.gpu}, triton {self.triton}, {self.date}{partial}"


def entry_key(spec: AttnSpec, kind: KernelKind) -> str:
    return f"{spec.kernel_hash(kind)}/{kind.value}"


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
    return data


def render_tuning_file(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def lookup(tuning_dir: Path | None, spec: AttnSpec, kind: KernelKind, arch: str
           ) -> TuningRecord | None:
    if tuning_dir is None:
        return None
    entry = read_tuning_file(tuning_path(tuning_dir, arch))["entries"].get(entry_key(spec, kind))
    if entry is None:
        return None
    try:
        config = TileConfig.from_dict(entry["config"])
        return TuningRecord(config, str(entry["gpu"]), str(entry["triton"]), str(entry["date"]),
                            bool(entry["complete"]), dict(entry["median_ms"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise TuningError(f"{tuning_path(tuning_dir, arch)}: entry {entry_key(spec, kind)} is "
                          f"malformed ({exc!r})") from None


def installed_triton_version() -> str | None:
    """Triton's version from its package metadata: no import, so the build path stays light."""
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def apply_tuning(derivation: Derivation, record: TuningRecord | None) -> Derivation:
    """The derivation with the tuned config chosen, or unchanged without a record.

    A tuned config must still be feasible under the current model; otherwise the entry is
    stale and the build says so rather than silently using it or the heuristic.
    """
    if record is None:
        return derivation
    candidate = next((c for c in derivation.candidates if c.config == record.config), None)
    if candidate is None or not candidate.feasible:
        why = "not a candidate" if candidate is None else "; ".join(candidate.rejected)
        raise TuningError(f"tuned config {record.config.as_dict()} for {derivation.arch} is "
                          f"infeasible under the current model ({why}); re-run attngen autotune")
    return choose(derivation, record.config, record.describe())
