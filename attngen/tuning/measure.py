"""What the forward and the backward autotune loops share: shape buckets, the run's state
(database, progress file, budget), the module under measurement and the timer.

This module imports torch and triton; the build path never imports it.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton

from attngen.render import kernels_text, render_module
from attngen.spec import AttnSpec, KernelKind, module_name
from attngen.spec.files import write_if_different
from attngen.tiling.gluon import GluonConfig, GluonDerivation
from attngen.tiling.prefill import TileConfig, derive_tiles
from attngen.tuning.database import render_tuning_file

PROGRESS_SCHEMA = 2  # 2: results keyed by spec and kernel text


@dataclass(frozen=True)
class Bucket:
    name: str
    batch: int
    seqlen: int


@dataclass
class Outcome:
    spec: AttnSpec
    heuristic: TileConfig | GluonConfig  # a Gluon config for kernel "gluon"
    winner: TileConfig | GluonConfig | None
    winner_ms: dict[str, float]
    heuristic_ms: dict[str, float] | None
    tried: int
    candidates: int
    complete: bool
    shorter: tuple[tuple[int, TileConfig], ...] = ()
    kernel: str = "prefill"  # or "backward_dq", "backward_dkdv", "gluon"


@dataclass
class TuneRun:
    """The state every measurement of one `attngen autotune` run shares: the tuning file being
    filled, the progress file (every measurement, so that a run resumes), the deadline, the
    device and the timer (the CPU tests drive the loops under Triton's interpreter with a fake
    timer)."""

    arch: str
    gpu: str
    triton: str
    device: str
    timer: Callable[[Callable[[], Any]], float]
    deadline: float
    db: dict[str, Any]
    db_path: Path
    progress: dict[str, Any]
    progress_path: Path
    folder: Path  # where the modules under measurement are written (the JIT needs files)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def results(self, key: str) -> dict[str, Any]:
        """The measurements kept under `key` (spec, kernel kind and kernel text)."""
        results: dict[str, Any] = self.progress["results"].setdefault(key, {})
        return results

    def save_progress(self) -> None:
        write_if_different(self.progress_path, render_tuning_file(self.progress))

    def save_db(self) -> None:
        write_if_different(self.db_path, render_tuning_file(self.db))


def load_module(spec: AttnSpec, arch: str, folder: Path, gluon: GluonDerivation | None = None):
    """The spec's prefill module as the heuristic derives it (a backward spec's carries the
    gradient kernels), written to `folder` and imported; configs are set on it per candidate.
    `gluon`: its Gluon forward rendered with that derivation's choice (a module of its own)."""
    source = render_module(spec, KernelKind.prefill, derive_tiles(spec, arch), gluon=gluon)
    name = f"autotune_{module_name(spec, KernelKind.prefill)}"
    if gluon is not None and gluon.chosen is not None:
        name += "_gluon_" + config_key(gluon.chosen.config)
    path = folder / f"{name}.py"
    path.write_text(source)
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None  # a .py file has one
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    loader_spec.loader.exec_module(module)
    return module


def kernel_digest(module) -> str:
    """A hash of the module's JIT functions (the backward's too): the text a template change
    alters."""
    return hashlib.sha256(kernels_text(Path(module.__file__).read_text()).encode()).hexdigest()[:16]


def config_key(config: TileConfig | GluonConfig) -> str:
    """A tile config's BLOCK_M x BLOCK_N x warps x stages; a Gluon config's consumers first."""
    if isinstance(config, GluonConfig):
        return f"{config.consumers}x{config.block_m}x{config.block_n}x{config.stages}"
    return f"{config.block_m}x{config.block_n}x{config.num_warps}x{config.num_stages}"


def median_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def geomean(times: dict[str, float]) -> float:
    return math.exp(sum(math.log(t) for t in times.values()) / len(times))


def read_progress(path: Path, gpu: str, version: str) -> dict:
    """Earlier measurements on the same GPU and Triton, or a fresh record."""
    fresh = {"schema": PROGRESS_SCHEMA, "gpu": gpu, "triton": version, "results": {}}
    if not path.is_file():
        return fresh
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return fresh
    same = (data.get("schema"), data.get("gpu"), data.get("triton")) == (
        PROGRESS_SCHEMA,
        gpu,
        version,
    )
    return data if same and isinstance(data.get("results"), dict) else fresh


def outcome_of(spec: AttnSpec, heuristic, configs: dict[str, Any], results, buckets, kernel: str):
    """(the Outcome of measuring `configs` {config_key: config}, winner unset; the timings
    {config_key: {bucket: ms}} of the configs timed on every bucket)."""
    timed = {key: r["median_ms"] for key, r in results.items() if "median_ms" in r}
    tried = sum(1 for key in configs if key in results)
    outcome = Outcome(spec, heuristic, None, {}, timed.get(config_key(heuristic)), tried,
                      len(configs), tried == len(configs), kernel=kernel)  # fmt: skip
    usable = {
        key: t for key, t in timed.items() if key in configs and all(b.name in t for b in buckets)
    }
    return outcome, usable


def fastest_overall(usable: dict[str, dict[str, float]], buckets: tuple[Bucket, ...]) -> str:
    """The config of the least geometric mean over the buckets (ties: the first key)."""
    return min(usable, key=lambda k: (geomean({b.name: usable[k][b.name] for b in buckets}), k))


def entry_fields(run: TuneRun, outcome: Outcome, results: dict[str, Any]) -> dict[str, Any]:
    """What every tuning entry records of its measurement (the file sorts the keys)."""
    return {
        "gpu": run.gpu,
        "triton": run.triton,
        "date": datetime.date.today().isoformat(),
        "complete": outcome.complete,
        "median_ms": outcome.winner_ms,
        "candidates": {key: results[key] for key in sorted(results)},
    }
