"""The tuning database and the autotune loop (driven on the CPU interpreter with a fake timer)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from attngen.build import plan_build
from attngen.cli.explain import explain_lines
from attngen.spec import KernelKind
from attngen.tiling.prefill import TileConfig, derive_tiles
from attngen.tuning.autotune import Bucket, autotune
from attngen.tuning.database import TUNING_SCHEMA, TuningError, entry_key, lookup, read_tuning_file
from tests.kernel_harness import make_spec

SPEC = make_spec(dtype="fp16", head_dim=64, archs=["sm90"], name="tuned")
TINY = (Bucket("tiny", 1, 40),)


def _fake_timer(fn) -> float:
    """Wall time of one call: enough to rank configs; CUDA events need a GPU."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _write_entry(folder: Path, config: TileConfig, spec=SPEC) -> None:
    folder.mkdir(exist_ok=True)
    entry = {
        "config": config.as_dict(),
        "gpu": "NVIDIA H200",
        "triton": "3.6.0",
        "date": "2026-11-30",
        "complete": True,
        "median_ms": {"tiny": 1.0},
    }
    data = {
        "schema": TUNING_SCHEMA,
        "arch": "sm90",
        "entries": {entry_key(spec, KernelKind.prefill): entry},
    }
    (folder / "sm90.json").write_text(json.dumps(data))


def test_build_uses_a_tuned_config_and_says_so(tmp_path):
    heuristic = derive_tiles(SPEC, "sm90").chosen
    tuned = next(
        c.config
        for c in derive_tiles(SPEC, "sm90").candidates
        if c.feasible and c.config != heuristic
    )
    _write_entry(tmp_path, tuned)
    (artifact,) = plan_build([SPEC], tmp_path)
    assert f"BLOCK_M={tuned.block_m}, BLOCK_N={tuned.block_n}" in artifact.source
    assert "Config source: tuning on NVIDIA H200, triton 3.6.0, 2026-11-30." in artifact.source
    assert artifact.entry["config"] == tuned.as_dict()
    assert artifact.entry["config_source"].startswith("tuning on NVIDIA H200")
    text = "\n".join(explain_lines([SPEC], ["sm90"], tmp_path))
    assert f"BLOCK_M={tuned.block_m} BLOCK_N={tuned.block_n}" in text and "tuning on" in text
    # Without the database the heuristic stands.
    (plain,) = plan_build([SPEC])
    assert "Config source: heuristic." in plain.source


def test_an_infeasible_tuned_config_is_refused_not_used(tmp_path):
    infeasible = next(c.config for c in derive_tiles(SPEC, "sm90").candidates if not c.feasible)
    _write_entry(tmp_path, infeasible)
    with pytest.raises(TuningError, match="infeasible under the current model"):
        plan_build([SPEC], tmp_path)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"schema": 99, "arch": "sm90", "entries": {}}', "schema 99"),
        ("not json", "not JSON"),
        ('{"schema": 2, "arch": "sm80", "entries": {}}', "expected arch 'sm90'"),
    ],
)
def test_unreadable_tuning_files_are_refused(tmp_path, text, message):
    (tmp_path / "sm90.json").write_text(text)
    with pytest.raises(TuningError, match=message):
        lookup(tmp_path, SPEC, KernelKind.prefill, "sm90")


def test_autotune_loop_records_a_winner_and_resumes(tmp_path, monkeypatch):
    console = Console(file=open(tmp_path / "log.txt", "w"), width=200)
    outcomes = autotune(
        [SPEC],
        tmp_path,
        budget_s=120,
        max_configs=3,
        arch="sm90",
        console=console,
        device="cpu",
        buckets=TINY,
        timer=_fake_timer,
    )
    outcome, gluon = outcomes  # the tile-level forward, then the sm90 Gluon forward's knobs
    assert outcome.winner is not None and outcome.tried == 3 and outcome.complete
    assert gluon.kernel == "gluon" and gluon.winner is None  # the interpreter runs no Gluon
    db = read_tuning_file(tmp_path / "sm90.json")
    entry = db["entries"][entry_key(SPEC, KernelKind.prefill)]
    assert entry["config"] == outcome.winner.as_dict() and len(entry["candidates"]) == 3
    assert all("median_ms" in result for result in entry["candidates"].values())
    winner = next(c for c in derive_tiles(SPEC, "sm90").candidates if c.config == outcome.winner)
    assert entry["programs_per_sm"] == winner.programs_per_sm  # the occupancy it ran at
    # The heuristic's choice is always among the candidates.
    assert (
        "x".join(map(str, derive_tiles(SPEC, "sm90").chosen.as_dict().values()))
        in entry["candidates"]
    )
    # A second run finds every measurement in the progress file and measures nothing.
    calls = []
    again = autotune(
        [SPEC],
        tmp_path,
        budget_s=120,
        max_configs=3,
        arch="sm90",
        console=console,
        device="cpu",
        buckets=TINY,
        timer=lambda fn: calls.append(fn) or 1.0,
    )
    assert calls == [] and again[0].winner == outcome.winner
    # And the build picks the winner up.
    (artifact,) = plan_build([SPEC], tmp_path)
    assert f"BLOCK_M={outcome.winner.block_m}, BLOCK_N={outcome.winner.block_n}" in artifact.source
    # Measurements belong to the kernel text they were taken on: after a template change (a
    # different digest) every candidate is measured again.
    monkeypatch.setattr("attngen.tuning.autotune.kernel_digest", lambda module: "changed-kernel")
    calls = []
    autotune(
        [SPEC],
        tmp_path,
        budget_s=120,
        max_configs=3,
        arch="sm90",
        console=console,
        device="cpu",
        buckets=TINY,
        timer=lambda fn: calls.append(fn) or 1.0,
    )
    assert len(calls) == 3 * len(TINY)


def test_autotune_budget_stops_early_and_marks_the_search_partial(tmp_path):
    console = Console(file=open(tmp_path / "log.txt", "w"), width=200)
    outcome, gluon = autotune(
        [SPEC],
        tmp_path,
        budget_s=0.0,
        max_configs=3,
        arch="sm90",
        console=console,
        device="cpu",
        buckets=TINY,
        timer=_fake_timer,
    )
    for kernel in (outcome, gluon):
        assert kernel.tried == 0 and not kernel.complete and kernel.winner is None


def test_entry_key_ignores_fields_that_do_not_change_the_kernel():
    renamed = make_spec(dtype="fp16", head_dim=64, archs=["sm80", "sm90"], name="other")
    assert entry_key(renamed, KernelKind.prefill) == entry_key(SPEC, KernelKind.prefill)
    wider = make_spec(dtype="fp16", head_dim=128, archs=["sm90"], name="tuned")
    assert entry_key(wider, KernelKind.prefill) != entry_key(SPEC, KernelKind.prefill)


def test_autotune_candidates_cover_tile_shapes_best_scoring_first():
    from attngen.tuning.autotune import DEEP_STAGES, _candidates

    heuristic, picked = _candidates(SPEC, "sm90", 8)
    assert len(picked) == 8 and len(set(picked)) == 8
    assert heuristic in [c.config for c in picked]
    feasible = [c for c in derive_tiles(SPEC, "sm90").candidates if c.feasible]

    def shape(c):
        return (c.config.block_m, c.config.block_n, c.config.num_warps)

    for cand in picked:  # each the shape's best, or that shape's DEEP_STAGES config
        best = max(c.score for c in feasible if shape(c) == shape(cand))
        assert cand.score == best or cand.config.num_stages == DEEP_STAGES
    # Beyond the first four shapes by score, so smaller tiles with 4 warps get measured too.
    assert any(c.config.num_warps == 4 and c.config.block_m == 64 for c in picked)


def test_per_length_winners_switch_only_on_a_clear_gain_and_merge_neighbours():
    from attngen.tuning.autotune import BUCKETS, SWITCH_GAIN, per_length_winners

    short, mid, long = (b.name for b in BUCKETS)
    times = {
        "big": {short: 1.00, mid: 1.00, long: 1.00},
        "small": {short: 0.90, mid: 1.05, long: 1.20},
        "close": {short: 0.99, mid: 1 - SWITCH_GAIN / 2, long: 1.10},
    }
    assert per_length_winners(times, BUCKETS) == ("big", [(2048, "small")])
    times["small"][mid] = 0.95  # now also clearly faster at N = 4096: one range to 4096
    assert per_length_winners(times, BUCKETS) == ("big", [(4096, "small")])
    times["small"][short] = 0.99  # within the noise at N = 1024: only N = 4096 switches
    assert per_length_winners(times, BUCKETS) == ("big", [(4096, "small")])
    times["small"][mid] = 0.99
    times["close"][long] = 0.98  # the longest bucket's fastest is the default
    assert per_length_winners(times, BUCKETS) == ("close", [])
    del times["small"], times["close"]
    assert per_length_winners(times, BUCKETS) == ("big", [])


def test_shorter_configs_reach_the_module_which_picks_by_length(tmp_path):
    from tests.kernel_harness import assert_matches_reference, make_inputs

    spec = make_spec(
        dtype="fp16",
        head_dim=64,
        archs=["sm90"],
        name="tuned",
        kernels=["prefill", "varlen"],
        mask="causal",
        causal_align="bottom_right",
    )
    long_config, short_config = TileConfig(32, 32, 4, 2), TileConfig(16, 16, 4, 2)
    folder = tmp_path / "tuning"
    folder.mkdir()
    entry = {
        "config": long_config.as_dict(),
        "gpu": "NVIDIA H200",
        "triton": "3.6.0",
        "date": "2026-11-30",
        "complete": True,
        "median_ms": {"tiny": 1.0},
        "shorter": [{"up_to": 40, "config": short_config.as_dict()}],
    }
    (folder / "sm90.json").write_text(
        json.dumps(
            {
                "schema": TUNING_SCHEMA,
                "arch": "sm90",
                "entries": {entry_key(spec, KernelKind.prefill): entry},
            }
        )
    )
    artifacts = {a.entry["kind"]: a for a in plan_build([spec], folder)}
    prefill = artifacts["prefill"]
    assert 'CONFIGS_BY_SEQLEN = [\n    (40, {"BLOCK_M": 16, "BLOCK_N": 16' in prefill.source
    assert "sequences up to 40: 16x16, 4 warps, 2 stages" in prefill.source  # the header
    assert "config_for" in artifacts["varlen"].source  # varlen borrows prefill's entry
    text = "\n".join(explain_lines([spec], ["sm90"], folder))
    assert "for sequences up to 40: BLOCK_M=16 BLOCK_N=16" in text
    path = tmp_path / "tuned_prefill.py"
    path.write_text(prefill.source)
    import importlib.util

    loader = importlib.util.spec_from_file_location("tuned_prefill_by_length", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    assert module.config_for(40) == short_config.as_dict()
    assert module.config_for(41) == module.CONFIG == long_config.as_dict()
    for seqlen_q, seqlen_k in ((37, 40), (23, 57)):  # either side of the boundary
        q, k, v, _ = make_inputs(spec, 1, seqlen_q, seqlen_k, seed=3)
        out, lse = module.attention(q, k, v, return_lse=True)
        assert_matches_reference(spec, out, lse, q, k, v)
    # A shorter config the model calls infeasible is refused like the main one.
    infeasible = next(c.config for c in derive_tiles(spec, "sm90").candidates if not c.feasible)
    entry["shorter"][0]["config"] = infeasible.as_dict()
    (folder / "sm90.json").write_text(
        json.dumps(
            {
                "schema": TUNING_SCHEMA,
                "arch": "sm90",
                "entries": {entry_key(spec, KernelKind.prefill): entry},
            }
        )
    )
    with pytest.raises(TuningError, match="infeasible under the current model"):
        plan_build([spec], folder)


def test_a_tuned_config_that_lost_programs_per_sm_is_refused(tmp_path):
    cand = next(c for c in derive_tiles(SPEC, "sm90").candidates if c.feasible)
    entry = {
        "config": cand.config.as_dict(),
        "gpu": "NVIDIA H200",
        "triton": "3.6.0",
        "date": "2026-11-30",
        "complete": True,
        "median_ms": {"tiny": 1.0},
        "programs_per_sm": cand.programs_per_sm,
    }
    tmp_path.joinpath("sm90.json").write_text(
        json.dumps(
            {
                "schema": TUNING_SCHEMA,
                "arch": "sm90",
                "entries": {entry_key(SPEC, KernelKind.prefill): entry},
            }
        )
    )
    (artifact,) = plan_build([SPEC], tmp_path)  # as measured: used
    assert artifact.entry["config"] == cand.config.as_dict()
    entry["programs_per_sm"] = cand.programs_per_sm + 1  # measured with more than fits now
    tmp_path.joinpath("sm90.json").write_text(
        json.dumps(
            {
                "schema": TUNING_SCHEMA,
                "arch": "sm90",
                "entries": {entry_key(SPEC, KernelKind.prefill): entry},
            }
        )
    )
    with pytest.raises(TuningError, match="programs per SM.*re-run attngen autotune"):
        plan_build([SPEC], tmp_path)
