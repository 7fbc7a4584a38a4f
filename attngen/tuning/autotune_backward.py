"""`attngen autotune` for the gradient kernels of a spec with `backward: true`: the dQ kernel
(with its fused delta) and the dK/dV kernel, each tuned on its own; where the module runs
dK/dV as two launches (tiling.backward.split_dkdv), its dV and its dK launch too, each timed
alone, the fused launch still tuned beside them.

Candidates, per kernel: feasible configs of the backward model (attngen/tiling/backward.py),
never an infeasible one, at most `max_configs`: the heuristic's choice first (so that a run the
budget cuts short still compares against it), then tile shapes (BLOCK_M x BLOCK_N x warps) in
the order of their best score, each with every stage count it has. Configs the register model
calls may-spill are tried too: the model is an estimate at the register limit (on the H200,
dK/dV 64x64 with 8 warps compiles to 255 registers without spilling at 2 stages, 52 B of spill
at 3, where the model says 257 for both), and the measurement decides.

The gate: on fresh inputs (one sequence, Nq = 200 != Nk = 333, off the block grid, the spec's
heads), the forward then `attention_backward` with this kernel's config (the other kernel at
the heuristic's); dQ, dK and dV against the float64 golden by the yardstick of
attngen.reference.backward (`compare_gradients`), on the CPU. A config that fails it, or fails
to compile or launch, is recorded with its error and never wins.

The timing: only that kernel's launch. One `attention_backward` call on the bucket's inputs
runs both kernels with the module's launch code, and a stand-in for the kernel under
measurement records its launch (grid, arguments, constexprs and launch options); the median of
relaunching exactly that (`do_bench`, after warm-up) is the kernel's time: the other kernel,
the host code and the allocations are outside it. Relaunching is idempotent: the dQ kernel
stores dQ and delta, the dK/dV kernel dK and dV, each from inputs it does not write.

The bucket: training's shape, 16k tokens of sequences of 4096 (batch 4), the spec's heads and
head dims, under the spec's own mask (a causal spec is timed causal, a spec without a mask
unmasked: the mask is compiled into the module, and the entry's key holds it). Dropout specs
are timed with dropout_p = 0. Measurements go into the progress file under the kernel's entry
key and the module's kernel text, so an interrupted run resumes; the winner (fastest over the
buckets' geometric mean) becomes the `backward_dq` / `backward_dkdv` entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attngen.reference import random_inputs
from attngen.reference.backward import compare_gradients
from attngen.spec import AttnSpec, SpecError
from attngen.tiling.backward import GRADS_OF, KERNELS, derive_backward_tiles
from attngen.tiling.prefill import Candidate, Derivation, TileConfig
from attngen.tuning.database import BACKWARD_KINDS, backward_entry_key
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

BACKWARD_BUCKETS = (Bucket("train_n4096", 4, 4096),)
GATE_SHAPE = (1, 200, 333)  # batch, Nq, Nk
# Per kernel: the heuristic, then the best shapes at both stage counts. Each candidate costs
# a compile at two shapes (the gate's lengths specialize differently), the gate and the timing:
# about ten seconds on an H200 at D = 128.
DEFAULT_BACKWARD_CONFIGS = 6
# The module's kernel function of each gradient kernel; dv and dk are the dK/dV kernel's
# one-gradient launches (BWD_DKDV_SPLIT), told apart by their GRADS.
KERNEL_FUNCTIONS = {
    "dq": "_attn_bwd_dq_kernel",
    "dkdv": "_attn_bwd_dkdv_kernel",
    "dv": "_attn_bwd_dkdv_kernel",
    "dk": "_attn_bwd_dkdv_kernel",
}
MODULE_CONFIGS = {"dq": "BWD_DQ_CONFIG", "dkdv": "BWD_DKDV_CONFIG"}


@dataclass(frozen=True)
class BackwardOptions:
    max_configs: int = DEFAULT_BACKWARD_CONFIGS  # per kernel
    buckets: tuple[Bucket, ...] = BACKWARD_BUCKETS
    gate_shape: tuple[int, int, int] = GATE_SHAPE


DEFAULT_BACKWARD_OPTIONS = BackwardOptions()


def backward_candidates(
    spec: AttnSpec, arch: str, max_configs: int
) -> dict[str, tuple[TileConfig, list[Candidate]]]:
    """kernel -> (the heuristic's config, the candidates to measure, the heuristic's first)."""
    if max_configs < 1:
        raise SpecError(f"max backward configs: {max_configs}; expected at least 1")
    derivations = derive_backward_tiles(spec, arch)
    plans = {}
    # The one-gradient launches are tuned where the module runs them (split_dkdv); the fused
    # launch always, so that its time stands beside theirs in the tuning file.
    for kernel in KERNELS if derivations.split else ("dq", "dkdv"):
        derivation = getattr(derivations, kernel)
        chosen = derivation.chosen_candidate
        if chosen is None:
            raise SpecError(f"{spec.name}: no feasible {kernel} backward config on {arch} to tune")
        plans[kernel] = (chosen.config, [chosen, *_by_shape(derivation, chosen)][:max_configs])
    return plans


def _by_shape(derivation: Derivation, skip: Candidate) -> list[Candidate]:
    """Feasible candidates grouped by tile shape, shapes in the order of their best score,
    each shape's stage counts best-scoring first; without `skip`."""
    feasible = sorted(
        (c for c in derivation.candidates if c.feasible and c != skip),
        key=lambda c: (-c.score, c.smem_bytes, c.config),
    )
    by_shape: dict[tuple[int, int, int], list[Candidate]] = {}
    for cand in feasible:
        by_shape.setdefault(
            (cand.config.block_m, cand.config.block_n, cand.config.num_warps), []
        ).append(cand)
    return [cand for same_shape in by_shape.values() for cand in same_shape]


class _LaunchRecorder:
    """Stands in for a JIT function in the module: records each launch, then makes it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _backward_inputs(module, spec: AttnSpec, batch: int, seqlen_q: int, seqlen_k: int, device: str):
    """q, k, v, ALiBi slopes, dout, and the forward's out and lse."""
    q, k, v, slopes = random_inputs(spec, batch, seqlen_q, seqlen_k, seed=7, device=device)
    gen = torch.Generator().manual_seed(8)
    dout = (
        torch.randn(batch, spec.num_q_heads, seqlen_q, spec.value_head_dim, generator=gen)
        .to(q.dtype)
        .to(device)
    )
    out, lse = module.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    return q, k, v, slopes, dout, out, lse


def _gate(module, spec: AttnSpec, shape: tuple[int, int, int], device: str) -> list[str]:
    q, k, v, slopes, dout, out, lse = _backward_inputs(module, spec, *shape, device)
    grads = module.attention_backward(dout, q, k, v, out, lse, alibi_slopes=slopes)
    cpu = [t.cpu() for t in (*grads, q, k, v, dout)]
    return compare_gradients(
        spec, cpu[:3], *cpu[3:], alibi_slopes=None if slopes is None else slopes.cpu()
    )


def _time_kernel(module, kernel: str, inputs, timer) -> float:
    """The timer's reading of this kernel's launch alone, as the module makes it."""
    q, k, v, slopes, dout, out, lse = inputs
    name = KERNEL_FUNCTIONS[kernel]
    real = getattr(module, name)
    recorder = _LaunchRecorder(real)
    setattr(module, name, recorder)
    try:
        module.attention_backward(dout, q, k, v, out, lse, alibi_slopes=slopes)
    finally:
        setattr(module, name, real)
    launches = [
        launch
        for launch in recorder.launches
        if kernel not in GRADS_OF or launch[2].get("GRADS") == GRADS_OF[kernel]
    ]
    if len(launches) != 1:
        raise RuntimeError(
            f"{name}: expected one {kernel} launch per backward, got {len(launches)}"
        )
    ((grid, args, kwargs),) = launches
    return timer(lambda: real[grid](*args, **kwargs))


def _measure(
    module,
    spec: AttnSpec,
    kernel: str,
    config: TileConfig,
    inputs: dict,
    options: BackwardOptions,
    run: TuneRun,
) -> dict:
    """Gate, then time one config of one kernel; failures are results too (recorded)."""
    split = module.BWD_DKDV_SPLIT
    if kernel in ("dv", "dk"):  # the other launch keeps the module's config
        module.BWD_DKDV_SPLIT = tuple(
            config.as_dict() if launch == kernel else dict(other)
            for launch, other in zip(("dv", "dk"), split, strict=True)
        )
        launch_config, heuristic = {}, {}
    else:
        if kernel == "dkdv":  # the fused launch, also in a module that splits
            module.BWD_DKDV_SPLIT = None
        launch_config = getattr(module, MODULE_CONFIGS[kernel])
        heuristic = dict(launch_config)
        launch_config.update(config.as_dict())
    try:
        problems = _gate(module, spec, options.gate_shape, run.device)
        if problems:
            return {"error": "incorrect: " + "; ".join(problems)[:300]}
        return {
            "median_ms": {
                bucket: _time_kernel(module, kernel, bucket_inputs, run.timer)
                for bucket, bucket_inputs in inputs.items()
            }
        }
    except Exception as exc:  # a config that fails to compile or launch is a result
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        module.BWD_DKDV_SPLIT = split
        if heuristic:
            launch_config.clear()
            launch_config.update(heuristic)
        if run.device == "cuda":
            torch.cuda.synchronize()


def tune_backward(
    run: TuneRun,
    spec: AttnSpec,
    plans: dict[str, tuple[TileConfig, list[Candidate]]],
    options: BackwardOptions,
    advance,
) -> list[Outcome]:
    """Measure each gradient kernel's candidates (until the deadline) and record the winners;
    an Outcome per kernel."""
    module = load_module(spec, run.arch, run.folder)
    digest = kernel_digest(module)
    inputs: dict = {}  # the buckets' tensors, made when the first measurement needs them
    outcomes = []
    for kernel, (heuristic, cands) in plans.items():
        results = run.results(f"{backward_entry_key(spec, kernel)}/{digest}")
        for cand in cands:
            key = config_key(cand.config)
            if key not in results:
                if run.out_of_time():
                    break
                inputs = inputs or {
                    b.name: _backward_inputs(module, spec, b.batch, b.seqlen, b.seqlen, run.device)
                    for b in options.buckets
                }
                results[key] = _measure(module, spec, kernel, cand.config, inputs, options, run)
                run.save_progress()
            advance()
        outcomes.append(_record(run, spec, kernel, heuristic, cands, results, options.buckets))
        run.save_db()
    inputs.clear()
    return outcomes


def _record(run: TuneRun, spec: AttnSpec, kernel: str, heuristic, cands, results, buckets):
    by_key = {config_key(c.config): c for c in cands}
    kind = BACKWARD_KINDS[kernel]
    outcome, usable = outcome_of(spec, heuristic, by_key, results, buckets, kind)
    if not usable:
        return outcome
    best = fastest_overall(usable, buckets)
    outcome.winner, outcome.winner_ms = by_key[best].config, usable[best]
    mask, heads = spec.mask.value, [spec.num_q_heads, spec.num_kv_heads]
    run.db["entries"][backward_entry_key(spec, kernel)] = {
        **entry_fields(run, outcome, results),
        "spec_name": spec.name,
        "config": outcome.winner.as_dict(),
        # As for the forward: a later model that fits fewer programs per SM makes the build
        # refuse the entry rather than use a config whose timing no longer holds.
        "programs_per_sm": by_key[best].programs_per_sm,
        "timed": f"the {kernel} kernel's launch alone",
        "buckets": {
            b.name: {"batch": b.batch, "seqlen": b.seqlen, "mask": mask, "heads": heads}
            for b in buckets
        },
    }
    return outcome
