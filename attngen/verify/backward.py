"""`attngen verify-tiling --backward`: the backward tiling model (attngen/tiling/backward.py)
against Triton's compiler, on every candidate of both gradient kernels.

A spec with `backward: true` has two kernels, dQ and dK/dV, each with its own candidate grid
(backward.BLOCK_CHOICES x NUM_WARPS_CHOICES x NUM_STAGES_CHOICES). A row is one
(arch, kernel, dtype, D, DV, dropout, config, aligned rows): what the kernels' shared memory
depends on (measurements.BackwardKey). Mask, window, softcap, ALiBi and head counts change
the score code and so registers a little, not the buffers (checked on sampled configs by
tests/test_verify_backward.py); a row is compiled from its heaviest spec, as the forward's.
The policy is the forward's (attngen.verify.check), the data file
data/backward_compile_triton-<version>.json.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from attngen.build import load_specs
from attngen.spec import AttnSpec
from attngen.tiling.backward import KERNELS, derive_backward_tiles
from attngen.verify.check import Plan, Planner, plan_rows
from attngen.verify.measurements import (
    BackwardKey,
    MeasurementKey,
    Measurements,
    backward_key,
    data_path,
    load_measurements,
    triton_version,
)


def backward_specs(specs: Iterable[AttnSpec]) -> list[AttnSpec]:
    """The specs that have backward kernels."""
    return [spec for spec in specs if spec.backward]


def plan_backward_rows(specs: Iterable[AttnSpec], archs: Sequence[str] | None) -> Plan:
    """Every candidate of both gradient kernels of every (spec with backward, arch),
    deduplicated on the BackwardKey. A chosen entry is named "<spec> <kernel>"."""
    plan = Plan({}, {}, [])
    for spec in backward_specs(specs):
        plan.specs[spec.name] = spec
        for arch in archs or spec.archs:
            derivation = derive_backward_tiles(spec, arch)
            for kernel in KERNELS:
                kernel_derivation = getattr(derivation, kernel)
                best = kernel_derivation.chosen
                key = None if best is None else backward_key(spec, arch, kernel, best)
                plan.chosen.append((f"{spec.name} {kernel}", arch, key))
                for cand in kernel_derivation.candidates:
                    plan.add(backward_key(spec, arch, kernel, cand.config), spec, cand)
    return plan


def run_inputs(
    paths: Sequence[Path], backward: bool, data: Path | None
) -> tuple[list[AttnSpec], Measurements, Path, Planner]:
    """What `verify-tiling` checks: the specs, the measurements (the file `data`, else the
    installed Triton's file of the direction), that file's path, and the planner (forward, or
    with `backward` the gradient kernels'). SpecError or ValueError say what is wrong, also
    when no spec has backward: true."""
    path = data or data_path(triton_version(), backward=backward)
    specs = list(load_specs(paths))
    measurements = load_measurements(path, BackwardKey if backward else MeasurementKey)
    if backward and not backward_specs(specs):
        raise ValueError("--backward: none of the specs has backward: true")
    return specs, measurements, path, plan_backward_rows if backward else plan_rows
