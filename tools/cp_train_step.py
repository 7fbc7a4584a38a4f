"""A training step whose attention forward + backward does not fit one GPU, run on two: the
ring of attngen.distributed, its backward in groups of KV heads.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tools/cp_train_step.py --out DIR
    (or: bash tools/gpu_session.sh OUT cp_train:480)

The sizes, from the memory model (tools/cp_bench_setup.py). One GPU's attention forward +
backward holds per token q, k, v, out, dO, dq, dk, dv in bf16 and the fp32 LSE and delta:
for OPT-175B's heads (--model opt-175b, default: 96 query and 96 KV heads, D 128, MHA, one
sequence, causal) 8 x 96 x 128 x 2 + 2 x 96 x 4 = 197,376 B. N is the smallest multiple of
8192 whose need exceeds the GPU's memory (mem_get_info's total) by 7%: on an H200 (139.8
GiB) N = 819,200 and 150.6 GiB. A rank of two holds the same for its 409,600 tokens, 75.3
GiB, plus the backward's peak (`ring_backward_peak`): with one KV head a group (automatic:
one head's fp32 dQ and three dK/dV take 1.4 GiB at 409,600 rows, past the 1 GiB bound) 1.8
GiB, 77.1 GiB in all: 0.51 of one GPU's need. The work: a causal forward is 2 N^2 Hq D =
1.65e16 FLOP (about 17 s on two H200s at the forward's 489 TFLOP/s each), the backward 2.5
times that at about 240 TFLOP/s a GPU (about 86 s). --memory-fraction F caps each process at
F of its GPU and sizes N against the cap (a cheaper proxy, labelled PROXY).

Rank 0 first tries to allocate the step's tensors (q, k, v, out, dO, dq, dk, dv) of the whole
sequence on its GPU and records which one failed. Both ranks then run one forward + backward
of their zigzag shards after a warm-up at 16k tokens, and check sampled query rows of dq (16
a rank) against float64 and fp32 references computed blockwise over every rank's K/V and
joined by all-reduces (RELIABILITY.md's rule: at most twice the fp32 yardstick's error plus
two bf16 ulps), and sampled keys of dk and dv (16 a rank) against float64 sums over every
rank's query rows that take the forward's LSE and out (delta = rowsum(dO * out)) as given,
held to 4 bf16 roundings of the largest value (tests/test_context_parallel_gpu.py's bound).
Prints a table last and writes JSON under --out. --smoke runs the same code on the CPU
(gloo, fp32, toy heads, the interpreter).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import cp_long_sequence as long  # noqa: E402  (tools/ is not a package)
from cp_bench_setup import (  # noqa: E402
    load_kernels_for,
    ring_backward_peak,
    training_bytes_per_token,
)

WARMUP_TOKENS = 16384
SAMPLES = 16


def one_gpu_attempt(heads, seq_len, dtype, device) -> dict:
    """Allocate the step's tensors of the whole sequence on this GPU, one after another, and
    say which allocation failed; everything is freed again."""
    import torch

    heads_q, heads_kv, dim = heads
    names = "q k v out dO dq dk dv".split()
    sizes = [heads_q if n in ("q", "out", "dO", "dq") else heads_kv for n in names]
    held, result = [], {"allocated": [], "failed": None}
    try:
        for name, h in zip(names, sizes, strict=True):
            try:
                held.append(torch.empty(1, h, seq_len, dim, dtype=dtype, device=device))
                result["allocated"].append(name)
            except torch.OutOfMemoryError as err:
                result.update(failed=name, error=str(err).split("\n")[0][:300])
                break
    finally:
        held.clear()
        torch.cuda.empty_cache()
    return result


def step(q, k, v, dout, seq_len, device, head_groups=None):
    """(out, lse, dq, dk, dv, forward seconds, backward seconds), the slowest rank's times."""
    import torch

    from attngen.distributed import context_parallel_attention

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def timed(fn):
        torch.distributed.barrier()
        long.sync(device)
        begin = time.perf_counter()
        result = fn()
        long.sync(device)
        seconds = torch.tensor([time.perf_counter() - begin], device=device, dtype=torch.float64)
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        return result, seconds.item()

    (out, lse), forward = timed(
        lambda: context_parallel_attention(
            *leaves,
            causal=True,
            strategy="ring",
            seq_len=seq_len,
            return_lse=True,
            ring_head_groups=head_groups,
        )
    )
    grads, backward = timed(lambda: torch.autograd.grad(out, leaves, dout))
    return out.detach(), lse.detach(), *grads, forward, backward


def gathered(tensors, index, world):
    """Every rank's rows `index` (dim 2 of [1, H, n, D] tensors, dim 1 of [H, n] ones)."""
    import torch
    import torch.distributed as dist

    result = []
    for t in tensors:
        mine = (t[0][:, index] if t.dim() > 1 else t[index]).contiguous()
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        result.append(torch.cat(parts, dim=min(1, mine.dim() - 1)))
    return result


def positions(chunks, device):
    import torch

    return torch.tensor([c.start + i for c in chunks for i in range(c.length)], device=device)


def reference_dq(rows, k, v, chunks, scale, dtype):
    """dq of the sampled rows (positions, q [Hq, S, D], dO) in `dtype`: the LSE and output from
    two passes over every rank's K/V blocks (long.reference), then dq = scale sum_j P_ij
    (dO_i . v_j - delta_i) k_j in a third, joined by an all-reduce."""
    import torch
    import torch.distributed as dist

    pos, q_s, dout_s = rows
    out, lse, _ = long.reference(q_s, pos, k, v, chunks, scale, dtype)
    heads_q, samples, dim = q_s.shape
    ratio = heads_q // k.shape[1]
    shape = (k.shape[1], ratio * samples)
    qs, dos = (t.to(dtype).reshape(*shape, -1) for t in (q_s, dout_s))
    delta = (dout_s.to(dtype) * out).sum(-1).reshape(shape)
    lse, row_pos = lse.reshape(shape), pos.repeat(ratio)
    dq = torch.zeros_like(qs)
    for key_pos, kb, vb in long.key_blocks(k, v, chunks):
        kb, vb = kb.to(dtype), vb.to(dtype)
        p = torch.exp(torch.matmul(qs, kb.transpose(-1, -2)) * scale - lse[..., None])
        p = p.masked_fill(key_pos[None, None, :] > row_pos[None, :, None], 0)
        ds = p * (torch.matmul(dos, vb.transpose(-1, -2)) - delta[..., None])
        dq += torch.matmul(ds, kb) * scale
    dist.all_reduce(dq)
    return dq.reshape(heads_q, samples, dim)


def reference_dkdv(keys, q, out, lse, dout, chunks, scale):
    """float64 dk, dv of the sampled keys (positions, k [Hkv, S, D], v) over every rank's query
    rows, with the forward's LSE and out as given (delta = rowsum(dO * out))."""
    import torch
    import torch.distributed as dist

    pos, k_s, v_s = (t.double() if t.is_floating_point() else t for t in keys)
    ratio = q.shape[1] // k_s.shape[0]
    kk, vv = (t.repeat_interleave(ratio, 0) for t in (k_s, v_s))  # per query head
    dk, dv = torch.zeros_like(kk), torch.zeros_like(vv)
    row_pos = positions(chunks, q.device)
    for first in range(0, q.shape[2], long.REFERENCE_KEY_BLOCK):
        rows = slice(first, first + long.REFERENCE_KEY_BLOCK)
        qb, ob, dob = (t[0][:, rows].double() for t in (q, out, dout))
        p = torch.exp(torch.matmul(kk, qb.transpose(-1, -2)) * scale - lse[0][:, None, rows])
        p = p.masked_fill(pos[None, :, None] > row_pos[None, None, rows], 0)
        delta = (dob * ob).sum(-1)
        dv += torch.matmul(p, dob)
        ds = p * (torch.matmul(vv, dob.transpose(-1, -2)) - delta[:, None, :])
        dk += torch.matmul(ds, qb) * scale
    dist.all_reduce(dk)
    dist.all_reduce(dv)
    heads_kv, samples = k_s.shape[:2]
    fold = (heads_kv, ratio, samples, -1)
    return dk.reshape(fold).sum(1), dv.reshape(fold).sum(1)


def check(tensors, grads, chunks, world, rank, count, dtype) -> dict:
    """The sampled rows of dq against the float64 and fp32 references (RELIABILITY.md's rule),
    the sampled keys of dk, dv against float64 with the forward's LSE and out."""
    import torch

    from attngen.reference import ulp

    q, k, v, dout, out, lse = tensors
    dq, dk, dv = grads
    scale = 1.0 / math.sqrt(q.shape[-1])
    index = torch.tensor(long.sample_rows(q.shape[2], count, rank), device=q.device)
    pos = positions(chunks, q.device)
    rows = gathered([pos, q, dout, dq], index, world)
    gold = reference_dq(rows[:3], k, v, chunks, scale, torch.float64)
    lowp = reference_dq(rows[:3], k, v, chunks, scale, torch.float32).to(dtype).double()
    got = rows[3].double()
    result: dict = {"rows": int(rows[0].numel()), "problems": []}
    floor = (4 if dtype == torch.float32 else 2) * ulp(dtype, gold.abs().max().item())
    err, bound = (got - gold).abs().max().item(), 2 * (lowp - gold).abs().max().item() + floor
    result["dq"] = {"max_err": err, "max_bound": bound}
    if not err <= bound:
        result["problems"].append(f"dq: max error {err:.3e} > {bound:.3e}")
    keys = gathered([pos, k, v, dk, dv], index, world)
    gold_k, gold_v = reference_dkdv(keys[:3], q, out, lse, dout, chunks, scale)
    for name, got, golden in (("dk", keys[3], gold_k), ("dv", keys[4], gold_v)):
        err = (got.double() - golden).abs().max().item()
        bound = 4 * 2.0 ** (-8 if dtype != torch.float32 else -21) * golden.abs().max().item()
        result[name] = {"max_err": err, "max_bound": bound}
        if not err <= bound:
            result["problems"].append(f"{name}: max error {err:.3e} > {bound:.3e}")
    return result


def warm_up(args, heads, dtype, device, world, rank) -> None:
    """The kernels built and loaded, one forward + backward at WARMUP_TOKENS (Triton compiles
    on first use), then the peak memory statistics start afresh."""
    import torch

    names = dict(zip(("heads_q", "heads_kv", "head_dim"), heads, strict=True))
    load_kernels_for(SimpleNamespace(device=device, smoke=args.smoke, **names), backward=True)
    if args.smoke:
        return
    q, k, v = long.shard_inputs(heads, WARMUP_TOKENS // world, dtype, device, rank)
    step(q, k, v, torch.randn_like(q), WARMUP_TOKENS, device, args.head_groups)
    del q, k, v
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def main() -> int:
    args = long.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.distributed as dist

    from attngen.distributed import last_plan, rank_chunks

    device, dtype, heads = long.start(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_token = training_bytes_per_token(*heads, dtype.itemsize)
    seq_len, cap = long.choose_length(args, per_token, device)
    attempt = None
    if rank == 0 and device.type == "cuda":
        attempt = one_gpu_attempt(heads, seq_len, dtype, device)
    dist.barrier()
    warm_up(args, heads, dtype, device, world, rank)
    every = rank_chunks(seq_len, world, "zigzag")
    chunks, n = every[rank], sum(c.length for c in every[rank])
    q, k, v = long.shard_inputs(heads, n, dtype, device, rank)
    gen = torch.Generator(device=device).manual_seed(777 + rank)
    dout = torch.randn(q.shape, generator=gen, device=device, dtype=dtype)
    out, lse, dq, dk, dv, forward, backward = step(q, k, v, dout, seq_len, device, args.head_groups)
    plan = last_plan()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    model = n * per_token + ring_backward_peak(
        seq_len, world, rank, heads[:2], heads[2], dtype.itemsize, plan.backward_head_groups
    )
    count = min(SAMPLES, *(sum(c.length for c in r) for r in every))  # as many on every rank
    tensors = (q, k, v, dout, out, lse)
    checked = check(tensors, (dq, dk, dv), chunks, world, rank, count, dtype)
    result = report(args, heads, dtype, seq_len, cap, per_token, attempt, plan, device)
    result.update(
        rank_model_bytes=long.per_rank(model, device),
        peak_bytes=long.per_rank(peak, device),
        forward_seconds=forward,
        backward_seconds=backward,
        forward_tflops_per_gpu=result["flops"] / forward / 1e12 / world,
        backward_tflops_per_gpu=2.5 * result["flops"] / backward / 1e12 / world,
        check=checked,
    )
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        kind = "smoke" if args.smoke else ("proxy" if result["proxy"] else "full")
        name = f"cp_train_step_{result['model']}_{kind}_{result['date']}.json"
        (args.out / name).write_text(json.dumps(result, indent=1))
        print(table(result))
    dist.destroy_process_group()
    return 0 if not checked["problems"] else 1


def report(args, heads, dtype, seq_len, cap, per_token, attempt, plan, device) -> dict:
    """The run's description: shapes, sizes, the one-GPU attempt, the plan's groups."""
    import torch
    import torch.distributed as dist

    return {
        "proxy": args.memory_fraction is not None,
        "smoke": args.smoke,
        "model": args.model if not args.smoke else "smoke",
        "shape": dict(zip(("heads_q", "heads_kv", "head_dim"), heads, strict=True)),
        "dtype": str(dtype),
        "seq_len": seq_len,
        "world_size": dist.get_world_size(),
        "memory_measured_against_bytes": cap,
        "one_gpu_bytes": seq_len * per_token,
        "one_gpu_attempt": attempt,
        "head_groups": [plan.head_groups, plan.backward_head_groups],
        "flops": 2.0 * seq_len * seq_len * heads[0] * heads[2],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def table(r: dict) -> str:
    gib = 2**30
    attempt = r["one_gpu_attempt"] or {}
    failed = attempt.get("failed")
    against = r["memory_measured_against_bytes"]
    lines = [
        f"{r['model']} {r['shape']} {r['dtype']}, causal, N = {r['seq_len']}, "
        f"W = {r['world_size']}, head groups forward {r['head_groups'][0]}, "
        f"backward {r['head_groups'][1]}",
        "memory measured against: "
        + ("none (smoke run)" if against is None else f"{against / gib:.1f} GiB")
        + (" (PROXY: each process capped)" if r["proxy"] else ""),
        f"one GPU needs {r['one_gpu_bytes'] / gib:.1f} GiB for the step; allocation "
        + (
            f"of {failed} failed after {', '.join(attempt['allocated']) or 'nothing'}"
            if failed
            else ("not attempted" if not attempt else "SUCCEEDED: the step fits one GPU")
        ),
        "",
        "| rank | model GiB | peak GiB | peak / one GPU |",
        "|---|---|---|---|",
    ]
    for rank, (model, peak) in enumerate(zip(r["rank_model_bytes"], r["peak_bytes"], strict=True)):
        lines.append(
            f"| {rank} | {model / gib:.1f} | {peak / gib:.1f} | {peak / r['one_gpu_bytes']:.2f} |"
        )
    c = r["check"]
    lines += [
        "",
        f"forward {r['forward_seconds']:.2f} s ({r['forward_tflops_per_gpu']:.0f} TFLOP/s a "
        f"GPU), backward {r['backward_seconds']:.2f} s ({r['backward_tflops_per_gpu']:.0f})",
        f"check ({c['rows']} rows, {c['rows']} keys): "
        + ", ".join(
            f"{g} {c[g]['max_err']:.2e} <= {c[g]['max_bound']:.2e}" for g in ("dq", "dk", "dv")
        )
        + ": "
        + ("; ".join(c["problems"]) or "ok"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
