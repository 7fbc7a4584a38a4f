"""The kernel registry: which generated modules exist, and importing them verified.

A folder of generated kernels is what `attngen build` writes: `<arch>/<module>.py` files and
an `index.json` describing each (kind, arch, spec, sha256 of the file's bytes). The registry
reads the index only; a module is imported (from its file: Triton's JIT needs real source
files) the first time a call is dispatched to it, and only as the module its entry describes:
its bytes hash to the entry's sha256, it is executed from exactly those bytes (linecache holds
them, so Triton's JIT compiles what was verified), and its constants (HEAD_DIM, MASK, DTYPE,
...) and entry point say what its entry says. A module's key is its file's absolute path.

The registry holds three layers of folders (docs/integration.md, "Loading kernels"), the
first layer's module winning (selection.best_entry): `load_kernels` folders and
`$ATTNGEN_KERNELS`, the on-demand cache (below) while on, the bundled `generated/`. Every
load builds a new Registry: a key chosen from the one it replaced is refused (RegistryError),
never run. A module built on demand is added to the registry in use (`Registry.add`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import linecache
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from attngen.arch import arch_names
from attngen.spec import AttnSpec, Dtype, KernelKind, SpecError, specs_from_data
from attngen.spec.files import ENV_CACHE, locked, unverified_variants_on, user_cache_dir
from attngen.spec.names import __version__, module_name

if TYPE_CHECKING:
    from attngen.build import Artifact


ENV_KERNELS = "ATTNGEN_KERNELS"
_REPO_GENERATED = Path(__file__).resolve().parent.parent.parent / "generated"
# Where an entry's folder sits among the layers (the module docstring), best first.
SOURCES = ("folder", "cache", "bundled")
RANK_STRIDE = 10_000  # KernelEntry.rank = layer * RANK_STRIDE + the folder's place in it
ENTRY_POINTS = {"prefill": "attention", "varlen": "attention_varlen", "decode": "decode"}


class RegistryError(RuntimeError):
    """The kernel folder is missing, is not an attngen build, or a module fails its checks."""


@dataclass(frozen=True)
class KernelEntry:
    """One generated module, as its index entry describes it."""

    key: str  # absolute path of the module file; what the ops take
    module: str  # module name, e.g. llama3_8b_varlen_bf16_d128_causal_br
    arch: str  # sm80, sm90, ...
    kind: str  # prefill | varlen | decode
    spec: dict[str, Any]  # the canonical spec (dtype, head_dim, mask, ...)
    sha256: str = ""  # of the module file's bytes, recorded by `attngen build`
    source: str = "folder"  # its layer: one of SOURCES
    rank: int = 0  # layer, then folder order (RANK_STRIDE): lower wins among serving modules

    def describe(self) -> str:
        return f"{self.arch}/{self.module}"


@dataclass(frozen=True)
class LoadedKernel:
    """One row of loaded_kernels(): a module the registry in use may run, and its origin."""

    module: str
    arch: str
    kind: str
    source: str  # "folder" (loaded explicitly), "cache" (built on demand) or "bundled"
    path: str  # the module file
    folder: str  # the build folder holding it (and its index.json)


class Registry:
    """The modules of some folders: their entries and their verified imports. What the
    runtime derives from the entries for its calls (selection's prefiltered lists, the
    dispatch records, the plans) is in the route cache (selection.routes), bound to the
    registry in use."""

    def __init__(
        self,
        folders: list[Path],
        entries: list[KernelEntry],
        layers: tuple[list[Path], bool] | None = None,
    ):
        self.folders = folders
        self.entries = entries
        # (explicit folders, whether generated/ is the last layer): what reload_kernels and
        # use_registry restore; None for a registry made by hand (its folders, all explicit)
        self.layers = layers if layers is not None else (list(folders), False)
        self._by_key = {entry.key: entry for entry in entries}
        self._modules: dict[str, ModuleType] = {}
        self._lock = threading.Lock()

    def module(self, key: str) -> ModuleType:
        """The imported, verified module for a key (imported once, then cached). A module of
        the on-demand cache that fails its checks (bytes, header) is rebuilt and
        the rebuilt one imported; one from any other folder is refused (RegistryError)."""
        module = self._modules.get(key)
        if module is None:
            entry = self._by_key.get(key)
            if entry is None:
                raise RegistryError(
                    f"{key}: not among the kernels loaded now "
                    f"({', '.join(map(str, self.folders)) or 'no folders'}); "
                    "load_kernels replaced the registry after this call chose it (a compiled "
                    "graph keeps its choice: recompile), so it is not run"
                )
            with self._lock:
                module = self._modules.get(key)
                if module is None:
                    try:
                        module = import_verified(entry)
                    except RegistryError:
                        if entry.source != "cache":
                            raise
                        entry = _rebuild(entry)
                        self._replace_entry(entry)
                        module = import_verified(entry)
                    self._modules[key] = module
        return module

    def add(self, entry: KernelEntry, folder: Path) -> None:
        """Serve `entry` (a module just built on demand into `folder`) from now on. The entries
        list is replaced, so the lists derived from it start over (selection.same_kernel_fields)
        and every later selection sees it; the choices already made stay valid (they were
        served before it existed)."""
        with self._lock:
            if entry.key in self._by_key:
                self._replace_entry(entry)
                return
            if folder not in self.folders:
                self.folders = [*self.folders, folder]
            self._by_key[entry.key] = entry
            self.entries = [*self.entries, entry]  # a new list: readers keep a whole one

    def _replace_entry(self, entry: KernelEntry) -> None:
        self._by_key[entry.key] = entry
        self.entries = [entry if e.key == entry.key else e for e in self.entries]


def read_folder(folder: str | Path, source: str = "folder", rank: int = 0) -> list[KernelEntry]:
    folder = Path(folder).resolve()
    index = folder / "index.json"
    if not index.is_file():
        raise RegistryError(
            f"{folder}: no index.json; expected a folder written by `attngen build --out FOLDER`"
        )
    try:
        modules = json.loads(index.read_text(encoding="utf-8"))["modules"]
        entries = []
        for item in modules:
            path = (folder / item["path"]).resolve()
            if not path.is_relative_to(folder):
                raise RegistryError(f"{index}: module path {item['path']!r} leaves the folder")
            digest = item.get("sha256")
            if not isinstance(digest, str) or len(digest) != 64:
                raise RegistryError(
                    f"{index}: {item['path']} has no sha256 of its bytes (an index written "
                    "before attngen recorded them); rebuild the folder with `attngen build`"
                )
            entries.append(_entry(folder, item, source, rank))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RegistryError(f"{index}: not an attngen index ({exc!r})") from None
    return entries


_current: Registry | None = None
_current_lock = threading.Lock()
_explicit: list[Path] | None = None  # None: $ATTNGEN_KERNELS
_bundled = True  # whether the repository's generated/ is the last layer


def load_kernels(*folders: str | Path, replace: bool = False) -> Registry:
    """Serve the generated kernels in these folders (each an `attngen build --out` folder)
    before those already loaded (the registry's layers: the module docstring).

    replace=True: only these folders, without the bundled generated/ or folders loaded
    before (the on-demand cache stays while on-demand builds are on). Without folders: back
    to the defaults ($ATTNGEN_KERNELS, the cache, generated/). Builds a new registry, makes
    it the one in use and returns it.
    """
    global _explicit, _bundled
    paths = [Path(f).resolve() for f in folders]
    with _current_lock:
        if replace:
            explicit, bundled = paths, False
        elif paths:
            earlier = _env_folders() if _explicit is None else _explicit
            explicit, bundled = list(dict.fromkeys([*paths, *earlier])), _bundled
        else:
            explicit, bundled = _env_folders(), True
        registry = _assemble(explicit, bundled)
        _explicit, _bundled = explicit, bundled
        _set_current(registry)
    return registry


def reload_kernels() -> Registry:
    """Read the current layers' folders again into a new registry (configure() calls it)."""
    with _current_lock:
        explicit = _env_folders() if _explicit is None else _explicit
        registry = _assemble(explicit, _bundled)
        _set_current(registry)
    return registry


def configure(
    *, on_demand: bool | None = None, cache_dir: str | Path | None = None
) -> dict[str, object]:
    """Runtime settings (None keeps a setting): on_demand=False builds no module a call
    needs and reads no cache (only loaded folders run: for deployments that must run vetted
    modules only; ATTNGEN_ON_DEMAND=0 does the same), cache_dir replaces $ATTNGEN_CACHE.
    Returns the settings now in force. The registry is read again when the cache's settings
    change it."""
    before = settings()
    set_overrides(on_demand, cache_dir)
    now = settings()
    if now != before and _current is not None:
        reload_kernels()
    return {"on_demand": now.on_demand, "cache_dir": str(now.cache_root)}


def _set_current(registry: Registry) -> None:
    global _current
    _current = registry


def use_registry(registry: Registry) -> Registry:
    """Make a registry (one current_registry() returned earlier) the one in use again, with
    its layers (what load_kernels adds to next)."""
    global _explicit, _bundled
    with _current_lock:
        _explicit, _bundled = list(registry.layers[0]), registry.layers[1]
        _set_current(registry)
    return registry


def current_registry() -> Registry:
    """The registry in use, loaded from the default folders on first use."""
    current = _current
    if current is None:
        with _current_lock:
            current = _current
        if current is None:
            current = reload_kernels()
    return current


def loaded_kernels() -> list[LoadedKernel]:
    """Every module the registry in use may run, in the order selection prefers them (layer,
    then folder), with where each came from."""
    rows = sorted(current_registry().entries, key=lambda e: (e.rank, e.kind, e.arch, e.module))
    return [
        LoadedKernel(e.module, e.arch, e.kind, e.source, e.key, str(Path(e.key).parents[1]))
        for e in rows  # a module file is <folder>/<arch>/<module>.py
    ]


def _assemble(explicit: list[Path], bundled: bool) -> Registry:
    """The registry of these explicit folders, the cache (while on) and generated/."""
    layers = [(folder, "folder") for folder in explicit]
    on_demand = settings().on_demand
    if on_demand:
        layers += [(folder, "cache") for folder in existing_cache_folders(arch_names())]
    if bundled and (_REPO_GENERATED / "index.json").is_file() and _REPO_GENERATED not in explicit:
        layers.append((_REPO_GENERATED, "bundled"))
    if not layers and not on_demand:
        raise RegistryError(
            f"no generated kernels: set {ENV_KERNELS} to a folder written by `attngen build "
            "--out FOLDER`, call attngen.load_kernels(FOLDER), or turn on-demand builds on "
            f"(attngen.configure(on_demand=True), {ENV_ON_DEMAND}=1)"
        )
    entries = []
    for place, (folder, source) in enumerate(layers):
        rank = SOURCES.index(source) * RANK_STRIDE + place
        try:
            entries += read_folder(folder, source, rank)
        except RegistryError:
            if source != "cache":
                raise
            # A cache index that does not parse is rebuilt by the next on-demand build
            # (selection.build_for); until then its folder serves nothing.
    return Registry([folder.resolve() for folder, _ in layers], entries, (explicit, bundled))


def _env_folders() -> list[Path]:
    env = os.environ.get(ENV_KERNELS)
    return [Path(p).resolve() for p in env.split(os.pathsep) if p] if env else []


def _entry(folder: Path, item: dict[str, Any], source: str, rank: int) -> KernelEntry:
    path, spec = str((folder / item["path"]).resolve()), dict(item["spec"])
    return KernelEntry(
        path, item["module"], item["arch"], item["kind"], spec, item["sha256"], source, rank
    )


def cache_entry(folder: Path, item: dict[str, Any]) -> KernelEntry:
    """The entry of an index item of the on-demand cache's `folder`."""
    return _entry(folder, item, "cache", SOURCES.index("cache") * RANK_STRIDE)


def _rebuild(entry: KernelEntry) -> KernelEntry:
    """A cache module that failed its checks, built again from its entry's spec, in its place."""
    try:
        folder, item = rebuild_item(entry.spec, entry.kind, entry.arch)
    except ValueError as exc:
        raise RegistryError(
            f"{entry.key}: a cached module whose index entry is not a spec ({exc}); not run"
        ) from None
    fresh = cache_entry(folder, item)
    if fresh.key != entry.key:
        raise RegistryError(
            f"{entry.key}: its index entry describes another module ({fresh.key}); not run"
        )
    return dataclasses.replace(fresh, source=entry.source, rank=entry.rank)


def import_verified(entry: KernelEntry) -> ModuleType:
    path = Path(entry.key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RegistryError(
            f"{path}: listed in index.json but missing; rebuild the folder with `attngen build`"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise RegistryError(
            f"{path}: its bytes do not match the sha256 in index.json (index {entry.sha256[:16]}, "
            f"file {digest[:16]}): the file changed after `attngen build` wrote it; rebuild "
            "the folder, or restore the file"
        )
    stale = built_elsewhere(data)
    if stale:
        raise RegistryError(f"{path}: {stale}; rebuild the folder with `attngen build`")
    module = _execute(path, data, entry)
    problems = constant_mismatches(module, entry)
    if problems:
        raise RegistryError(
            f"{path}: the module disagrees with its index entry "
            f"({'; '.join(problems)}); rebuild the folder with `attngen build`"
        )
    return module


def _torch_dtype(name: object) -> str | None:
    """str() of a spec dtype's torch dtype, or None: DTYPE is compared by name (no torch)."""
    return f"torch.{Dtype(name).torch_name}" if name in {d.value for d in Dtype} else None


def expected_constants(entry: KernelEntry) -> dict[str, object]:
    """The module-level constants a generated module of this entry defines, and their values."""
    spec = entry.spec
    expected: dict[str, object] = {
        "HEAD_DIM": spec.get("head_dim"),
        "HEAD_DIM_V": spec.get("head_dim_v") or spec.get("head_dim"),
        "DTYPE": _torch_dtype(spec.get("dtype")),
        "MASK": spec.get("mask"),
        "SOFTCAP": float(spec.get("softcap") or 0.0),
        "ALIBI": bool(spec.get("alibi")),
    }
    if spec.get("causal_align"):
        expected["CAUSAL_ALIGN"] = spec["causal_align"]
    if spec.get("mask") == "sliding_window":
        expected["WINDOW"] = (spec.get("window_left"), spec.get("window_right") or 0)
    # Modules of specs with the newer models' fields say so; older modules lack the names.
    if spec.get("sinks"):
        expected["SINKS"] = True
    if spec.get("chunk_size"):
        expected["CHUNK_SIZE"] = spec["chunk_size"]
    if spec.get("sink_tokens"):
        expected["SINK_TOKENS"] = spec["sink_tokens"]
    if entry.kind == "decode":
        expected["KV_LAYOUT"] = spec.get("kv_layout")
        expected["PAGE_SIZE"] = spec.get("page_size") or 0
        expected["MAX_QUERY_TOKENS"] = spec.get("max_query_tokens") or 1
    return expected


def constant_mismatches(module: ModuleType, entry: KernelEntry) -> list[str]:
    """'NAME: module has X, index says Y' for each constant (and the entry point) that differs."""
    problems = []
    for name, want in expected_constants(entry).items():
        if not hasattr(module, name):
            problems.append(f"{name}: not defined by the module, index says {want!r}")
            continue
        got = getattr(module, name)
        if name == "DTYPE":
            got = str(got)
        if isinstance(want, tuple) and isinstance(got, list):
            got = tuple(got)
        if got != want:
            problems.append(f"{name}: module has {got!r}, index says {want!r}")
    entry_point = ENTRY_POINTS.get(entry.kind)
    if entry_point is None or not callable(getattr(module, entry_point, None)):
        problems.append(f"kind {entry.kind}: the module has no {entry_point}() entry point")
    return problems


def _execute(path: Path, data: bytes, entry: KernelEntry) -> ModuleType:
    # A unique, stable name per file and content: two folders may hold modules of one name.
    name = f"attngen_kernels_{hashlib.sha256(str(path).encode()).hexdigest()[:10]}_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None:  # pragma: no cover - a .py path always gives a spec
        raise RegistryError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(module_spec)
    text = data.decode("utf-8")
    # mtime None: linecache.checkcache never replaces these lines with the file's current ones.
    linecache.cache[str(path)] = (len(data), None, text.splitlines(keepends=True), str(path))
    code = compile(data, str(path), "exec", dont_inherit=True)
    sys.modules[name] = module  # Triton and inspect look modules up by name
    try:
        exec(code, module.__dict__)
    except Exception:
        sys.modules.pop(name, None)
        raise
    return module


# -------------------------------------------------------------------- the on-demand cache
#
# Where kernels built on demand live, whether they are built at all, and building one into
# the cache (plain Python; the build path is imported on the first build only).
#
# docs/integration.md ("Kernels on demand") has the settings, the cache's folders (one per
# attngen and Triton version, arch and build-code fingerprint, so no module is reused by code
# that would render it differently) and its locks. `cached_build` gives the index item of a
# (spec, kind, arch), rendering and writing the module unless a valid one is there, under one
# lock file per module (`<arch>/.<module>.lock`); files are written atomically and the index
# merged under its own lock (build.py). A module is used only if its bytes hash to its index
# entry's sha256 and the entry is the spec asked for; otherwise it is rendered again. The
# registry re-verifies the bytes when it imports them and rebuilds one that fails
# (`rebuild_item`), never runs it.

ENV_ON_DEMAND = "ATTNGEN_ON_DEMAND"
ENV_TUNING = "ATTNGEN_TUNING"
_HEADER = re.compile(rb"# Generated by attngen (\S+) from template (\S+) \((\w+)\)\.")
_PACKAGE = Path(__file__).resolve().parent.parent
_REPO_TUNING = _PACKAGE.parent / "tuning"
# The package files that decide what a rendered module holds (besides its spec and config).
_BUILD_SOURCES = (
    "templates/*.jinja",
    "tiling/*.py",
    "render/*.py",
    "build.py",
    "spec/*.py",
    "host/*.py",  # copied into each module
    "arch.py",
    "tuning/database.py",
    "runtime/selection.py",  # the spec a call needs (on demand), with selection
    "runtime/registry.py",  # the cache and its builds, with the registry
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
    """The cache folder of `arch` for this attngen, Triton and build code (and another one
    for the Gluon variants not yet verified on a GPU, built under ATTNGEN_GLUON_VARIANTS=1)."""
    root = settings().cache_root if root is None else root
    name = f"attngen-{__version__}_triton-{triton_version()}_{arch}_{fingerprint(arch)}"
    return root / (name + ("_gluon-unverified" if unverified_variants_on() else ""))


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
    valid = hashlib.sha256(data).hexdigest() == item.get("sha256")
    return item if valid and not built_elsewhere(data) else None


def built_elsewhere(data: bytes) -> str | None:
    """How a module's header (attngen, template hash) differs from the running ones, or None."""
    from attngen.host import template_hash  # when a module is first read

    header = _HEADER.match(data)
    if header is None:
        return "has no attngen header (its first line names the attngen and template built it)"
    version, template, digest = (p.decode() for p in header.groups())
    if (version, digest) != (__version__, running := template_hash(template)):
        return f"built by attngen {version} ({template} {digest}), not {__version__} ({running})"
    return None


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
