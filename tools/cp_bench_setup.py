"""What the context-parallel benchmarks share (bench_context_parallel.py and
bench_context_parallel_backward.py): their options, the shapes, device and process group of a
run, the modules they load, the timing rule and the environment record; and the training
step's memory model (training_bytes_per_token, ring_backward_peak: docs/context_parallel.md,
"Memory: training")."""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TUNING = ROOT / "tuning"
GPU_SEQLENS = (32768, 65536, 131072, 262144)


def argument_parser(description: str) -> argparse.ArgumentParser:
    """The options of this benchmark and of bench_context_parallel_backward.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument(
        "--seqlens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated N (default 32k,64k,128k,256k)",
    )
    parser.add_argument(
        "--worlds",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2, 4, 8],
        help="W for the per-step section",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=3.0,
        help="seconds of repeats per measurement (at least 3 repeats)",
    )
    parser.add_argument(
        "--no-torch-cp",
        action="store_true",
        help="skip PyTorch's context parallelism in the two-GPU run",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, Triton interpreter, toy sizes: checks the script runs",
    )
    return parser


class Setup:
    """The shapes, device and process group of this run."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.smoke = args.smoke
        self.dtype = torch.float32 if args.smoke else torch.bfloat16
        self.batch, self.heads_q, self.heads_kv, self.head_dim = (
            (1, 4, 2, 16) if args.smoke else (1, 32, 8, 128)
        )
        self.seqlens = args.seqlens or ([64] if args.smoke else list(GPU_SEQLENS))
        if dist.is_initialized():  # a caller's group (a test's one-process group)
            self.device = torch.device("cpu" if args.smoke else "cuda")
        elif "WORLD_SIZE" in os.environ:  # torchrun
            local = int(os.environ.get("LOCAL_RANK", 0))
            self.device = torch.device("cuda", local) if not args.smoke else torch.device("cpu")
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                dist.init_process_group("nccl", device_id=self.device)
            else:
                dist.init_process_group("gloo")
        else:
            self.device = torch.device("cpu" if args.smoke else "cuda")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.mesh = None  # PyTorch's device mesh, made on first use

    def inputs(self, seq_len, seed=0):
        import torch

        gen = torch.Generator(device=self.device).manual_seed(seed)
        shapes = [(self.batch, self.heads_q, seq_len, self.head_dim)] + 2 * [
            (self.batch, self.heads_kv, seq_len, self.head_dim)
        ]
        return [torch.randn(s, generator=gen, device=self.device, dtype=self.dtype) for s in shapes]

    def causal_flops(self, seq_len) -> float:
        return 2.0 * self.batch * self.heads_q * seq_len * seq_len * self.head_dim


def load_kernels_for(setup: Setup, backward: bool = False) -> str:
    """Build the causal and mask-none modules of the shapes (tuned configs where the tuning
    database has them; with backward, `backward: true`) into a temporary folder and load it
    as the registry."""
    import torch

    from attngen.build import plan_build, write_build
    from attngen.runtime.registry import load_kernels
    from attngen.spec import specs_from_data

    arch = "sm90"
    if setup.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(setup.device)
        arch = f"sm{major}{minor}"
    common = dict(
        archs=[arch],
        dtype="fp32" if setup.smoke else "bf16",
        head_dim=setup.head_dim,
        num_q_heads=setup.heads_q,
        num_kv_heads=setup.heads_kv,
        kernels=["prefill"],
        backward=backward,
    )
    specs = [
        s
        for data in (
            dict(common, name="cp_causal", mask="causal", causal_align="bottom_right"),
            dict(common, name="cp_full", mask="none"),
        )
        for s in specs_from_data(data)
    ]
    folder = Path(tempfile.mkdtemp(prefix="attngen-cp-bench-"))
    write_build(plan_build(specs, TUNING if TUNING.is_dir() else None), folder)
    load_kernels(folder, replace=True)
    return arch


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(setup: Setup, fn, budget: float) -> float:
    """Median milliseconds of fn over repeats (at least 3, about `budget` seconds), each started
    after a barrier; with several ranks, the slowest rank's time of each repeat."""
    import torch
    import torch.distributed as dist

    if not setup.smoke:  # the smoke run times one call of each, without warm-up
        fn()  # warm-up: Triton compiles on first use
    times = []
    while len(times) < 3 or (sum(times) < budget and len(times) < 50):
        if setup.world > 1:
            dist.barrier()
        sync(setup.device)
        start = time.perf_counter()
        fn()
        sync(setup.device)
        elapsed = torch.tensor([time.perf_counter() - start], device=setup.device)
        if setup.world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
        if setup.smoke:
            break
    return statistics.median(times) * 1e3


def environment(setup: Setup, arch: str) -> dict:
    import torch
    import triton

    name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu"
    return {
        "device": name,
        "arch": arch,
        "world_size": setup.world,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "shape": {
            "batch": setup.batch,
            "heads_q": setup.heads_q,
            "heads_kv": setup.heads_kv,
            "head_dim": setup.head_dim,
            "dtype": str(setup.dtype),
            "mask": "causal",
        },
        "smoke": setup.smoke,
    }


# ------------------------------------------------------------------ the training step's memory


def training_bytes_per_token(heads_q, heads_kv, head_dim, element_size) -> int:
    """What one GPU's attention forward + backward holds per token of the sequence (B = 1):
    q, k, v and out, the output's gradient dO and dq, dk, dv in the input dtype, the fp32 LSE
    and the backward's fp32 delta = rowsum(dO * out). A ring rank holds the same for each of
    its own tokens, plus `ring_backward_peak`."""
    return 4 * (heads_q + heads_kv) * head_dim * element_size + 2 * heads_q * 4


def ring_backward_peak(
    seq_len, world, rank, heads, head_dim, element_size, groups, layout="zigzag"
) -> int:
    """The bytes the causal ring's backward (attngen/distributed/backward.py, B = 1) allocates
    on `rank` at its peak besides dq, dk, dv and what the forward left: for the largest group
    of KV heads, at each ring step, its fp32 dQ accumulator (none for fp32 inputs: dq itself),
    its fp32 dK/dV (the shard's being computed; from step 1 also the one arriving and the one
    leaving), its K/V shards (the one arriving and, from step 1, the one received before) and
    one kernel call's partial gradients with the kernel's delta (and a copy of the call's LSE
    rows when they are not the whole shard). tests/test_context_parallel.py checks it byte
    for byte against what the code allocates on the CPU."""
    from attngen.distributed import rank_chunks
    from attngen.distributed.plan import ALIGNS, MaskRule, ring_plan

    heads_q, heads_kv = heads
    chunks = rank_chunks(seq_len, world, layout)
    lengths = [sum(c.length for c in r) for r in chunks]
    group_kv = -(-heads_kv // groups)
    group_q = group_kv * (heads_q // heads_kv)
    mine = lengths[rank]

    def kv(step: int) -> int:  # elements of the group's K and V (or dK, dV) of step's shard
        return group_kv * lengths[(rank - step) % world] * 2 * head_dim

    def call(c) -> int:
        lse_copy = c.num_rows if c.num_rows != mine else 0
        rows_q = group_q * c.num_rows
        return (
            rows_q * head_dim * element_size
            + rows_q * 4
            + group_q * lse_copy * 4
            + (group_kv * c.num_keys * 2 * head_dim * element_size)
        )

    accumulator = 0 if element_size == 4 else group_q * mine * head_dim * 4
    peak = 0
    for step, calls in enumerate(ring_plan(MaskRule("causal"), chunks, ALIGNS)[rank]):
        grads = 4 * (kv(step) * (1 if step == 0 else 2) + (kv(step - 1) if step else 0))
        shards = element_size * (
            (kv(step + 1) if step + 1 < world else 0) + (kv(step) if step else 0)
        )
        partial = max((call(c) for c in calls), default=0)
        peak = max(peak, accumulator + grads + shards + partial)
    return peak
