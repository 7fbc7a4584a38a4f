"""Build: spec files -> generated/<arch>/<module>.py and generated/index.json.

Everything is validated and rendered in memory first; only then is anything written, so a bad
spec (or a spec that no arch can serve) leaves the output folder untouched. Writes are atomic
(a temporary file in the same folder, then os.replace) and skipped when the bytes are already
there, so rebuilding is idempotent and concurrent builds of the same specs both succeed. The
index is merged under a file lock: entries of modules built from other specs stay.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attngen.render import render_module
from attngen.spec import AttnSpec, KernelKind, SpecError, load_spec_file, module_name
from attngen.spec.files import locked, write_if_different
from attngen.spec.names import __version__
from attngen.tiling.alternatives import nearest_alternative
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.prefill import derive_tiles
from attngen.tuning.database import apply_tuning, lookup, tuned_backward_tiles, tuned_gluon

INDEX_NAME = "index.json"
INDEX_SCHEMA = 1


class BuildError(SpecError):
    """A valid spec that cannot be built as asked (no feasible tiles, name collisions)."""


@dataclass(frozen=True)
class Artifact:
    relative_path: str  # "<arch>/<module>.py", derived from validated names only
    source: str
    entry: dict[str, Any]


def load_specs(paths: Iterable[str | Path]) -> list[AttnSpec]:
    specs: list[AttnSpec] = []
    for path in paths:
        specs.extend(load_spec_file(path))
    return specs


def plan_build(specs: Iterable[AttnSpec], tuning_dir: Path | None = None) -> list[Artifact]:
    """Render every (spec, kernel, arch) in memory; raise BuildError before anything is written.

    With `tuning_dir`, configs measured by `attngen autotune` replace the heuristic's.
    """
    # Paused: derive and render's short-lived objects set off 150 ms full collections (torch's).
    artifacts: dict[str, Artifact] = {}
    collecting = gc.isenabled()
    gc.disable()
    try:
        for spec, kind, arch in ((s, k, a) for s in specs for k in s.kernels for a in s.archs):
            artifact = _plan_one(spec, kind, arch, tuning_dir)
            previous = artifacts.get(artifact.relative_path)
            if previous is not None and previous.source != artifact.source:
                hashes = previous.entry["spec_hash"], artifact.entry["spec_hash"]
                raise BuildError(f"{artifact.relative_path}: two specs give this module different "
                                 "contents (spec hashes %s and %s); give the specs different "
                                 "names" % hashes)  # fmt: skip
            artifacts[artifact.relative_path] = artifact
    finally:
        if collecting:
            gc.enable()
    return [artifacts[path] for path in sorted(artifacts)]


def _plan_one(spec: AttnSpec, kind: KernelKind, arch: str, tuning_dir: Path | None) -> Artifact:
    derive = derive_decode_tiles if kind is KernelKind.decode else derive_tiles
    derivation = derive(spec, arch)
    if derivation.chosen is None:
        reasons = sorted({r for c in derivation.candidates for r in c.rejected})
        raise BuildError(f"{spec.name}: no {kind.value} tile config fits {arch} (every candidate "
                         f"rejected: {'; '.join(reasons[:3])}); nearest feasible alternative: "
                         f"{nearest_alternative(spec, arch, kind)}; drop this arch from `archs` "
                         "or change the spec")  # fmt: skip
    derivation = apply_tuning(derivation, lookup(tuning_dir, spec, kind, arch))
    assert derivation.chosen is not None  # apply_tuning replaces the choice, never drops it
    name = module_name(spec, kind)
    relative_path = f"{arch}/{name}.py"
    backward = None
    if spec.backward and kind is not KernelKind.decode:
        backward = tuned_backward_tiles(tuning_dir, spec, arch)
    gluon = tuned_gluon(tuning_dir, spec, arch) if kind is KernelKind.prefill else None
    source = render_module(spec, kind, derivation, backward, gluon)
    # The runtime imports a module only if its bytes hash to sha256 (runtime/registry.py).
    entry = {"module": name, "path": relative_path, "arch": arch, "kind": kind.value,
             "spec_hash": spec.spec_hash(), "spec": spec.canonical(),
             "config": derivation.chosen.as_dict(), "config_source": derivation.source,
             "sha256": hashlib.sha256(source.encode("utf-8")).hexdigest()}  # fmt: skip
    return Artifact(relative_path, source, entry)


def write_build(artifacts: list[Artifact], out_dir: str | Path) -> list[str]:
    """Write modules and merge the index; returns the relative paths whose bytes changed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    for artifact in artifacts:
        target = _confined(out, artifact.relative_path)
        if write_if_different(target, artifact.source):
            changed.append(artifact.relative_path)
    with locked(out / ".index.lock"):
        entries = {entry["path"]: entry for entry in read_index(out)}
        entries = {path: e for path, e in entries.items() if (out / path).is_file()}
        entries.update({artifact.relative_path: artifact.entry for artifact in artifacts})
        if write_if_different(out / INDEX_NAME, render_index(entries.values())):
            changed.append(INDEX_NAME)
    return changed


def build(
    spec_paths: Iterable[str | Path], out_dir: str | Path, tuning_dir: Path | None = None
) -> list[str]:
    return write_build(plan_build(load_specs(spec_paths), tuning_dir), out_dir)


def stale_paths(
    spec_paths: Iterable[str | Path], out_dir: str | Path, tuning_dir: Path | None = None
) -> list[str]:
    """Modules (and index entries) that a build would change: empty when out_dir is current."""
    return check_folder(spec_paths, out_dir, tuning_dir)[0]


def check_folder(
    spec_paths: Iterable[str | Path], out_dir: str | Path, tuning_dir: Path | None = None
) -> tuple[list[str], list[str]]:
    """(stale_paths, unproduced) from one render of the specs (`attngen check`). Unproduced:
    modules in out_dir (files `<arch>/*.py` or index entries) that none of the specs produces,
    left over from another spec set or a renamed spec, or put there by hand."""
    out = Path(out_dir)
    artifacts = plan_build(load_specs(spec_paths), tuning_dir)
    stale = []
    for artifact in artifacts:
        target = out / artifact.relative_path
        if not target.is_file() or target.read_text(encoding="utf-8") != artifact.source:
            stale.append(artifact.relative_path)
    index = read_index(out)
    indexed = {entry.get("path"): entry for entry in index if isinstance(entry, dict)}
    if any(indexed.get(a.relative_path) != a.entry for a in artifacts):
        stale.append(INDEX_NAME)
    present = {path.relative_to(out).as_posix() for path in out.glob("*/*.py")}
    present |= {path for path in indexed if isinstance(path, str)}
    produced = {artifact.relative_path for artifact in artifacts}
    return stale, sorted(present - produced)


def render_index(entries: Iterable[dict[str, Any]]) -> str:
    ordered = sorted(entries, key=lambda entry: entry["path"])
    index = {"attngen_version": __version__, "schema": INDEX_SCHEMA, "modules": ordered}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def read_index(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / INDEX_NAME
    if not path.is_file():
        return []
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        return list(index["modules"])
    except (ValueError, KeyError, TypeError):
        raise BuildError(f"{path}: not an attngen index; move it away or delete it") from None


def _confined(out: Path, relative_path: str) -> Path:
    """Resolve a module path and make sure it stays inside the output folder."""
    target = (out / relative_path).resolve()
    if not target.is_relative_to(out.resolve()):  # pragma: no cover - names are validated
        raise BuildError(f"{relative_path}: escapes the output folder {out}")
    return target
