"""Tuning the gradient kernels: backward_dq / backward_dkdv (and a split module's backward_dv /
backward_dk) entries in the database, the build and explain taking them, and the autotune
loop's candidates, gate and per-kernel timing (driven on the CPU interpreter with a fake
timer)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from rich.console import Console

from attngen.arch import ARCHS
from attngen.build import plan_build
from attngen.cli.explain import explain_lines
from attngen.spec import KernelKind, module_name
from attngen.tiling.backward import derive_backward_tiles
from attngen.tiling.prefill import derive_tiles
from attngen.tuning.autotune import BackwardOptions, Bucket, autotune
from attngen.tuning.autotune_backward import backward_candidates
from attngen.tuning.database import (
    TUNING_SCHEMA,
    TuningError,
    backward_entry_key,
    entry_key,
    read_tuning_file,
)
from tests.kernel_harness import make_spec

SPEC = make_spec(dtype="fp16", head_dim=64, archs=["sm90"], name="trained", backward=True)
TINY = BackwardOptions(max_configs=2, buckets=(Bucket("tiny", 1, 40),), gate_shape=(1, 21, 37))
H200 = {
    "gpu": "NVIDIA H200",
    "triton": "3.6.0",
    "date": "2026-11-30",
    "complete": True,
    "median_ms": {"train_n4096": 1.0},
}


def _other_feasible(kernel: str):
    derivation = getattr(derive_backward_tiles(SPEC, "sm90"), kernel)
    return next(c for c in derivation.candidates if c.feasible and c.config != derivation.chosen)


def _write(folder, entries: dict) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "sm90.json").write_text(
        json.dumps({"schema": TUNING_SCHEMA, "arch": "sm90", "entries": entries})
    )


def _import(source: str, path):
    path.write_text(source)
    loader = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_a_tuned_dkdv_entry_reaches_the_module_and_explain(tmp_path):
    tuned = _other_feasible("dkdv")
    _write(
        tmp_path / "tuning",
        {
            backward_entry_key(SPEC, "dkdv"): {
                **H200,
                "config": tuned.config.as_dict(),
                "programs_per_sm": tuned.programs_per_sm,
            }
        },
    )
    (artifact,) = plan_build([SPEC], tmp_path / "tuning")
    module = _import(artifact.source, tmp_path / "tuned_bwd.py")
    heuristic = derive_backward_tiles(SPEC, "sm90")
    assert module.BWD_DKDV_CONFIG == tuned.config.as_dict()
    assert module.BWD_DQ_CONFIG == heuristic.dq.chosen.as_dict()  # no dq entry: heuristic
    source = "source: tuning on NVIDIA H200, triton 3.6.0, 2026-11-30"
    assert f"dK/dV kernel: {tuned.config.block_m}x{tuned.config.block_n}" in artifact.source
    assert source in artifact.source
    text = "\n".join(explain_lines([SPEC], ["sm90"], tmp_path / "tuning"))
    lines = [line.strip() for line in text.splitlines()]
    head = (
        f"dK/dV kernel: {tuned.config.block_m}x{tuned.config.block_n}, "
        f"{tuned.config.num_warps} warps, {tuned.config.num_stages} stages"
    )
    assert lines[lines.index(head) + 1] == f"({source})"
    assert "dQ kernel: " in text and text.count(source) == 1


def test_without_backward_entries_the_module_is_unchanged(tmp_path):
    _write(tmp_path, {})
    plain = plan_build([SPEC])[0].source
    assert plan_build([SPEC], tmp_path)[0].source == plain
    # A forward entry changes CONFIG, never the gradient kernels' configs or lines.
    forward = next(
        c.config
        for c in derive_tiles(SPEC, "sm90").candidates
        if c.feasible and c.config != derive_tiles(SPEC, "sm90").chosen
    )
    _write(tmp_path, {entry_key(SPEC, KernelKind.prefill): {**H200, "config": forward.as_dict()}})
    tuned = plan_build([SPEC], tmp_path)[0].source

    def backward_lines(source):
        return [
            line
            for line in source.splitlines()
            if line.startswith("BWD_")
            or line.lstrip("# ").startswith(("dQ kernel", "dK/dV kernel"))
        ]

    assert tuned != plain and backward_lines(tuned) == backward_lines(plain)
    assert len(backward_lines(plain)) == 6  # with BWD_DKDV_SPLIT and BWD_DKDV_ATOMIC_CONFIG


def test_backward_entry_keys_name_the_kernel():
    keys = {backward_entry_key(SPEC, kernel) for kernel in ("dq", "dkdv", "dv", "dk")}
    assert {key.split("/")[1] for key in keys} == {
        "backward_dq",
        "backward_dkdv",
        "backward_dv",
        "backward_dk",
    }
    assert {key.split("/")[0] for key in keys} == {
        entry_key(SPEC, KernelKind.prefill).split("/")[0]
    }
    with pytest.raises(ValueError, match="kernel: 'dkv'"):
        backward_entry_key(SPEC, "dkv")


@pytest.mark.parametrize(
    "change, message",
    [
        ("infeasible", "infeasible under the current model"),
        ("shorter", "one config for every length"),
        ("occupancy", "programs per SM"),
        ("malformed", "malformed"),
    ],
)
def test_unusable_backward_entries_are_refused(tmp_path, change, message):
    derivation = derive_backward_tiles(SPEC, "sm90").dq
    cand = next(c for c in derivation.candidates if c.feasible)
    entry = {**H200, "config": cand.config.as_dict(), "programs_per_sm": cand.programs_per_sm}
    if change == "infeasible":
        entry["config"] = next(c for c in derivation.candidates if not c.feasible).config.as_dict()
    elif change == "shorter":
        entry["shorter"] = [{"up_to": 1024, "config": cand.config.as_dict()}]
    elif change == "occupancy":
        entry["programs_per_sm"] = cand.programs_per_sm + 1
    else:
        del entry["gpu"]
    _write(tmp_path, {backward_entry_key(SPEC, "dq"): entry})
    with pytest.raises(TuningError, match=message):
        plan_build([SPEC], tmp_path)


def test_backward_candidates_start_with_the_heuristic_and_stay_feasible():
    llama = make_spec(
        dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8, archs=["sm90"], backward=True
    )
    derivations = derive_backward_tiles(llama, "sm90")
    plans = backward_candidates(llama, "sm90", 6)
    for kernel in ("dq", "dkdv"):
        heuristic, cands = plans[kernel]
        assert heuristic == getattr(derivations, kernel).chosen == cands[0].config
        assert len(cands) == 6 and len({c.config for c in cands}) == 6
        assert all(c.feasible for c in cands)
    # dK/dV's best-scoring shape, 32x128 with 8 warps (128 owned keys), the fastest on the
    # H200 (tuning/sm90.json), is the heuristic's and is measured at both stage counts.
    dkdv = [c.config for c in plans["dkdv"][1]]
    assert {(32, 128, 8, 2), (32, 128, 8, 3)} <= {
        (c.block_m, c.block_n, c.num_warps, c.num_stages) for c in dkdv
    }
    # Configs the register model calls may spill are measured too (dQ 128x32 with 4 warps).
    assert any(c.may_spill(ARCHS["sm90"]) for c in plans["dq"][1])
    assert [c.config for c in backward_candidates(llama, "sm90", 1)["dkdv"][1]] == [
        derivations.dkdv.chosen
    ]


def _run(tmp_path, timer, **options):
    console = Console(file=open(tmp_path / "log.txt", "a"), width=200)
    return autotune(
        [SPEC],
        tmp_path,
        budget_s=options.pop("budget_s", 600),
        max_configs=2,
        arch="sm90",
        console=console,
        device="cpu",
        timer=timer,
        kernels="backward",
        backward=options.pop("backward", TINY),
    )


def _module():
    return sys.modules[f"autotune_{module_name(SPEC, KernelKind.prefill)}"]


def test_autotune_backward_gates_times_each_kernel_alone_and_resumes(tmp_path, monkeypatch):
    from attngen.tuning import autotune_backward

    plans = backward_candidates(SPEC, "sm90", 2)
    failing = plans["dkdv"][1][1].config  # not the heuristic's
    real_gate = autotune_backward._gate

    def gate(module, spec, shape, device):  # the second dK/dV config computes wrong gradients
        if module.BWD_DKDV_CONFIG == failing.as_dict():
            return ["dk: max error too large"]
        return real_gate(module, spec, shape, device)

    monkeypatch.setattr(autotune_backward, "_gate", gate)
    timed = []

    def timer(fn):
        """Times from the configs in force (the failing one would be fastest); the launch
        runs only the kernel it was recorded for, not through the module's launch code."""
        module = _module()
        kernels = {
            name: getattr(module, name) for name in autotune_backward.KERNEL_FUNCTIONS.values()
        }
        for name in kernels:
            monkeypatch.setattr(module, name, None)
        fn()
        for name, kernel in kernels.items():
            monkeypatch.setattr(module, name, kernel)
        timed.append((dict(module.BWD_DQ_CONFIG), dict(module.BWD_DKDV_CONFIG)))
        return (
            0.5
            if module.BWD_DKDV_CONFIG == failing.as_dict()
            else (1.0 if module.BWD_DQ_CONFIG == plans["dq"][0].as_dict() else 0.9)
        )

    outcomes = _run(tmp_path, timer)
    assert [o.kernel for o in outcomes] == ["backward_dq", "backward_dkdv"]
    dq, dkdv = outcomes
    assert dq.complete and dq.tried == 2 and dq.winner == plans["dq"][1][1].config  # 0.9 < 1.0
    assert dkdv.winner == plans["dkdv"][0] and dkdv.tried == 2  # the gate removed the other
    entries = read_tuning_file(tmp_path / "sm90.json")["entries"]
    assert set(entries) == {backward_entry_key(SPEC, k) for k in ("dq", "dkdv")}  # no forward
    dkdv_entry = entries[backward_entry_key(SPEC, "dkdv")]
    assert dkdv_entry["config"] == plans["dkdv"][0].as_dict()
    bad = dkdv_entry["candidates"]["x".join(map(str, failing.as_dict().values()))]
    assert bad == {"error": "incorrect: dk: max error too large"}
    # Timing one kernel keeps the other at the heuristic's config: three timed configs.
    assert len(timed) == 3
    assert all(dkdv_config == plans["dkdv"][0].as_dict() for _, dkdv_config in timed[:2])
    assert timed[2] == (plans["dq"][0].as_dict(), plans["dkdv"][0].as_dict())
    # The build takes both winners.
    module = _import(plan_build([SPEC], tmp_path)[0].source, tmp_path / "built.py")
    assert module.BWD_DQ_CONFIG == dq.winner.as_dict()
    # A second run finds every measurement in the progress file.
    calls = []
    again = _run(tmp_path, lambda fn: calls.append(fn) or 1.0)
    assert calls == [] and [o.winner for o in again] == [dq.winner, dkdv.winner]


def test_autotune_backward_budget_and_arguments(tmp_path):
    outcomes = _run(tmp_path, lambda fn: 1.0, budget_s=0.0)
    assert all(o.tried == 0 and not o.complete and o.winner is None for o in outcomes)
    with pytest.raises(Exception, match="kernels: 'sideways'"):
        autotune([SPEC], tmp_path, 1.0, 2, arch="sm90", device="cpu", kernels="sideways")
    with pytest.raises(Exception, match="none of the specs has backward"):
        autotune([make_spec()], tmp_path, 1.0, 2, arch="sm90", device="cpu", kernels="backward")


# D 256 in 16 bits on sm90: no fused dK/dV config reaches 64 keys, so the module splits.
SPLIT = make_spec(dtype="bf16", head_dim=256, archs=["sm90"], name="split", backward=True)


def test_a_split_module_renders_both_launches_and_autotune_times_each(tmp_path):
    from attngen.tuning import autotune_backward

    derivations = derive_backward_tiles(SPLIT, "sm90")
    assert derivations.split
    assert not derive_backward_tiles(SPLIT, "sm80").split  # mma.sync only: fused
    assert not derive_backward_tiles(SPEC, "sm90").split  # D 64: the fused kernel on wgmma
    (artifact,) = plan_build([SPLIT], None)
    module = _import(artifact.source, tmp_path / "split.py")
    assert module.BWD_DKDV_SPLIT == (
        derivations.dv.chosen.as_dict(),
        derivations.dk.chosen.as_dict(),
    )
    assert "dK/dV as two launches" in artifact.source and "#   dV launch: " in artifact.source
    plans = backward_candidates(SPLIT, "sm90", 1)
    assert list(plans) == ["dq", "dkdv", "dv", "dk"]
    timed = []

    def timer(fn):  # the launch the timer gets: the kernel's GRADS and its BLOCK_N
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__, strict=True))
        kwargs = cells["kwargs"].cell_contents
        timed.append((kwargs.get("GRADS"), kwargs["BLOCK_N"]))
        return 1.0

    outcomes = autotune(
        [SPLIT],
        tmp_path,
        budget_s=600,
        max_configs=1,
        arch="sm90",
        console=Console(file=open(tmp_path / "log.txt", "a"), width=200),
        device="cpu",
        timer=timer,
        kernels="backward",
        backward=BackwardOptions(
            max_configs=1, buckets=(Bucket("tiny", 1, 40),), gate_shape=(1, 21, 37)
        ),
    )
    assert [o.kernel for o in outcomes] == [f"backward_{k}" for k in ("dq", "dkdv", "dv", "dk")]
    assert all(o.winner is not None for o in outcomes), [o.__dict__ for o in outcomes]
    # dQ has no GRADS; the fused launch is timed as 3 at its own tile, then dV and dK alone.
    assert timed == [
        (None, derivations.dq.chosen.block_n),
        (3, derivations.dkdv.chosen.block_n),
        (1, derivations.dv.chosen.block_n),
        (2, derivations.dk.chosen.block_n),
    ]
    assert autotune_backward.GRADS_OF == {"dkdv": 3, "dv": 1, "dk": 2}
