"""`attngen autotune` for the warp-specialized Gluon forward of sm90 prefill modules
(attngen/tiling/gluon.py): its knobs (consumer warpgroups x BLOCK_M x BLOCK_N x STAGES; the
register split follows from the consumers) over every feasible candidate of
`derive_gluon_tiles`, the derived choice first, at most `max_configs`.

Each candidate is rendered into the module as the build renders a tuned one (render_module with
that candidate chosen: the consumer count is kernel text, BLOCK_N and STAGES the launch's), then
gated and timed through the module's forward entry, `attention`:
- the gate: `compare_to_reference` on fresh inputs (Nq = 1000 != Nk = 1333, off the block
  grid, the spec's heads, the smallest batch whose launch passes the module's
  POINTER_LOADS_UP_TO, below which it runs the tile-level kernel);
- the timing: the median of `attention` (do_bench, after warm-up) on the tile-level tuning's
  shape buckets.
After the gate and after each bucket, the module's forward_path() must name the Gluon kernel:
a call that ran the tile-level kernel is recorded as an error, never as the Gluon kernel's time.
The winner is the fastest over the buckets' geometric mean (GLUON_CONFIG has one config for
every length). It becomes the "gluon" field of the spec's prefill entry (knobs, times, the
derived config's times, the kernel text's digest, every candidate's result), which the build
renders while it is still a feasible candidate (tuning.database.tuned_gluon). Measurements go
into the progress file keyed by spec and kernel text, as the tile-level ones.

This module imports torch and triton; the build path never imports it.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from attngen.reference import compare_to_reference, random_inputs
from attngen.spec import AttnSpec, KernelKind
from attngen.tiling.gluon import GluonCandidate, derive_gluon_tiles
from attngen.tuning.database import entry_key, gluon_knobs
from attngen.tuning.measure import (
    Bucket,
    Outcome,
    TuneRun,
    config_key,
    entry_fields,
    fastest_overall,
    kernel_digest,
    load_module,
    outcome_of,
)

GATE_LENGTHS = (1000, 1333)  # Nq, Nk


def gluon_candidates(spec: AttnSpec, arch: str, max_configs: int) -> list[GluonCandidate]:
    """The feasible Gluon candidates, the derived choice first, then by the derivation's own
    preference; none for a module without the Gluon forward."""
    derivation = derive_gluon_tiles(spec, arch)
    if derivation is None or derivation.chosen is None:
        return []
    chosen = derivation.chosen
    rest = [c for c in derivation.candidates if c.feasible and c != chosen]
    return [chosen, *rest][:max_configs]


def _gate_batch(module, spec: AttnSpec, candidate: GluonCandidate) -> int:
    """The smallest batch whose gate launch the module sends to the Gluon kernel."""
    config, (seqlen_q, seqlen_k) = candidate.config, GATE_LENGTHS
    rows = -(-seqlen_q // (config.block_m * config.consumers))
    keys = -(-seqlen_k // config.block_n)
    return module.POINTER_LOADS_UP_TO // (rows * keys * spec.num_q_heads) + 1


def _ran_gluon(module, where: str) -> None:
    path = module.forward_path()
    if path != module.GLUON_PATH:
        raise RuntimeError(f"{where}: the call ran {path!r}, not the Gluon kernel")


def _measure(module, spec: AttnSpec, candidate: GluonCandidate, inputs: dict, run: TuneRun) -> dict:
    """Gate, then time one candidate's module; failures are results too (recorded)."""
    try:
        if module.expected_forward_path() != module.GLUON_PATH:  # Triton's interpreter
            raise RuntimeError(f"here the module runs {module.expected_forward_path()!r}")
        batch = _gate_batch(module, spec, candidate)
        q, k, v, slopes = random_inputs(spec, batch, *GATE_LENGTHS, seed=7, device=run.device)
        out, lse = module.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
        _ran_gluon(module, "the gate")
        problems = compare_to_reference(spec, out, lse, q, k, v, alibi_slopes=slopes)
        if problems:
            return {"error": "incorrect: " + "; ".join(problems)[:300]}
        times = {}
        for bucket, (q, k, v, slopes) in inputs.items():
            times[bucket] = run.timer(partial(module.attention, q, k, v, alibi_slopes=slopes))
            _ran_gluon(module, bucket)
        return {"median_ms": times}
    except Exception as exc:  # a config that fails to compile or launch is a result
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        if run.device == "cuda":
            torch.cuda.synchronize()


def tune_gluon(
    run: TuneRun, spec: AttnSpec, cands: list[GluonCandidate], buckets: tuple[Bucket, ...], advance
) -> Outcome:
    """Measure the candidates (until the deadline) and record the winner in the spec's entry."""
    derivation = derive_gluon_tiles(spec, run.arch)
    assert derivation is not None  # gluon_candidates gave candidates

    def module(cand: GluonCandidate):  # rendered as the build renders a tuned config
        return load_module(spec, run.arch, run.folder, dataclasses.replace(derivation, chosen=cand))

    digest = kernel_digest(module(cands[0]))  # the derived module's kernel text
    results = run.results(f"{entry_key(spec, KernelKind.prefill)}/gluon/{digest}")
    inputs: dict = {}
    for cand in cands:
        key = config_key(cand.config)
        if key not in results:
            if run.out_of_time():
                break
            inputs = inputs or {
                b.name: random_inputs(spec, b.batch, b.seqlen, b.seqlen, seed=1, device=run.device)
                for b in buckets
            }
            results[key] = _measure(module(cand), spec, cand, inputs, run)
            run.save_progress()
        advance()
    inputs.clear()
    outcome = _record(run, spec, cands, results, buckets, digest)
    run.save_db()
    return outcome


def _record(run: TuneRun, spec, cands, results, buckets, digest: str) -> Outcome:
    by_key = {config_key(c.config): c.config for c in cands}
    derived = cands[0].config
    outcome, usable = outcome_of(spec, derived, by_key, results, buckets, "gluon")
    if not usable:
        return outcome
    best = fastest_overall(usable, buckets)
    outcome.winner, outcome.winner_ms = by_key[best], usable[best]
    key = entry_key(spec, KernelKind.prefill)
    run.db["entries"].setdefault(key, {"spec_name": spec.name})["gluon"] = {
        **entry_fields(run, outcome, results),
        "config": gluon_knobs(by_key[best]),
        "derived": gluon_knobs(derived),
        "derived_ms": outcome.heuristic_ms,
        "timed": "attention() on the Gluon path (forward_path() checked after each bucket)",
        "kernel_digest": digest,
    }
    return outcome
