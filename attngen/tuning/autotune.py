"""`attngen autotune`: time the tiler's feasible configs on this GPU and record the winners.

For each spec, the candidates are feasible configs of `derive_tiles` for the GPU's arch
(never one the model says cannot compile), at most `max_configs`, the heuristic's choice always
among them: the best-scoring config of each tile shape (BLOCK_M x BLOCK_N x warps), shapes in
the order of their best score, each followed by its 3-stage config when the best has fewer
(DEEP_STAGES). One per shape, because the score ranks stage counts within a shape well but not
shapes against each other on Hopper: on the H200, 64x64 tiles with 4 warps beat the predicted
128x128 with 8 warps by 5-17% on causal D = 128 (exp_prefill.py@163a2b7), a shape the first
four by score never reached.

Each candidate must first pass the correctness gate (`compare_to_reference` on fresh inputs,
Nq != Nk, lengths off the block grid), then is timed (median of `triton.testing.do_bench`,
after warm-up) on shape buckets of 16k tokens: N = 1024 (16 sequences), 4096 (4) and 8192
(2). The winner is the fastest on the longest bucket; a shorter bucket whose fastest config
beats it there by SWITCH_GAIN gets that config for its lengths (`shorter` in the entry; the
module picks by sequence length). Results go into tuning/<arch>.json
(attngen.tuning.database); every measurement is also kept in tuning/.progress-<arch>.json,
keyed by spec and by the kernel's text (a changed template is measured afresh), so an
interrupted run resumes where it stopped, and the budget bounds the whole run. The gradient
kernels of specs with `backward: true` are tuned after the prefill kernels (or alone:
`kernels="backward"`) by attngen/tuning/autotune_backward.py, under the same budget; the
Gluon forward's knobs of sm90 prefill modules after the tile-level forward (autotune_gluon.py).

This module imports torch and triton; the build path never imports it.
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time
from pathlib import Path

import torch
import triton
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from attngen.arch import ARCHS
from attngen.reference import compare_to_reference, random_inputs
from attngen.spec import AttnSpec, KernelKind, SpecError
from attngen.tiling.prefill import Candidate, TileConfig, derive_tiles
from attngen.tuning.autotune_backward import (
    DEFAULT_BACKWARD_OPTIONS,
    BackwardOptions,
    backward_candidates,
    tune_backward,
)
from attngen.tuning.autotune_gluon import gluon_candidates, tune_gluon
from attngen.tuning.database import entry_key, read_tuning_file, tuning_path
from attngen.tuning.measure import (
    Bucket,
    Outcome,
    TuneRun,
    config_key,
    entry_fields,
    geomean,
    kernel_digest,
    load_module,
    median_ms,
    outcome_of,
    read_progress,
)

# Note: a shape whose best score has fewer stages is also tried at this many. Measured on the
# H200 with TMA, three stages beat two in every shape tried (128x64x4 at D = 64: 272 against
# 240 TFLOP/s; 64x64x4 at D = 128 causal: the fastest config at three, where the score,
# counting two programs per SM at two stages against one at three, prefers two).
DEEP_STAGES = 3
BUCKETS = (
    Bucket("short_n1024", 16, 1024),
    Bucket("mid_n4096", 4, 4096),
    Bucket("long_n8192", 2, 8192),
)
# A shorter bucket gets its own config only when it is at least this much faster there than
# the long bucket's winner: the same config timed in two H200 runs differed by 1-2%.
SWITCH_GAIN = 0.03


def detect_arch() -> str:
    if not torch.cuda.is_available():
        raise SpecError("autotune: no CUDA GPU here; autotune measures on the GPU it runs on")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm{major}{minor}"
    if arch not in ARCHS:
        raise SpecError(
            f"autotune: this GPU is {arch}; attngen knows {', '.join(ARCHS)} "
            "(a new arch is a row in attngen/arch.py)"
        )
    return arch


# Which kernels `--kernels` tunes: "backward" are the gradient kernels of specs with
# `backward: true` (attngen/tuning/autotune_backward.py).
KERNEL_SETS = ("all", "forward", "backward")


def _candidates(spec: AttnSpec, arch: str, max_configs: int) -> tuple[TileConfig, list[Candidate]]:
    derivation = derive_tiles(spec, arch)
    chosen = derivation.chosen_candidate
    if chosen is None:
        raise SpecError(f"{spec.name}: no feasible config on {arch} to tune")
    feasible = sorted(
        (c for c in derivation.candidates if c.feasible),
        key=lambda c: (-c.score, c.smem_bytes, c.config),
    )
    by_shape: dict[tuple[int, int, int], list[Candidate]] = {}
    for cand in feasible:  # best score first within each shape too
        by_shape.setdefault(
            (cand.config.block_m, cand.config.block_n, cand.config.num_warps), []
        ).append(cand)
    picked: list[Candidate] = []
    for same_shape in by_shape.values():
        picked.append(same_shape[0])
        if same_shape[0].config.num_stages < DEEP_STAGES:
            picked += [c for c in same_shape if c.config.num_stages == DEEP_STAGES]
    picked = picked[:max_configs]
    if chosen.config not in [c.config for c in picked]:
        picked[-1:] = [chosen]
    return chosen.config, picked


def _measure(module, spec: AttnSpec, config: TileConfig, inputs, device, timer) -> dict:
    """Gate, then time one config; failures are results too (recorded, never fatal)."""
    module.CONFIG.update(config.as_dict())
    try:
        q, k, v, slopes = random_inputs(spec, 1, 200, 333, seed=7, device=device)
        out, lse = module.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
        problems = compare_to_reference(spec, out, lse, q, k, v, alibi_slopes=slopes)
        if problems:
            return {"error": "incorrect: " + "; ".join(problems)[:300]}
        times = {}
        for bucket, args in inputs.items():
            times[bucket] = timer(
                lambda args=args: module.attention(*args[:3], alibi_slopes=args[3])
            )
        return {"median_ms": times}
    except Exception as exc:  # a config that fails to compile or launch is a result
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        if device == "cuda":
            torch.cuda.synchronize()


def autotune(
    specs: list[AttnSpec],
    tuning_dir: Path,
    budget_s: float,
    max_configs: int,
    arch: str | None = None,
    console: Console | None = None,
    *,
    device: str = "cuda",
    buckets: tuple[Bucket, ...] = BUCKETS,
    timer=median_ms,
    kernels: str = "all",
    backward: BackwardOptions = DEFAULT_BACKWARD_OPTIONS,
) -> list[Outcome]:
    """Tune every spec's prefill kernel (`kernels` "all" or "forward") and the gradient kernels
    of specs with `backward: true` ("all" or "backward"; `backward` bounds and shapes them);
    `device`, `buckets`, `timer` and `backward` let the CPU tests drive the same loops under
    Triton's interpreter."""
    if kernels not in KERNEL_SETS:
        raise SpecError(f"kernels: {kernels!r}; expected one of {', '.join(KERNEL_SETS)}")
    trained = [spec for spec in specs if spec.backward] if kernels != "forward" else []
    if kernels == "backward" and not trained:
        raise SpecError("kernels: 'backward', but none of the specs has backward: true")
    console = console or Console(stderr=True)
    arch = arch or detect_arch()
    run = _tune_run(tuning_dir, arch, device, timer, budget_s)
    gpu = run.gpu
    forward = [] if kernels == "backward" else specs
    plans = [(spec, *_candidates(spec, arch, max_configs)) for spec in forward]
    gluon_plans = [(s, c) for s in forward if (c := gluon_candidates(s, arch, max_configs))]
    backward_plans = [
        (spec, backward_candidates(spec, arch, backward.max_configs)) for spec in trained
    ]
    lists = [c for *_, c in plans + gluon_plans] + [
        c for _, kernel_plans in backward_plans for _, c in kernel_plans.values()
    ]
    outcomes = []
    with Progress(console=console, transient=False) as bar:
        task = bar.add_task(f"autotune on {gpu} ({arch})", total=sum(map(len, lists)))
        for spec, heuristic, cands in plans:
            outcomes.append(
                _tune_forward(run, spec, heuristic, cands, buckets, lambda: bar.advance(task))
            )
        for spec, found in gluon_plans:
            outcomes.append(tune_gluon(run, spec, found, buckets, lambda: bar.advance(task)))
        for spec, kernel_plans in backward_plans:
            outcomes += tune_backward(run, spec, kernel_plans, backward, lambda: bar.advance(task))
    _print_summary(console, outcomes, arch, gpu, buckets, backward.buckets)
    return outcomes


def _tune_run(tuning_dir: Path, arch: str, device: str, timer, budget_s: float) -> TuneRun:
    """The run's shared state: the GPU, its tuning file and progress file, the deadline."""
    gpu = torch.cuda.get_device_name() if device == "cuda" else f"{device} (interpreter)"
    version = triton.__version__
    deadline = time.monotonic() + budget_s
    tuning, progress = tuning_path(tuning_dir, arch), tuning_dir / f".progress-{arch}.json"
    files = (read_tuning_file(tuning), tuning, read_progress(progress, gpu, version), progress)
    scratch = Path(tempfile.mkdtemp(prefix="attngen-autotune-"))
    return TuneRun(arch, gpu, version, device, timer, deadline, *files, scratch)


def _tune_forward(
    run: TuneRun,
    spec: AttnSpec,
    heuristic: TileConfig,
    cands: list[Candidate],
    buckets: tuple[Bucket, ...],
    advance,
) -> Outcome:
    module = load_module(spec, run.arch, run.folder)
    inputs = {
        b.name: random_inputs(spec, b.batch, b.seqlen, b.seqlen, seed=1, device=run.device)
        for b in buckets
    }
    results = run.results(f"{entry_key(spec, KernelKind.prefill)}/{kernel_digest(module)}")
    for cand in cands:
        key = config_key(cand.config)
        if key not in results:
            if run.out_of_time():
                break
            results[key] = _measure(module, spec, cand.config, inputs, run.device, run.timer)
            run.save_progress()
        advance()
    del inputs
    outcome = _record(run, spec, heuristic, cands, results, buckets)
    run.save_db()
    return outcome


def _record(run: TuneRun, spec, heuristic, cands, results, buckets) -> Outcome:
    by_key = {config_key(c.config): c for c in cands}
    outcome, usable = outcome_of(spec, heuristic, by_key, results, buckets, "prefill")
    if not usable:
        return outcome
    best, shorter = per_length_winners(usable, buckets)
    outcome.winner, outcome.winner_ms = by_key[best].config, usable[best]
    outcome.shorter = tuple((up_to, by_key[key].config) for up_to, key in shorter)
    # The model's programs per SM for each winner, as measured: a later template that makes a
    # winner lose one (a few bytes of shared memory can, at an occupancy edge) makes the build
    # refuse the entry instead of using a config whose timing no longer holds.
    heads = [spec.num_q_heads, spec.num_kv_heads]
    gluon = run.db["entries"].get(entry_key(spec, KernelKind.prefill), {}).get("gluon")
    run.db["entries"][entry_key(spec, KernelKind.prefill)] = {
        **({"gluon": gluon} if gluon else {}),  # the Gluon forward's (autotune_gluon.py)
        **entry_fields(run, outcome, results),
        "shorter": [
            {
                "up_to": up_to,
                "config": by_key[key].config.as_dict(),
                "programs_per_sm": by_key[key].programs_per_sm,
            }
            for up_to, key in shorter
        ],  # fmt: skip
        "spec_name": spec.name,
        "config": by_key[best].config.as_dict(),
        "programs_per_sm": by_key[best].programs_per_sm,
        "buckets": {
            b.name: {"batch": b.batch, "seqlen": b.seqlen, "heads": heads} for b in buckets
        },
    }
    return outcome


def per_length_winners(
    times: dict[str, dict[str, float]], buckets: tuple[Bucket, ...]
) -> tuple[str, list[tuple[int, str]]]:
    """The config for long sequences (fastest in the longest bucket) and, ascending, the
    (longest sequence, config) pairs of shorter buckets whose fastest config beats it there by
    SWITCH_GAIN or more. A bucket's config serves up to the power of two at or below the
    geometric mean of its length and the next bucket's; equal neighbours merge."""
    ordered = sorted(buckets, key=lambda b: b.seqlen)
    longest = ordered[-1].name
    default = _fastest(times, longest)
    shorter: list[tuple[int, str]] = []
    for bucket, following in itertools.pairwise(ordered):
        fastest = _fastest(times, bucket.name)
        if times[fastest][bucket.name] > (1 - SWITCH_GAIN) * times[default][bucket.name]:
            continue
        up_to = 2 ** int(math.log2(math.sqrt(bucket.seqlen * following.seqlen)))
        if shorter and shorter[-1][1] == fastest:
            shorter[-1] = (up_to, fastest)
        else:
            shorter.append((up_to, fastest))
    return default, shorter


def _fastest(times: dict[str, dict[str, float]], bucket: str) -> str:
    """The config fastest in `bucket` (ties: the first key in order)."""
    return min(times, key=lambda key: (times[key][bucket], key))


def _print_summary(
    console: Console,
    outcomes: list[Outcome],
    arch: str,
    gpu: str,
    buckets: tuple[Bucket, ...],
    backward_buckets: tuple[Bucket, ...],
) -> None:
    """One table for the prefill kernels and one for the gradient kernels (their own buckets:
    the time of that kernel's launch alone)."""
    tables = (("prefill", buckets), ("gluon", buckets), ("backward", backward_buckets))
    for kernels, kind_buckets in tables:
        rows = [o for o in outcomes if o.kernel.startswith(kernels)]
        if not rows:
            continue
        table = Table(title=f"attngen autotune: {gpu} ({arch}), {kernels} kernels")
        for column in (
            "spec",
            "heuristic",
            "winner",
            "tried",
            *[b.name + " ms" for b in kind_buckets],
            "vs heuristic",
        ):
            table.add_column(column)
        for o in rows:
            gain = "-"
            if o.winner_ms and o.heuristic_ms:
                gain = f"{geomean(o.heuristic_ms) / geomean(o.winner_ms):.2f}x"
            winner = config_key(o.winner) if o.winner else "none passed"
            winner += "".join(f"; <={up_to}: {config_key(c)}" for up_to, c in o.shorter)
            name = o.spec.name if o.kernel == "prefill" else f"{o.spec.name} ({o.kernel})"
            table.add_row(
                name,
                config_key(o.heuristic),
                winner,
                f"{o.tried}/{o.candidates}" + ("" if o.complete else " (budget)"),
                *[
                    f"{o.winner_ms[b.name]:.3f}" if b.name in o.winner_ms else "-"
                    for b in kind_buckets
                ],
                gain,
            )
        console.print(table)
