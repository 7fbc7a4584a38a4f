"""Context-parallel benchmark: attngen.distributed against one GPU and PyTorch's own context
parallelism, Llama-3-8B heads (32/8, D 128, bf16, causal) by default.

One process (python tools/bench_context_parallel.py --out DIR):
    single  the full-sequence kernel against context_parallel_attention on a one-rank group
            (ring and all-gather): the planning, dispatch and merge overhead;
    steps   what one ring step costs when W ranks share N tokens (zigzag, W = 2, 4, 8): the
            causal call on the own shard (step 0), the unmasked call of a later step, the LSE
            merge in torch and in Triton, and the K/V bytes a step sends: the numbers the
            scaling note of docs/context_parallel.md is computed from.
Two processes (torchrun --nproc-per-node 2 tools/bench_context_parallel.py --out DIR):
    multi   per N: attngen on one GPU, attngen ring and all-gather on both (zigzag), and
            torch.distributed.tensor.experimental.context_parallel over SDPA's cuDNN and
            FlashAttention-2 backends (K/V expanded to 32 heads: its ring has no GQA),
            each checked against the one-GPU output.
Times are medians over repeats, each started after a barrier and taken as the slowest rank.
Prints a table last and writes JSON to --out. `--smoke` runs the one-process path on the CPU
under Triton's interpreter at toy sizes (fp32, D 16) to check that the script works.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TUNING = ROOT / "tuning"
GPU_SEQLENS = (32768, 65536, 131072, 262144)


def parse_args():
    return argument_parser(__doc__.split("\n")[0]).parse_args()


def argument_parser(description: str) -> argparse.ArgumentParser:
    """The options of this benchmark and of bench_context_parallel_backward.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")],
                        default=None, help="comma-separated N (default 32k,64k,128k,256k)")
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2, 4, 8], help="W for the per-step section")
    parser.add_argument("--budget", type=float, default=3.0,
                        help="seconds of repeats per measurement (at least 3 repeats)")
    parser.add_argument("--no-torch-cp", action="store_true",
                        help="skip PyTorch's context parallelism in the two-GPU run")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton interpreter, toy sizes: checks the script runs")
    return parser


class Setup:
    """The shapes, device and process group of this run."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.smoke = args.smoke
        self.dtype = torch.float32 if args.smoke else torch.bfloat16
        self.batch, self.heads_q, self.heads_kv, self.head_dim = (
            (1, 4, 2, 16) if args.smoke else (1, 32, 8, 128))
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
            (self.batch, self.heads_kv, seq_len, self.head_dim)]
        return [torch.randn(s, generator=gen, device=self.device, dtype=self.dtype)
                for s in shapes]

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
    common = dict(archs=[arch], dtype="fp32" if setup.smoke else "bf16",
                  head_dim=setup.head_dim, num_q_heads=setup.heads_q,
                  num_kv_heads=setup.heads_kv, kernels=["prefill"], backward=backward)
    specs = [s for data in (dict(common, name="cp_causal", mask="causal",
                                 causal_align="bottom_right"),
                            dict(common, name="cp_full", mask="none"))
             for s in specs_from_data(data)]
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


def bench_single(setup: Setup, budget: float) -> list[dict]:
    import attngen
    from attngen.distributed import context_parallel_attention

    rows = []
    for seq_len in setup.seqlens:
        q, k, v = setup.inputs(seq_len)
        full = partial(attngen.scaled_dot_product_attention, q, k, v, is_causal=True,
                       enable_gqa=True)
        row = {"N": seq_len, "full_ms": time_ms(setup, full, budget)}
        for strategy in ("ring", "allgather"):
            row[f"{strategy}_ms"] = time_ms(setup, partial(
                context_parallel_attention, q, k, v, causal=True, strategy=strategy), budget)
        row["full_tflops"] = setup.causal_flops(seq_len) / row["full_ms"] / 1e9
        rows.append(row)
    return rows


def bench_steps(setup: Setup, worlds, budget: float) -> list[dict]:
    """One zigzag ring step of W ranks, on this GPU: step 0 is the causal call on the own
    shard (L = N / W tokens), a later step the unmasked call of L queries on L / 2 keys."""
    import torch

    from attngen.distributed.merge import merge_torch, merge_triton
    from attngen.runtime.launch import run_dense
    from attngen.spec import CausalAlign, Mask

    rows = []
    for seq_len in setup.seqlens:
        for world in worlds:
            local = seq_len // world
            q, k, v = setup.inputs(local, seed=world)
            kwargs = dict(softcap=0.0, alibi_slopes=None, scale=None, return_lse=True,
                          fallback=None, window=None)
            step0 = partial(run_dense, "bench", q, k, v, mask=Mask.causal,
                            align=CausalAlign.bottom_right, **kwargs)
            later = partial(run_dense, "bench", q, k[:, :, :local // 2], v[:, :, :local // 2],
                            mask=Mask.none, align=None, **kwargs)
            row = {"N": seq_len, "W": world, "L": local,
                   "kv_bytes_per_step": 2 * k.numel() * k.element_size(),
                   "step0_causal_ms": time_ms(setup, step0, budget),
                   "step_full_ms": time_ms(setup, later, budget)}
            out, lse = later()
            acc, acc_lse = out.float(), lse.clone()
            merges = {"merge_torch_ms": merge_torch}
            if setup.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
                merges["merge_triton_ms"] = merge_triton
            for name, merge in merges.items():
                row[name] = time_ms(setup, partial(merge, acc, acc_lse, out, lse), budget)
            step_flops = 4.0 * setup.batch * setup.heads_q * local * (local // 2) * setup.head_dim
            row["step_full_tflops"] = step_flops / row["step_full_ms"] / 1e9
            # The link bandwidth at which a step's transfer takes as long as its kernel.
            row["hiding_bandwidth_gbs"] = row["kv_bytes_per_step"] / row["step_full_ms"] / 1e6
            rows.append(row)
            q = k = v = out = lse = acc = acc_lse = None  # freed before the next, larger inputs
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_multi(setup: Setup, budget: float, torch_cp: bool) -> list[dict]:
    """Per N: one GPU, attngen's two strategies over every GPU, PyTorch's context parallelism."""
    import attngen
    from attngen.distributed import context_parallel_attention, gather_sequence, shard_sequence

    rows = []
    for seq_len in setup.seqlens:
        q, k, v = setup.inputs(seq_len)  # the same seed on every rank: the same tensors
        one_gpu = partial(attngen.scaled_dot_product_attention, q, k, v, is_causal=True,
                          enable_gqa=True)
        single = one_gpu()
        row = {"N": seq_len, "one_gpu_ms": time_ms(setup, one_gpu, budget)}
        shards = [shard_sequence(t, setup.world, setup.rank, layout="zigzag") for t in (q, k, v)]
        for strategy in ("ring", "allgather"):
            run = partial(context_parallel_attention, *shards, causal=True, strategy=strategy)
            row[f"attngen_{strategy}_ms"] = time_ms(setup, run, budget)
            out = gather_sequence(run())
            row[f"attngen_{strategy}_max_diff"] = (out.float() - single.float()).abs().max().item()
            out = None
        shards = None
        if torch_cp:
            for backend in ("cudnn", "flash"):
                row.update(bench_torch_cp(setup, q, k, v, single, backend, budget))
        rows.append(row)
        q = k = v = single = None  # freed before the next, larger inputs
    return rows


def bench_torch_cp(setup: Setup, q, k, v, single, backend: str, budget: float) -> dict:
    """torch.distributed.tensor.experimental.context_parallel over one SDPA backend: K/V
    expanded to Hq heads (its ring attention has no GQA), load balancing on (the default for
    causal), its default K/V rotation; the output unsharded and compared with one GPU's."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    group = setup.heads_q // setup.heads_kv
    qt, kt, vt = q.clone(), k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    result = {}
    try:  # an API that moved between torch versions is recorded as an error, not a crash
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import (
            _cp_options,
            context_parallel_unshard,
        )

        result[f"torch_{backend}_rotate"] = str(_cp_options.rotate_method)
        if setup.mesh is None:  # one mesh (and its process group) for every measurement
            setup.mesh = init_device_mesh(setup.device.type, (setup.world,))
        mesh = setup.mesh
        with sdpa_kernel([backends[backend]]), context_parallel(
                mesh, buffers=[qt, kt, vt], buffer_seq_dims=[2, 2, 2],
                no_restore_buffers={qt, kt, vt}):
            run = partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=True)
            result[f"torch_{backend}_ms"] = time_ms(setup, run, budget)
            full = context_parallel_unshard(mesh, [run()], [2])[0]
        result[f"torch_{backend}_max_diff"] = (full.float() - single.float()).abs().max().item()
    except Exception as err:  # recorded: a backend PyTorch cannot run here is a result too
        result[f"torch_{backend}_error"] = f"{type(err).__name__}: {err}"[:300]
    qt = kt = vt = None
    torch.cuda.empty_cache()
    return result


def table(results: dict) -> str:
    lines = []
    if results.get("single"):
        lines += ["| N | full ms | TFLOP/s | CP ring, 1 rank | CP all-gather, 1 rank |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['N']} | {r['full_ms']:.2f} | {r['full_tflops']:.0f} | "
                  f"{r['ring_ms']:.2f} | {r['allgather_ms']:.2f} |" for r in results["single"]]
    if results.get("steps"):
        lines += ["", "| N | W | L | step 0 causal ms | later step ms | TFLOP/s | K/V MB/step | "
                  "hiding GB/s | merge torch ms | merge triton ms |", "|---" * 10 + "|"]
        for r in results["steps"]:
            triton_ms = f"{r['merge_triton_ms']:.3f}" if "merge_triton_ms" in r else "-"
            lines.append(f"| {r['N']} | {r['W']} | {r['L']} | {r['step0_causal_ms']:.2f} | "
                         f"{r['step_full_ms']:.2f} | {r['step_full_tflops']:.0f} | "
                         f"{r['kv_bytes_per_step'] / 1e6:.1f} | {r['hiding_bandwidth_gbs']:.1f} "
                         f"| {r['merge_torch_ms']:.3f} | {triton_ms} |")
    if results.get("multi"):
        world = results["env"]["world_size"]
        lines += ["", f"{world} GPUs, zigzag; (x): speed-up over one GPU; best / X: PyTorch's "
                  "time over attngen's better strategy",
                  "| N | 1 GPU ms | ring ms (x) | all-gather ms (x) | torch cuDNN ms | "
                  "torch FA2 ms | best / cuDNN | best / FA2 |", "|---" * 8 + "|"]
        for r in results["multi"]:
            lines.append(multi_line(r))
    return "\n".join(lines)


def multi_line(r: dict) -> str:
    one = r["one_gpu_ms"]
    best = min(r["attngen_ring_ms"], r["attngen_allgather_ms"])
    cells = [str(r["N"]), f"{one:.1f}",
             f"{r['attngen_ring_ms']:.1f} ({one / r['attngen_ring_ms']:.2f}x)",
             f"{r['attngen_allgather_ms']:.1f} ({one / r['attngen_allgather_ms']:.2f}x)"]
    for backend in ("cudnn", "flash"):
        ms = r.get(f"torch_{backend}_ms")
        cells.append(f"{ms:.1f}" if ms else "error" if f"torch_{backend}_error" in r else "-")
    for backend in ("cudnn", "flash"):
        ms = r.get(f"torch_{backend}_ms")
        cells.append(f"{ms / best:.2f}" if ms else "-")
    return "| " + " | ".join(cells) + " |"


def environment(setup: Setup, arch: str) -> dict:
    import torch
    import triton

    name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu"
    return {"device": name, "arch": arch, "world_size": setup.world, "torch": torch.__version__,
            "triton": triton.__version__, "date": datetime.date.today().isoformat(),
            "shape": {"batch": setup.batch, "heads_q": setup.heads_q,
                      "heads_kv": setup.heads_kv, "head_dim": setup.head_dim,
                      "dtype": str(setup.dtype), "mask": "causal"},
            "smoke": setup.smoke}


def main() -> None:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything defines a Triton kernel
    import torch
    import torch.distributed as dist

    setup = Setup(args)
    arch = load_kernels_for(setup)
    results = {"env": environment(setup, arch)}
    with torch.no_grad():
        if setup.world == 1:
            results["single"] = bench_single(setup, args.budget)
            results["steps"] = bench_steps(setup, args.worlds, args.budget)
        else:
            results["multi"] = bench_multi(setup, args.budget, not args.no_torch_cp)
    if setup.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        kind = "single" if setup.world == 1 else f"{setup.world}gpu"
        path = args.out / f"bench_context_parallel_{kind}_{results['env']['date']}.json"
        path.write_text(json.dumps(results, indent=1))
        print(f"wrote {path}")
        print(table(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
