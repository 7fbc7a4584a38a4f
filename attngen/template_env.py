"""The Jinja environment of every render: the templates in their compiled form, or their sources.

Jinja turns a template into Python once per process (it lexes and parses the template,
generates Python source and compiles it): 60-75 ms for the templates of one module on a
2-core CPU, most of a process's first render, which a kernel built on demand pays on the
call that needs it. So the package ships that Python, written ahead of time by

    python -m attngen.template_env          # after any change to attngen/templates/

into attngen/templates_compiled/: Jinja's own output (`Environment.compile`, the form its
`compile_templates` writes), one module per template under the file name jinja2.ModuleLoader
looks for, and manifest.json. A process imports those modules like any of attngen's own
(from their .pyc when Python has written one): the first render then costs about what a
later one does.

They are package files like the rest of attngen's code, not a cache: nothing is compiled
into, or loaded from, a user directory. They are used only when they are the compiled form
of exactly these templates for exactly this Jinja: manifest.json records the Jinja2 version
that wrote them (the generated code calls Jinja's runtime, whose internals may change between
versions), the environment options (trim_blocks and the others shape the code) and the
sha256 of the template sources. When any of them differs (another Jinja2 installed, a
template edited and not compiled again) the sources are compiled as before: the same bytes,
only the first render is slower, and `template_loading()` says why. tests/test_render.py
checks that the shipped modules are current and render what the sources render.
"""

from __future__ import annotations

import hashlib
import json
import sys
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from attngen.files import write_if_different

COMPILED_DIR = Path(__file__).resolve().parent / "templates_compiled"
MANIFEST = "manifest.json"
# Everything but the loader and `undefined` (a runtime choice) shapes the compiled code.
OPTIONS: dict[str, Any] = {
    "autoescape": False,  # Python source, not HTML; no user text
    "trim_blocks": True,
    "lstrip_blocks": True,
    "keep_trailing_newline": True,
}


@cache
def template_sources() -> dict[str, bytes]:
    """Every template (`*.py.jinja` of attngen/templates), by name, sorted: read once."""
    folder = resources.files("attngen").joinpath("templates")
    paths = sorted(
        (p for p in folder.iterdir() if p.name.endswith(".py.jinja")), key=lambda p: p.name
    )
    return {path.name: path.read_bytes() for path in paths}


def manifest() -> dict[str, Any]:
    """What the compiled templates of the current sources and Jinja record."""
    digest = hashlib.sha256()
    for name, data in template_sources().items():
        digest.update(name.encode() + b"\0" + data + b"\0")
    return {
        "about": "Jinja's compiled form of attngen/templates; written by "
        "`python -m attngen.template_env`, used only while every field below "
        "matches (attngen/template_env.py)",
        "jinja2": jinja2.__version__,
        "options": OPTIONS,
        "sources_sha256": digest.hexdigest(),
        "modules": {
            name: jinja2.ModuleLoader.get_module_filename(name) for name in template_sources()
        },
    }


def compiled_files() -> dict[str, str]:
    """file name -> text of the compiled templates and the manifest, from the sources."""
    source_env = _source_environment()
    files = {}
    for name, data in template_sources().items():
        # raw=True: the Python source; defer_init=True: as compile_templates writes it (the
        # module defines its names, and ModuleLoader binds the environment when it loads it)
        code = source_env.compile(data.decode("utf-8"), name, None, raw=True, defer_init=True)
        files[jinja2.ModuleLoader.get_module_filename(name)] = code
    files[MANIFEST] = json.dumps(manifest(), indent=1, sort_keys=True) + "\n"
    return files


def write_compiled(folder: Path = COMPILED_DIR) -> list[str]:
    """Write the compiled templates into `folder` (atomically, only what changed) and remove
    compiled modules no template has any more; the names of the files changed."""
    files = compiled_files()
    changed = [name for name, text in files.items() if write_if_different(folder / name, text)]
    for stale in sorted(folder.glob("tmpl_*.py")):
        if stale.name not in files:
            stale.unlink()
            changed.append(stale.name)
    return changed


def environment() -> jinja2.Environment:
    """The renders' environment: the compiled templates when current, else the sources."""
    return _environment_and_loading()[0]


def template_loading() -> str:
    """Where the renders' templates come from in this process, and why."""
    return _environment_and_loading()[1]


def _why_not_compiled(folder: Path) -> str | None:
    """None when `folder` holds the compiled form of the current templates for this Jinja."""
    try:
        shipped = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"no readable {MANIFEST} in {folder} ({type(exc).__name__})"
    current = manifest()
    if shipped.get("jinja2") != current["jinja2"]:
        return (
            f"the installed Jinja2 {current['jinja2']} is not {shipped.get('jinja2')}, "
            "which compiled them"
        )
    for field in ("options", "sources_sha256", "modules"):
        if shipped.get(field) != current[field]:
            return (
                f"their {field} differ from the templates' (run `python -m attngen.template_env`)"
            )
    missing = [f for f in current["modules"].values() if not (folder / f).is_file()]
    return f"{missing[0]} is missing" if missing else None


def _source_environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("attngen", "templates"),
        undefined=jinja2.StrictUndefined,
        **OPTIONS,
    )


@cache
def _environment_and_loading() -> tuple[jinja2.Environment, str]:
    why_not = _why_not_compiled(COMPILED_DIR)
    if why_not is not None:
        return (_source_environment(), f"sources (the compiled templates are not used: {why_not})")
    env = jinja2.Environment(
        loader=jinja2.ModuleLoader(COMPILED_DIR), undefined=jinja2.StrictUndefined, **OPTIONS
    )
    return env, f"compiled ({COMPILED_DIR.name}, Jinja2 {jinja2.__version__})"


def stale_files(folder: Path = COMPILED_DIR) -> list[str]:
    """The files of `folder` that write_compiled would change (written, or removed)."""
    files = compiled_files()
    stale = [
        name
        for name, text in files.items()
        if not (folder / name).is_file() or (folder / name).read_text(encoding="utf-8") != text
    ]
    return stale + sorted(p.name for p in folder.glob("tmpl_*.py") if p.name not in files)


def main(argv: list[str]) -> int:
    """`python -m attngen.template_env` writes the compiled templates; `--check` only says
    which are stale (exit 1 if any), as `attngen check` does for generated/."""
    if argv == ["--check"]:
        stale = stale_files()
        for name in stale:
            print(
                f"attngen/templates_compiled/{name}: stale; run `python -m attngen.template_env`",
                file=sys.stderr,
            )
        return 1 if stale else 0
    if argv:
        print("usage: python -m attngen.template_env [--check]", file=sys.stderr)
        return 2
    written = write_compiled()
    print("\n".join(written) if written else "attngen/templates_compiled is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
