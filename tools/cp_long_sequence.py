"""A sequence whose attention does not fit one GPU, run on two: the ring of attngen.distributed.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tools/cp_long_sequence.py --out DIR

The shape (--model): "opt-175b" (default), OPT-175B / GPT-3 175B's attention: 96 query and
96 KV heads, D 128, bf16, causal, one sequence; or "llama3-405b" (128 / 8 heads, D 128). N is
the smallest multiple of 8192 whose q, k, v, out and LSE exceed one GPU's memory
(mem_get_info's total) by 7% (or --seq-len). Rank 0 first tries to allocate those tensors on
its GPU (allocation only: cudaMalloc refuses at once) and records what failed. Both ranks then
build their zigzag shards, run context_parallel_attention (ring, forward) once after a warm-up
at 16k tokens, and check sampled rows of every rank against references computed blockwise over
each rank's K/V shard and joined by all-reduces (max, then sums): float64 (the golden) and
fp32 rounded to the output dtype (the yardstick of shared/RELIABILITY.md's rule).

Reports the time (slowest rank), TFLOP/s (2 N^2 Hq D), each rank's peak memory
(max_memory_allocated, inputs included) against the one-GPU need, and the check; writes JSON
under --out, prints a table last. At N = 1.64M (opt-175b): 6.6e16 FLOP, about 80 s on two H200s.

--memory-fraction F caps each process at F of its GPU (set_per_process_memory_fraction) and
sizes N against the cap: a cheaper proxy (F = 0.25: N = 409600, about 5 s), labelled PROXY in
every output. --smoke runs the same code on the CPU (gloo, fp32, toy heads, the interpreter).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

MODELS = {
    "opt-175b": (96, 96, 128, "OPT-175B / GPT-3 175B attention: 96 heads (MHA), D 128"),
    "llama3-405b": (128, 8, 128, "Llama-3-405B attention: 128 query / 8 KV heads, D 128"),
}
SMOKE_HEADS = (4, 2, 16)
OVERSHOOT = 1.07  # the sequence's tensors exceed the memory they are measured against by this
TOKEN_MULTIPLE = 8192
WARMUP_TOKENS = 16384
SAMPLES_PER_RANK = 16
REFERENCE_KEY_BLOCK = 8192
# The fp32 reference adds its sums 128 keys at a time, one block after another, as the kernels
# do (BLOCK_N 128): over a million keys that order's rounding (about sqrt(blocks) fp32 ulps
# of the row sum) is what an honest fp32 implementation carries, and what the LSE is held to.
KERNEL_KEY_BLOCK = 128


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--model", choices=sorted(MODELS), default="opt-175b")
    parser.add_argument("--seq-len", type=int, default=None, help="N (default: see above)")
    cap = "cap each process at this fraction of its GPU and size N against the cap (proxy)"
    parser.add_argument("--memory-fraction", type=float, default=None, help=cap)
    parser.add_argument(
        "--head-groups", type=int, default=None, help="ring_head_groups (default automatic)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, toy sizes")
    args = parser.parse_args()
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
        parser.error(f"--memory-fraction: got {args.memory_fraction}; allowed: 0 < F <= 1")
    return args


def bytes_per_token(heads_q, heads_kv, head_dim, element_size) -> int:
    """q, k, v and out of one token in the input dtype, and its fp32 LSE."""
    return 2 * (heads_q + heads_kv) * head_dim * element_size + heads_q * 4


def start(args):
    """(device, dtype, heads, world, rank) after joining torchrun's group."""
    import torch
    import torch.distributed as dist

    if args.smoke:
        dist.init_process_group("gloo")
        return torch.device("cpu"), torch.float32, SMOKE_HEADS
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    if args.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)
    return device, torch.bfloat16, MODELS[args.model][:3]


def one_gpu_attempt(heads, seq_len, dtype, device) -> dict:
    """Allocate the whole sequence's q, k, v and out on this GPU, one after another, and say
    which allocation failed; everything is freed again."""
    import torch

    heads_q, heads_kv, dim = heads
    names = zip("qkvo", (heads_q, heads_kv, heads_kv, heads_q), strict=True)
    shapes = [(name, (1, h, seq_len, dim)) for name, h in names]
    held, result = [], {"allocated": [], "failed": None}
    try:
        for name, shape in shapes:
            try:
                held.append(torch.empty(shape, dtype=dtype, device=device))
                result["allocated"].append(name)
            except torch.OutOfMemoryError as err:
                result["failed"] = name
                result["error"] = str(err).split("\n")[0][:300]
                break
    finally:
        held.clear()
        torch.cuda.empty_cache()
    return result


def shard_inputs(heads, n, dtype, device, rank):
    """This rank's q, k, v: [1, H, n, D], seeded by the rank."""
    import torch

    heads_q, heads_kv, dim = heads
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    return [
        torch.randn(1, h, n, dim, generator=gen, device=device, dtype=dtype)
        for h in (heads_q, heads_kv, heads_kv)
    ]


def sample_rows(n: int, count: int, rank: int) -> list[int]:
    """`count` local rows to check (as many on every rank): each zigzag chunk's first and last,
    then random ones."""
    import torch

    half = n // 2
    chosen = list(dict.fromkeys(r for r in (0, half - 1, half, n - 1) if 0 <= r < n))
    gen = torch.Generator().manual_seed(99 + rank)
    for r in torch.randperm(n, generator=gen).tolist():
        if len(chosen) >= count:
            break
        if r not in chosen:
            chosen.append(r)
    return sorted(chosen[:count])


def gathered_samples(q, out, lse, rows, chunks, world):
    """Every rank's sampled (positions, q rows, out rows, lse rows), on every rank."""
    import torch
    import torch.distributed as dist

    positions = [c.start + i for c in chunks for i in range(c.length)]

    index = torch.tensor(rows, device=q.device)
    mine = [
        torch.tensor([positions[r] for r in rows], device=q.device, dtype=torch.int64),
        q[0][:, index].contiguous(),
        out[0][:, index].contiguous(),
        lse[0][:, index].contiguous(),
    ]
    result = []
    for t in mine:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        result.append(torch.cat(parts, dim=-1 if t.dim() == 1 else 1))
    return result


def key_blocks(k, v, chunks, size=REFERENCE_KEY_BLOCK):
    """(global key positions, k block [Hkv, b, D], v block) over this rank's shard."""
    import torch

    for chunk in chunks:
        for first in range(0, chunk.length, size):
            last = min(chunk.length, first + size)
            pos = torch.arange(chunk.start + first, chunk.start + last, device=k.device)
            rows = slice(chunk.local + first, chunk.local + last)
            yield pos, k[0][:, rows], v[0][:, rows]


def reference(q_s, pos_s, k, v, chunks, scale, dtype, sum_block=REFERENCE_KEY_BLOCK):
    """(out [Hq, S, Dv], lse [Hq, S], the largest |score| or score partial sum) of the sampled
    rows over the whole sequence, in `dtype`: each rank's visible keys of its shard, two passes
    (max, then sums over key blocks of `sum_block`, in order) joined by all-reduces. Query
    heads are viewed as [Hkv, ratio x S] (GQA without copies)."""
    import torch
    import torch.distributed as dist

    heads_q, samples, _ = q_s.shape
    heads_kv = k.shape[1]
    ratio = heads_q // heads_kv
    queries = q_s.to(dtype).reshape(heads_kv, ratio * samples, -1)
    row_pos = pos_s.repeat(ratio)

    def scores(pos, kb):
        s = torch.matmul(queries, kb.to(dtype).transpose(-1, -2)) * scale
        return s.masked_fill(pos[None, None, :] > row_pos[None, :, None], float("-inf"))

    top = torch.full((heads_kv, ratio * samples), float("-inf"), dtype=dtype, device=q_s.device)
    largest = torch.zeros(1, dtype=torch.float64, device=q_s.device)
    for pos, kb, _ in key_blocks(k, v, chunks):
        s = scores(pos, kb)
        top = torch.maximum(top, s.amax(-1))
        largest = torch.maximum(largest, s.masked_fill(s.isinf(), 0).abs().max().double())
        # and the magnitude a score's partial sums reach (attngen.reference's LSE floor)
        partial = torch.matmul(queries.abs(), kb.to(dtype).abs().transpose(-1, -2)).amax()
        largest = torch.maximum(largest, partial.double() * scale)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    total = torch.zeros_like(top)
    acc = torch.zeros((heads_kv, ratio * samples, v.shape[-1]), dtype=dtype, device=q_s.device)
    for pos, kb, vb in key_blocks(k, v, chunks, sum_block):
        p = torch.exp(scores(pos, kb) - top[..., None])
        total += p.sum(-1)
        acc += torch.matmul(p, vb.to(dtype))
    dist.all_reduce(total)
    dist.all_reduce(acc)
    out = (acc / total[..., None]).reshape(heads_q, samples, -1)
    lse = (top + torch.log(total)).reshape(heads_q, samples)
    return out, lse, largest.item()


def check(samples, k, v, chunks, scale, out_dtype) -> dict:
    """shared/RELIABILITY.md's rule on the sampled rows: the error against the float64 golden
    at most 2x that of the fp32 math rounded to the output dtype, plus two output ulps (four
    for fp32 outputs, attngen.reference says why); the mean with 1.5x; the LSE with four fp32
    ulps at the scores' magnitude in log2 units."""
    import torch

    from attngen.reference import FP32_OUTPUT_FLOOR_ULPS, LOG2E, ulp

    pos_s, q_s, out_s, lse_s = samples
    gold, gold_lse, largest = reference(q_s, pos_s, k, v, chunks, scale, torch.float64)
    lowp, lowp_lse, _ = reference(
        q_s, pos_s, k, v, chunks, scale, torch.float32, sum_block=KERNEL_KEY_BLOCK
    )
    lowp = lowp.to(out_dtype).double()
    floor_ulps = FP32_OUTPUT_FLOOR_ULPS if out_dtype == torch.float32 else 2
    result = {"rows": int(pos_s.numel()), "problems": []}
    for what, got, golden, low in (
        ("out", out_s.double(), gold, lowp),
        ("lse", lse_s.double(), gold_lse, lowp_lse.double()),
    ):
        magnitude = golden.abs().max().item()
        if what == "lse":
            floor = 4 * ulp(torch.float32, max(magnitude, largest * LOG2E))
        else:
            floor = floor_ulps * ulp(out_dtype, magnitude)
        err, low_err = (got - golden).abs(), (low - golden).abs()
        bounds = (2 * low_err.max().item() + floor, 1.5 * low_err.mean().item() + floor)
        result[what] = {
            "max_err": err.max().item(),
            "max_bound": bounds[0],
            "mean_err": err.mean().item(),
            "mean_bound": bounds[1],
        }
        if got.isnan().any() or not err.max().item() <= bounds[0]:
            result["problems"].append(f"{what}: max error {err.max().item():.3e} > {bounds[0]:.3e}")
        if not err.mean().item() <= bounds[1]:
            result["problems"].append(
                f"{what}: mean error {err.mean().item():.3e} > {bounds[1]:.3e}"
            )
    return result


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_forward(q, k, v, seq_len, head_groups, device):
    """(out, lse, seconds of the slowest rank) of one forward."""
    import torch
    import torch.distributed as dist

    from attngen.distributed import context_parallel_attention

    dist.barrier()
    sync(device)
    begin = time.perf_counter()
    with torch.no_grad():
        out, lse = context_parallel_attention(
            q,
            k,
            v,
            causal=True,
            strategy="ring",
            seq_len=seq_len,
            return_lse=True,
            ring_head_groups=head_groups,
        )
    sync(device)
    seconds = torch.tensor([time.perf_counter() - begin], device=device, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return out, lse, seconds.item()


def choose_length(args, per_token, device) -> tuple[int, int | None]:
    """(N, the bytes N is measured against: the GPU's total, or the cap of the proxy)."""
    import torch

    if args.smoke:
        return args.seq_len or 64, None
    total = torch.cuda.mem_get_info(device)[1]
    cap = int(total * (args.memory_fraction or 1.0))
    if args.seq_len:
        return args.seq_len, cap
    tokens = math.ceil(OVERSHOOT * cap / per_token / TOKEN_MULTIPLE) * TOKEN_MULTIPLE
    return tokens, cap


def per_rank(value, device) -> list[float]:
    import torch
    import torch.distributed as dist

    mine = torch.tensor([float(value)], device=device, dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [p.item() for p in parts]


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.distributed as dist

    from attngen.distributed import last_plan, rank_chunks

    device, dtype, heads = start(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_token = bytes_per_token(*heads, dtype.itemsize)
    seq_len, cap = choose_length(args, per_token, device)
    heads_q, heads_kv, dim = heads
    one_gpu_bytes = seq_len * per_token
    attempt = None
    if rank == 0 and device.type == "cuda":
        attempt = one_gpu_attempt(heads, seq_len, dtype, device)
    dist.barrier()
    warm_up(args, heads, dtype, device, world, rank)
    every = rank_chunks(seq_len, world, "zigzag")
    chunks, n = every[rank], sum(c.length for c in every[rank])
    q, k, v = shard_inputs(heads, n, dtype, device, rank)
    out, lse, seconds = timed_forward(q, k, v, seq_len, args.head_groups, device)
    plan = last_plan()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    shortest = min(sum(c.length for c in r) for r in every)
    rows = sample_rows(n, min(SAMPLES_PER_RANK, shortest), rank)
    samples = gathered_samples(q, out, lse, rows, chunks, world)
    checked = check(samples, k, v, chunks, 1.0 / math.sqrt(dim), dtype)
    flops = 2.0 * seq_len * seq_len * heads_q * dim
    result = {
        "proxy": args.memory_fraction is not None,
        "smoke": args.smoke,
        "model": args.model if not args.smoke else "smoke",
        "shape": {"heads_q": heads_q, "heads_kv": heads_kv, "head_dim": dim, "dtype": str(dtype)},
        "seq_len": seq_len,
        "world_size": world,
        "memory_fraction": args.memory_fraction,
        "memory_measured_against_bytes": cap,
        "one_gpu_bytes": one_gpu_bytes,
        "one_gpu_attempt": attempt,
        "rank_tensors_bytes": per_rank(n * per_token, device),
        "peak_bytes": per_rank(peak, device),
        "head_groups": plan.head_groups,
        "plan": plan.describe(),
        "seconds": seconds,
        "flops": flops,
        "tflops_total": flops / seconds / 1e12,
        "tflops_per_gpu": flops / seconds / 1e12 / world,
        "check": checked,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    if rank == 0:
        write_result(args, result)
    dist.destroy_process_group()
    return 0 if not checked["problems"] else 1


def warm_up(args, heads, dtype, device, world, rank) -> None:
    """The kernels built and loaded, one forward at WARMUP_TOKENS (Triton compiles on first
    use: not in the timed call), then the peak memory statistics start afresh."""
    import torch
    from cp_bench_setup import load_kernels_for

    names = dict(zip(("heads_q", "heads_kv", "head_dim"), heads, strict=True))
    load_kernels_for(SimpleNamespace(device=device, smoke=args.smoke, **names))
    if args.smoke:
        return
    warm = shard_inputs(heads, WARMUP_TOKENS // world, dtype, device, rank)
    timed_forward(*warm, WARMUP_TOKENS, args.head_groups, device)
    del warm
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def write_result(args, result: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    kind = "smoke" if args.smoke else ("proxy" if result["proxy"] else "full")
    name = f"cp_long_sequence_{result['model']}_{kind}_{result['date']}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(table(result))


def table(r: dict) -> str:
    gib = 2**30
    label = "PROXY (each process capped at " if r["proxy"] else "full GPU ("
    against = r["memory_measured_against_bytes"]
    attempt = r["one_gpu_attempt"] or {}
    failed = attempt.get("failed")
    lines = [
        f"{r['model']} {r['shape']}, causal, N = {r['seq_len']}, W = {r['world_size']}, "
        f"{r['head_groups']} head groups",
        "memory measured against: "
        + ("none (smoke run)" if against is None else f"{label}{against / gib:.1f} GiB)"),
        f"one GPU needs {r['one_gpu_bytes'] / gib:.1f} GiB for q, k, v, out, lse; allocation "
        + (
            f"of {failed} failed after {', '.join(attempt['allocated']) or 'nothing'}"
            if failed
            else ("not attempted" if not attempt else "SUCCEEDED: the shape fits one GPU")
        ),
        "",
        "| rank | q,k,v,out,lse GiB | peak GiB | peak / one GPU |",
        "|---|---|---|---|",
    ]
    for rank, (mine, peak) in enumerate(zip(r["rank_tensors_bytes"], r["peak_bytes"], strict=True)):
        lines.append(
            f"| {rank} | {mine / gib:.1f} | {peak / gib:.1f} | {peak / r['one_gpu_bytes']:.2f} |"
        )
    c = r["check"]
    lines += [
        "",
        f"forward {r['seconds']:.2f} s, {r['tflops_total']:.0f} TFLOP/s "
        f"({r['tflops_per_gpu']:.0f} per GPU)",
        f"check ({c['rows']} sampled rows): out max err {c['out']['max_err']:.2e} "
        f"<= {c['out']['max_bound']:.2e}, lse max err {c['lse']['max_err']:.2e} "
        f"<= {c['lse']['max_bound']:.2e}: " + ("; ".join(c["problems"]) or "ok"),
    ]
    if r["proxy"]:
        lines.insert(0, "PROXY RUN: the cap stands in for one GPU's memory")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
