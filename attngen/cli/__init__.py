"""The `attngen` command: a thin layer over the library (build, explain, tuning, verify).

User mistakes (bad specs, specs no arch can serve) print one line to stderr and exit 1; usage
mistakes (unknown options, missing arguments) exit 2 through click. No tracebacks for either.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from attngen.arch import arch_names
from attngen.build import build, check_folder, load_specs
from attngen.cli.explain import explain_lines
from attngen.spec import SpecError, load_spec_file, specs_from_data
from attngen.tuning.database import DEFAULT_TUNING_DIR

if TYPE_CHECKING:  # the verify modules are imported by the commands that need them
    from attngen.spec import AttnSpec
    from attngen.verify.check import Planner
    from attngen.verify.measurements import Measurements

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Generate specialized FlashAttention-style Triton kernels from YAML specs.",
)

SpecPaths = Annotated[list[Path], typer.Argument(help="Spec files (YAML).", show_default=False)]
OutDir = Annotated[Path, typer.Option("--out", help="Output folder.")]
TuningDir = Annotated[Path, typer.Option(
    "--tuning", help="Tuning database folder (attngen autotune); used when it "
    "exists.")]  # fmt: skip

# verify-tiling's options whose help takes several lines
_SampleOption = Annotated[int, typer.Option(
    help="Recompile N configs from the data file live (half rejected ones): the data must be "
    "current for the installed Triton.")]  # fmt: skip
_EverySpecOption = Annotated[bool, typer.Option(
    help="Also compile every other spec of each feasible config and hold it to the spill "
    "policy (slow: about 2900 compiles for the examples); the data keeps one record per "
    "config.")]  # fmt: skip
_MeasurementsOption = Annotated[Path | None, typer.Option(
    help="Compiler measurements file; default "
    "attngen/verify/data/prefill_compile_triton-<installed version>.json.")]  # fmt: skip
_GluonOption = Annotated[bool, typer.Option(
    help="Instead: compile each sm90 prefill module's warp-specialized (Gluon) forward live "
    "and compare it with attngen/tiling/gluon.py (shared memory, spills, registers).")]  # fmt: skip
_BackwardOption = Annotated[bool, typer.Option(
    help="Check the gradient kernels (dQ, dK/dV) of the specs with backward: true instead of "
    "the forward, against attngen/verify/data/backward_compile_triton-<version>.json."
    )]  # fmt: skip


def _tuning(tuning: Path) -> Path | None:
    return tuning if tuning.is_dir() else None


def _fail(message: str) -> typer.Exit:
    typer.echo(f"attngen: error: {message}", err=True)
    return typer.Exit(code=1)


@app.command("build")
def build_command(
    specs: SpecPaths, out: OutDir = Path("generated"), tuning: TuningDir = DEFAULT_TUNING_DIR
) -> None:
    """Render every (kernel, arch) of the specs into OUT/<arch>/<module>.py and OUT/index.json."""
    try:
        changed = build(specs, out, _tuning(tuning))
    except SpecError as exc:
        raise _fail(str(exc)) from None
    typer.echo(
        f"attngen: {len(changed)} file(s) written to {out}"
        if changed
        else f"attngen: {out} is up to date"
    )


@app.command("check")
def check_command(
    specs: SpecPaths, out: OutDir = Path("generated"), tuning: TuningDir = DEFAULT_TUNING_DIR
) -> None:
    """Exit 1 when OUT differs from what `attngen build` would write for the specs, or holds
    modules that none of the specs produces."""
    try:
        stale, unproduced = check_folder(specs, out, _tuning(tuning))
    except SpecError as exc:
        raise _fail(str(exc)) from None
    problems = []
    if stale:
        problems.append(f"{out} is stale; run `attngen build`: " + ", ".join(stale))
    if unproduced:
        problems.append(
            f"{out} holds modules that none of the given specs produces (pass "
            "their specs too, or delete them and their index entries): " + ", ".join(unproduced)
        )
    if problems:
        raise _fail("; ".join(problems))
    typer.echo(f"attngen: {out} is up to date")


@app.command("spec-from-hf")
def spec_from_hf_command(
    config: Annotated[
        Path, typer.Argument(help="A transformers config.json, or its folder.", show_default=False)
    ],
    archs: Annotated[str, typer.Option(help="Comma-separated targets.")] = "sm80,sm90",
    name: Annotated[str | None, typer.Option(help="Spec name; default the model_type.")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="fp16 | bf16 | fp32; default the config's dtype/torch_dtype.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the spec here; default stdout.")
    ] = None,
) -> None:
    """Write the spec of a transformers model's attention (read as JSON; no transformers)."""
    from attngen.spec.files import write_if_different
    from attngen.spec.hf import spec_data_from_config, spec_yaml

    try:
        data = spec_data_from_config(
            config, archs=[a for a in archs.split(",") if a], name=name, dtype=dtype
        )
        specs_from_data(data)  # validated before anything is written
        text = spec_yaml(data)
    except SpecError as exc:
        raise _fail(str(exc)) from None
    if out is None:
        typer.echo(text, nl=False)
    else:
        write_if_different(out, text)
        typer.echo(f"attngen: {out} written")


@app.command("explain")
def explain_command(
    specs: SpecPaths,
    arch: Annotated[
        str | None, typer.Option(help=f"Only this arch ({', '.join(arch_names())}).")
    ] = None,
    tuning: TuningDir = DEFAULT_TUNING_DIR,
) -> None:
    """Print the tile derivation for each spec and arch: model, constraints, candidates, choice."""
    if arch is not None and arch not in arch_names():
        allowed = ", ".join(arch_names())
        raise typer.BadParameter(f"{arch!r}; allowed: {allowed}", param_hint="--arch")
    try:
        lines = explain_lines(load_specs(specs), None if arch is None else [arch], _tuning(tuning))
    except SpecError as exc:
        raise _fail(str(exc)) from None
    typer.echo("\n".join(lines).rstrip())


@app.command("autotune")
def autotune_command(
    specs: SpecPaths,
    arch: Annotated[
        str, typer.Option(help="GPU arch to tune for; auto = this machine's GPU.")
    ] = "auto",
    budget: Annotated[float, typer.Option(help="Seconds for the whole run; resumable.")] = 600.0,
    max_configs: Annotated[
        int, typer.Option(help="Candidates per spec (each tile shape's best; the Gluon forward's).")
    ] = 16,
    tuning: TuningDir = DEFAULT_TUNING_DIR,
    kernels: Annotated[
        str,
        typer.Option(
            help="all, forward (sm90: the Gluon forward too) or backward: the dQ and dK/dV "
            "kernels of the specs with backward: true (all does both)."
        ),
    ] = "all",
    max_backward_configs: Annotated[
        int, typer.Option(help="Candidates per gradient kernel, the heuristic's first.")
    ] = 6,
) -> None:
    """Time the feasible tile configs on this GPU and record winners in TUNING/<arch>.json.

    Then `attngen build` uses them (the module header says the config came from tuning)."""
    try:
        # torch/triton: not on the build path
        from attngen.tuning.autotune import BackwardOptions, autotune, detect_arch

        loaded = load_specs(specs)
        target = detect_arch() if arch == "auto" else arch
        if arch != "auto" and target != detect_arch():
            raise SpecError(f"--arch {arch}: this machine's GPU is {detect_arch()}; tune there")
        backward = BackwardOptions(max_configs=max_backward_configs)
        outcomes = autotune(
            loaded, tuning, budget, max_configs, target, kernels=kernels, backward=backward
        )
    except SpecError as exc:
        raise _fail(str(exc)) from None
    lost = [o for o in outcomes if o.winner is None]
    untried = [_outcome_name(o.spec.name, o.kernel) for o in lost if o.tried == 0]
    failed = [_outcome_name(o.spec.name, o.kernel) for o in lost if o.tried > 0]
    if failed:
        raise _fail("no candidate passed the correctness gate for: " + ", ".join(failed))
    if untried:
        raise _fail(
            "the budget ran out before these were measured (run again to resume): "
            + ", ".join(untried)
        )
    typer.echo(f"attngen: winners recorded in {tuning}; run `attngen build` to use them")


def _outcome_name(spec_name: str, kernel: str) -> str:
    """A spec's name, with the gradient kernel's kind for a backward outcome."""
    return spec_name if kernel == "prefill" else f"{spec_name} ({kernel})"


@app.command("verify-tiling")
def verify_tiling_command(
    specs: Annotated[
        list[Path] | None,
        typer.Argument(help="Spec files (YAML); default examples/*.yaml.", show_default=False),
    ] = None,
    arch: Annotated[
        list[str] | None,
        typer.Option(help="Only this arch (repeatable); default every arch in attngen/arch.py."),
    ] = None,
    sample: _SampleOption = 0,
    recompile: Annotated[
        bool, typer.Option(help="Compile every config live instead of reading the data file.")
    ] = False,
    every_spec: _EverySpecOption = False,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write every row and the summary as JSON.")
    ] = None,
    data: _MeasurementsOption = None,
    save_data: Annotated[
        bool, typer.Option(help="Write what was compiled live into the data file.")
    ] = False,
    rows: Annotated[bool, typer.Option(help="Print every config, not only failures.")] = False,
    jobs: Annotated[int, typer.Option(help="Compile processes.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of --sample.")] = 0,
    backward: _BackwardOption = False,
    gluon: _GluonOption = False,
) -> None:
    """Compare the tiling model with Triton's compiler on every candidate config; exit 1 on a
    feasible config that does not fit or spills more than allowed (docs/tiling.md)."""
    # Imported here: the other commands never need the measurements or (lazily) triton.
    from attngen.verify.check import verify_tiling
    from attngen.verify.report import dump_json, report_lines

    if gluon:
        _verify_gluon(specs)
        return
    arches = _checked_arches(arch)
    loaded, measurements, path, planner = _tiling_inputs(specs, backward, data)
    report = verify_tiling(
        loaded,
        arches,
        measurements,
        recompile=recompile,
        sample=sample,
        seed=seed,
        processes=jobs,
        every_spec=every_spec,
        save_to=path if save_data else None,
        progress=lambda message: typer.echo(f"attngen: {message}", err=True),
        planner=planner,
    )
    typer.echo("\n".join(report_lines(report, all_rows=rows)))
    if json_path is not None:
        json_path.write_text(dump_json(report), encoding="utf-8")
    if save_data and report.live:
        typer.echo(f"attngen: {report.live} record(s) written to {path}")
    if report.failed:
        raise typer.Exit(code=1)


def _verify_gluon(specs: list[Path] | None) -> None:
    """verify-tiling --gluon: each sm90 Gluon forward (and dK/dV backward, in modules built
    with ATTNGEN_GLUON_VARIANTS=1) compiled live and judged (exit 1 on a mismatch)."""
    from attngen.verify.gluon import verify_gluon

    paths = specs or sorted(Path("examples").glob("*.yaml"))
    try:
        loaded = [spec for path in paths for spec in load_spec_file(path)]
    except SpecError as exc:
        raise _fail(str(exc)) from None
    rows = verify_gluon(loaded)
    failed = [row for row in rows if row.problems]
    typer.echo(f"Gluon kernels (sm90), {len(rows)} kernel(s) compiled live:")
    typer.echo("\n".join(row.line() for row in rows))
    typer.echo(f"result: {'FAILED: ' + str(len(failed)) + ' module(s)' if failed else 'PASS'}")
    if failed:
        raise typer.Exit(code=1)


def _checked_arches(arch: list[str] | None) -> Sequence[str]:
    """--arch's values, each a known arch (else a usage error naming it), or every arch."""
    unknown = [a for a in arch or [] if a not in arch_names()]
    if unknown:
        raise typer.BadParameter(
            f"{unknown[0]!r}; allowed: {', '.join(arch_names())}", param_hint="--arch"
        )
    return arch or arch_names()


def _tiling_inputs(
    specs: list[Path] | None, backward: bool, data: Path | None
) -> tuple[list[AttnSpec], Measurements, Path, Planner]:
    """verify-tiling's specs (default examples/*.yaml), measurements, their file and planner;
    what is wrong with them as the command's error."""
    from attngen.verify.backward import run_inputs

    paths = specs or sorted(Path("examples").glob("*.yaml"))
    if not paths:
        raise _fail("no spec files given and none in examples/")
    try:
        return run_inputs(paths, backward, data)
    except (SpecError, ValueError) as exc:
        raise _fail(str(exc)) from None


@app.command("capabilities")
def capabilities_command(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Write the Markdown here (docs/capabilities.md); default stdout."
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            help="Compiler measurements file for the compiled column; default the installed "
            "Triton's."
        ),
    ] = None,
) -> None:
    """The capability matrix: arch x dtype x head dim x mask -> config, or why none fits."""
    from attngen.cli.capabilities import capability_cells, render_capabilities
    from attngen.spec.files import write_if_different
    from attngen.verify.measurements import data_path, load_measurements, triton_version

    measurements = load_measurements(data or data_path(triton_version()))
    text = render_capabilities(capability_cells(), measurements)
    if out is None:
        typer.echo(text, nl=False)
    elif write_if_different(out, text):
        typer.echo(f"attngen: {out} written")
    else:
        typer.echo(f"attngen: {out} is up to date")


def main() -> None:  # pragma: no cover - console entry point
    app()
