"""The `attngen` command: a thin layer over attngen.build and attngen.explain.

User mistakes (bad specs, specs no arch can serve) print one line to stderr and exit 1; usage
mistakes (unknown options, missing arguments) exit 2 through click. No tracebacks for either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attngen.arch import arch_names
from attngen.build import build, load_specs, stale_paths
from attngen.explain import explain_lines
from attngen.spec import SpecError
from attngen.tuning import DEFAULT_TUNING_DIR

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Generate specialized FlashAttention-style Triton kernels from YAML specs.",
)

SpecPaths = Annotated[list[Path], typer.Argument(help="Spec files (YAML).", show_default=False)]
OutDir = Annotated[Path, typer.Option("--out", help="Output folder.")]
TuningDir = Annotated[Path, typer.Option(
    "--tuning", help="Tuning database folder (attngen autotune); used when it exists.")]


def _tuning(tuning: Path) -> Path | None:
    return tuning if tuning.is_dir() else None


def _fail(message: str) -> typer.Exit:
    typer.echo(f"attngen: error: {message}", err=True)
    return typer.Exit(code=1)


@app.command("build")
def build_command(specs: SpecPaths, out: OutDir = Path("generated"),
                  tuning: TuningDir = DEFAULT_TUNING_DIR) -> None:
    """Render every (kernel, arch) of the specs into OUT/<arch>/<module>.py and OUT/index.json."""
    try:
        changed = build(specs, out, _tuning(tuning))
    except SpecError as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"attngen: {len(changed)} file(s) written to {out}" if changed
               else f"attngen: {out} is up to date")


@app.command("check")
def check_command(specs: SpecPaths, out: OutDir = Path("generated"),
                  tuning: TuningDir = DEFAULT_TUNING_DIR) -> None:
    """Exit 1 when OUT differs from what `attngen build` would write for the specs."""
    try:
        stale = stale_paths(specs, out, _tuning(tuning))
    except SpecError as exc:
        raise _fail(str(exc)) from None
    if stale:
        raise _fail(f"{out} is stale; run `attngen build`: " + ", ".join(stale))
    typer.echo(f"attngen: {out} is up to date")


@app.command("explain")
def explain_command(
    specs: SpecPaths,
    arch: Annotated[str | None, typer.Option(help=f"Only this arch ({', '.join(arch_names())}).")]
    = None,
    tuning: TuningDir = DEFAULT_TUNING_DIR,
) -> None:
    """Print the tile derivation for each spec and arch: model, constraints, candidates, choice."""
    if arch is not None and arch not in arch_names():
        allowed = ", ".join(arch_names())
        raise typer.BadParameter(f"{arch!r}; allowed: {allowed}", param_hint="--arch")
    try:
        lines = explain_lines(load_specs(specs), None if arch is None else [arch],
                              _tuning(tuning))
    except SpecError as exc:
        raise _fail(str(exc)) from None
    typer.echo("\n".join(lines).rstrip())


@app.command("autotune")
def autotune_command(
    specs: SpecPaths,
    arch: Annotated[str, typer.Option(help="GPU arch to tune for; auto = this machine's GPU.")]
    = "auto",
    budget: Annotated[float, typer.Option(help="Seconds for the whole run; resumable.")] = 600.0,
    max_configs: Annotated[int, typer.Option(help="Candidates per spec, best predicted first.")]
    = 16,
    tuning: TuningDir = DEFAULT_TUNING_DIR,
) -> None:
    """Time the feasible tile configs on this GPU and record winners in TUNING/<arch>.json.

    Then `attngen build` uses them (the module header says the config came from tuning)."""
    try:
        from attngen.autotune import autotune, detect_arch  # torch/triton: not on the build path

        loaded = load_specs(specs)
        target = detect_arch() if arch == "auto" else arch
        if arch != "auto" and target != detect_arch():
            raise SpecError(f"--arch {arch}: this machine's GPU is {detect_arch()}; tune there")
        outcomes = autotune(loaded, tuning, budget, max_configs, target)
    except SpecError as exc:
        raise _fail(str(exc)) from None
    missing = [o.spec.name for o in outcomes if o.winner is None]
    if missing:
        raise _fail("no candidate passed the correctness gate for: " + ", ".join(missing))
    typer.echo(f"attngen: winners recorded in {tuning}; run `attngen build` to use them")


def main() -> None:  # pragma: no cover - console entry point
    app()
