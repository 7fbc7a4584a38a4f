"""Where kernels built on demand live, whether they are built at all, and building one into
the cache (plain Python; the build path is imported on the first build only).

Settings: on-demand builds are on unless `attngen.configure(on_demand=False)` or
`ATTNGEN_ON_DEMAND=0` turns them off (then neither are modules built nor is the cache read:
only folders someone built and vetted run). The cache root is `configure(cache_dir=...)`,
else `$ATTNGEN_CACHE`, else the user's cache directory (`$XDG_CACHE_HOME/attngen`, else
`~/.cache/attngen`; `~/Library/Caches/attngen` on macOS, `%LOCALAPPDATA%\\attngen\\Cache` on
Windows: the conventions platformdirs follows, without the dependency).

Under the root, one folder per key, each an ordinary `attngen build` folder (index.json,
<arch>/<module>.py, every module's sha256 in the index):

    attngen-<version>_triton-<version>_<arch>_<fingerprint>/

The fingerprint hashes what decides a rendered module's bytes besides its spec: the
templates, the tiling model, render, build and naming code, the on-demand rules, and the
arch's tuning file. A module is therefore never reused by an attngen, Triton or template
that would render it differently; stale folders are left alone (delete the root to reclaim
the space).

`cached_build` gives the cache's index item of a (spec, kind, arch), rendering and writing
the module unless a valid one is there. Concurrency: one lock file per module
(`<arch>/.<module>.lock`) held while it is looked up and built, so two processes (or threads)
asking for one module render it once; every file is written atomically (attngen.files) and
the index merged under its own lock (build.py). A module in the cache is used only if its
bytes hash to its index entry's sha256 and the entry is the spec asked for; otherwise it is
rendered again, replacing the file. The registry re-verifies the bytes when it imports them,
and a cache module that fails there is built again (`rebuild_item`), never run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import threading
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attngen.files import ENV_CACHE, locked, user_cache_dir
from attngen.names import __version__, module_name
from attngen.spec import AttnSpec, KernelKind, SpecError, specs_from_data

if TYPE_CHECKING:
    from attngen.build import Artifact

ENV_ON_DEMAND = "ATTNGEN_ON_DEMAND"
ENV_TUNING = "ATTNGEN_TUNING"
_PACKAGE = Path(__file__).resolve().parent.parent
_REPO_TUNING = _PACKAGE.parent / "tuning"
# The package files that decide what a rendered module holds (besides its spec and config).
_BUILD_SOURCES = (
    "templates/*.jinja",
    "tiling/*.py",
    "render.py",
    "build.py",
    "spec.py",
    "arch.py",
    "tuning/database.py",
    "runtime/ondemand.py",
    "runtime/kernel_cache.py",
)
_OFF = frozenset({"0", "false", "no", "off"})
_ON = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True)
class Settings:
    on_demand: bool
    cache_root: Path


_overrides: dict[str, object] = {}
_lock = threading.Lock()
_module_locks: dict[str, threading.Lock] = {}
_renders = 0


def settings() -> Settings:
    """The settings in force: configure()'s, else the environment's, else the defaults."""
    on_demand = _overrides.get("on_demand")
    if on_demand is None:
        on_demand = _env_flag(ENV_ON_DEMAND, default=True)
    root = _overrides.get("cache_dir") or os.environ.get(ENV_CACHE) or user_cache_dir()
    return Settings(bool(on_demand), Path(str(root)).expanduser())


def set_overrides(on_demand: bool | None, cache_dir: str | Path | None) -> None:
    """Record configure()'s values (None leaves a setting as it is)."""
    if on_demand is not None and not isinstance(on_demand, bool):
        raise ValueError(f"on_demand: got {on_demand!r}; allowed: True or False")
    if cache_dir is not None and not isinstance(cache_dir, (str, Path)):
        raise ValueError(f"cache_dir: got {cache_dir!r}; allowed: a folder path")
    with _lock:
        if on_demand is not None:
            _overrides["on_demand"] = on_demand
        if cache_dir is not None:
            _overrides["cache_dir"] = Path(cache_dir)


def reset_overrides() -> None:
    """Forget configure()'s values: the environment and defaults apply again."""
    with _lock:
        _overrides.clear()


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value.lower() in _OFF:
        return False
    if value.lower() in _ON:
        return True
    raise ValueError(f"${name}: got {value!r}; allowed: 1 or 0 (true/false, yes/no, on/off)")


def tuning_dir() -> Path | None:
    """The tuning database on-demand builds read: $ATTNGEN_TUNING, else the repository's
    tuning/ (a source checkout), else none (the heuristic)."""
    env = os.environ.get(ENV_TUNING)
    if env:
        return Path(env)
    return _REPO_TUNING if _REPO_TUNING.is_dir() else None


@cache
def triton_version() -> str:
    for distribution in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


@cache
def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    for pattern in _BUILD_SOURCES:
        for path in sorted(_PACKAGE.glob(pattern)):
            digest.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint(arch: str) -> str:
    """12 hex digits of the build code's and the arch's tuning file's hash."""
    return _fingerprint(arch, tuning_dir())


@cache
def _fingerprint(arch: str, tuning: Path | None) -> str:
    digest = hashlib.sha256(_code_fingerprint().encode())
    tuning_file = tuning / f"{arch}.json" if tuning is not None else None
    if tuning_file is not None and tuning_file.is_file():
        digest.update(tuning_file.read_bytes())
    return digest.hexdigest()[:12]


def cache_folder(arch: str, root: Path | None = None) -> Path:
    """The cache folder of `arch` for this attngen, Triton and build code."""
    root = settings().cache_root if root is None else root
    return root / (f"attngen-{__version__}_triton-{triton_version()}_{arch}_{fingerprint(arch)}")


def existing_cache_folders(archs: tuple[str, ...]) -> list[Path]:
    """The cache folders of these archs that hold an index (built before, by any process)."""
    return [
        folder for arch in archs if (folder := cache_folder(arch)).joinpath("index.json").is_file()
    ]


def render_count() -> int:
    """How many modules this process has rendered on demand (a cached one is not rendered)."""
    return _renders


def cached_build(spec: AttnSpec, kind: KernelKind, arch: str) -> tuple[Path, dict[str, Any], bool]:
    """The cache folder and index item of (spec, kind, arch), rendered and written unless a
    valid one is there; and whether it was rendered now."""
    folder = cache_folder(arch)
    name = module_name(spec, kind)
    relative = f"{arch}/{name}.py"
    (folder / arch).mkdir(parents=True, exist_ok=True)
    thread_lock = _module_locks.setdefault(relative, threading.Lock())
    with thread_lock, locked(folder / arch / f".{name}.lock"):
        item = _valid_item(folder, relative, spec, kind)
        if item is not None:
            return folder, item, False
        artifact = _render(spec, kind, arch)
        _write(artifact, folder)
        return folder, artifact.entry, True


def rebuild_item(spec: dict[str, Any], kind: str, arch: str) -> tuple[Path, dict[str, Any]]:
    """A cache module that failed its checks, rendered again from its index entry's spec
    (validated like any spec: ValueError when it is not one) and written over the bad file."""
    try:
        (parsed,) = specs_from_data(spec)
    except SpecError as exc:
        raise ValueError(str(exc)) from None
    folder, item, _ = cached_build(parsed, KernelKind(kind), arch)
    return folder, item


def _valid_item(
    folder: Path, relative: str, spec: AttnSpec, kind: KernelKind
) -> dict[str, Any] | None:
    """The index entry of `relative` if it is this spec's and the file's bytes hash to it."""
    from attngen.build import BuildError, read_index

    try:
        items = read_index(folder)
    except BuildError:
        return None  # a corrupt index: _write sets it aside
    item = next((i for i in items if isinstance(i, dict) and i.get("path") == relative), None)
    if item is None or item.get("spec") != spec.canonical() or item.get("kind") != kind.value:
        return None
    try:
        data = (folder / relative).read_bytes()
    except OSError:
        return None
    return item if hashlib.sha256(data).hexdigest() == item.get("sha256") else None


def _render(spec: AttnSpec, kind: KernelKind, arch: str) -> Artifact:
    from attngen.build import plan_build  # the build path (sympy, jinja): on first build only
    from attngen.tuning.database import TuningError

    global _renders
    try:
        (artifact,) = plan_build([spec], tuning_dir())
    except TuningError as exc:
        warnings.warn(
            f"attngen: the tuning database cannot serve {module_name(spec, kind)} on "
            f"{arch} ({exc}); built with the tiling model's config",
            stacklevel=2,
        )
        (artifact,) = plan_build([spec], None)
    with _lock:
        _renders += 1
    return artifact


def _write(artifact: Artifact, folder: Path) -> None:
    from attngen.build import BuildError, write_build

    try:
        write_build([artifact], folder)
    except BuildError:
        # index.json does not parse: set it aside (under the index lock, so no writer is
        # between reading and replacing it) and merge into a fresh one. Its other modules
        # are rebuilt when next asked for.
        with locked(folder / ".index.lock"), contextlib.suppress(FileNotFoundError):
            (folder / "index.json").replace(folder / "index.json.corrupt")
        write_build([artifact], folder)
