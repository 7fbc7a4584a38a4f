"""Context-parallel training benchmark: forward + backward of attngen.distributed against one
GPU and PyTorch's own context parallelism, D 128, bf16, causal, zigzag, MHA (32 heads) and
GQA (Llama-3-8B's 32 / 8; --heads picks, default both).

One process (python tools/bench_context_parallel_backward.py --out DIR):
    single  forward + backward of the full-sequence module (through the runtime's autograd)
            against context_parallel_attention on a one-rank group (ring and all-gather): the
            planning, dispatch and fp32 accumulation overhead of the backward;
    steps   one zigzag ring step's backward when W ranks share N tokens: the gradient kernels
            of the causal call on the own shard (step 0) and of the unmasked call of a later
            step (L queries, L / 2 keys), and the bytes a step sends (K/V in the input dtype,
            dK/dV in fp32): the numbers a scaling note for training needs.
Two processes (torchrun --nproc-per-node 2 tools/bench_context_parallel_backward.py --out DIR):
    multi   per heads and N: forward + backward of attngen on one GPU, attngen ring and
            all-gather on both (zigzag; the ring's backward in the plan's groups of KV heads),
            and torch.distributed.tensor.experimental.context_parallel over SDPA's cuDNN and
            FlashAttention-2 backends (K/V expanded to Hq heads), each rank's gradients
            checked against the one-GPU gradients; and each run's memory: the inputs it needs
            (one GPU: q, k, v, dO of the sequence; a rank: its shards) plus the most it
            allocated beyond them (max_memory_allocated), the slowest rank's.
Times are medians of forward + backward (tools/cp_bench_setup.py's time_ms: after a
barrier, the slowest rank). The JSON under --out is rewritten after every row (a run cut by
its time limit keeps what it finished); the table is printed last. `--smoke` runs on the CPU
under Triton's interpreter at toy sizes (fp32, D 16, heads 4/4 and 4/2; gloo under torchrun)
to check the script. Modules are built with `backward: true` (the tuning database's forward
configs apply: its key ignores that field).

    bash tools/gpu_session.sh OUT cp_bwd_bench:590      (two GPUs, both head shapes)
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_context_parallel as fwd  # noqa: E402  (tools/ is not a package)
import cp_bench_setup as harness  # noqa: E402


def parse_args():
    parser = harness.argument_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--heads",
        type=parse_heads,
        default=None,
        help="comma-separated Hq/Hkv (default 32/32,32/8; --smoke: 4/4,4/2)",
    )
    return parser.parse_args()


def parse_heads(text: str) -> list[tuple[int, int]]:
    """ "32/32,32/8" -> [(32, 32), (32, 8)]; Hq a multiple of Hkv."""
    import argparse

    shapes = []
    for item in text.split(","):
        try:
            heads_q, heads_kv = (int(x) for x in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected Hq/Hkv, e.g. 32/8") from None
        if heads_kv < 1 or heads_q % heads_kv:
            raise argparse.ArgumentTypeError(f"{item!r}: Hq must be a multiple of Hkv >= 1")
        shapes.append((heads_q, heads_kv))
    return shapes


def causal_grads(q, k, v, dout):
    """The whole sequence's forward + backward on one device, through the runtime."""
    import torch

    import attngen

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attngen.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    return torch.autograd.grad(out, leaves, dout)


def cp_grads(shards, dout_shard, strategy):
    import torch

    from attngen.distributed import context_parallel_attention

    leaves = [t.detach().requires_grad_() for t in shards]
    out = context_parallel_attention(*leaves, causal=True, strategy=strategy)
    return torch.autograd.grad(out, leaves, dout_shard)


def bench_single(setup, budget: float) -> list[dict]:
    rows = []
    for seq_len in setup.seqlens:
        q, k, v = setup.inputs(seq_len)
        dout = setup.inputs(seq_len, seed=1)[0]
        row = {
            "N": seq_len,
            "full_ms": harness.time_ms(setup, partial(causal_grads, q, k, v, dout), budget),
        }
        for strategy in ("ring", "allgather"):
            row[f"{strategy}_ms"] = harness.time_ms(
                setup, partial(cp_grads, (q, k, v), dout, strategy), budget
            )
        # Forward 2 B Hq N^2 D (causal), backward 2.5 times that.
        row["full_tflops"] = 3.5 * setup.causal_flops(seq_len) / row["full_ms"] / 1e9
        rows.append(row)
    return rows


def bench_steps(setup, worlds, budget: float) -> list[dict]:
    """A zigzag ring step's gradient kernels on this GPU, with the forward's out and LSE."""
    import torch

    rows = []
    for seq_len in setup.seqlens:
        for world in worlds:
            rows.append(step_row(setup, seq_len, world, budget))
            if setup.device.type == "cuda":  # the step's tensors are freed: before the next,
                torch.cuda.empty_cache()  # larger inputs
    return rows


def step_row(setup, seq_len: int, world: int, budget: float) -> dict:
    """bench_steps' row of N = seq_len tokens over W = world ranks."""
    from attngen.runtime.dispatch import Call
    from attngen.runtime.launch import run_dense, run_dense_backward
    from attngen.spec import CausalAlign, Mask

    local = seq_len // world
    q, k, v = setup.inputs(local, seed=world)
    dout = setup.inputs(local, seed=world + 1)[0]
    options = dict(window=None, softcap=0.0, alibi_slopes=None, scale=None)
    row = {
        "N": seq_len,
        "W": world,
        "L": local,
        "kv_bytes_per_step": 2 * k.numel() * k.element_size(),
        "dkv_bytes_per_step": 2 * k.numel() * 4,
    }
    for name, mask, keys in (
        ("step0_causal_bwd_ms", Mask.causal, local),
        ("step_full_bwd_ms", Mask.none, local // 2),
    ):
        align = CausalAlign.bottom_right if mask is Mask.causal else None
        kk, vv = k[:, :, :keys], v[:, :, :keys]
        call = Call(mask=mask, align=align, return_lse=True, fallback=None, **options)
        out, lse = run_dense("bench", q, kk, vv, call)
        row[name] = harness.time_ms(
            setup,
            partial(run_dense_backward, "bench", dout, q, kk, vv, out, lse, None, call),
            budget,
        )
    step_flops = 2.5 * 4.0 * setup.batch * setup.heads_q * local * (local // 2) * setup.head_dim
    row["step_full_bwd_tflops"] = step_flops / row["step_full_bwd_ms"] / 1e9
    # The link bandwidth at which a step's transfers (K/V ahead, dK/dV behind) take as
    # long as its gradient kernels.
    row["hiding_bandwidth_gbs"] = (
        (row["kv_bytes_per_step"] + row["dkv_bytes_per_step"]) / row["step_full_bwd_ms"] / 1e6
    )
    return row


def bench_multi(setup, budget: float, torch_cp: bool, heads, save) -> list[dict]:
    """One row per (heads, N), each saved (`save(rows)`) as soon as it is measured."""
    rows: list[dict] = []
    for heads_q, heads_kv in heads:
        setup.heads_q, setup.heads_kv = heads_q, heads_kv
        harness.load_kernels_for(setup, backward=True)  # the modules of these heads
        for seq_len in setup.seqlens:
            rows.append(multi_row(setup, seq_len, budget, torch_cp))
            save(rows)
            if setup.rank == 0:  # a run cut by its time limit still shows the rows it finished
                print(json.dumps(rows[-1]), flush=True)
    return rows


def multi_row(setup, seq_len: int, budget: float, torch_cp: bool) -> dict:
    from attngen.distributed import gather_sequence, last_plan, shard_sequence

    q, k, v = setup.inputs(seq_len)  # the same seed on every rank: the same tensors
    dout = setup.inputs(seq_len, seed=1)[0]
    row = {"heads": f"{setup.heads_q}/{setup.heads_kv}", "N": seq_len}
    single, row["one_gpu_ms"], peak = measure(setup, partial(causal_grads, q, k, v, dout), budget)
    row["one_gpu_bytes"] = nbytes(q, k, v, dout) + peak
    shards = [shard_sequence(t, setup.world, setup.rank, layout="zigzag") for t in (q, k, v, dout)]
    for strategy in ("ring", "allgather"):
        run = partial(cp_grads, shards[:3], shards[3], strategy)
        grads, row[f"attngen_{strategy}_ms"], peak = measure(setup, run, budget)
        row[f"attngen_{strategy}_bytes"] = slowest(setup, nbytes(*shards) + peak)
        if strategy == "ring":
            row["ring_backward_head_groups"] = last_plan().backward_head_groups
        full = [gather_sequence(g) for g in grads]
        row[f"attngen_{strategy}_max_diff"] = max_diffs(full, single)
        grads = full = None
    shards = None
    if torch_cp:
        for backend in ("cudnn", "flash"):
            row.update(bench_torch_cp(setup, q, k, v, dout, single, backend, budget))
    return row


def measure(setup, fn, budget: float):
    """(fn()'s result of the last repeat, its median ms, the most it allocated on this device
    beyond what existed before: on the CPU 0)."""
    import torch

    kept: list = []

    def run():
        kept.clear()  # the previous repeat's result is freed before the next runs
        kept.append(fn())

    cuda = setup.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(setup.device)
        before = torch.cuda.memory_allocated(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)
    ms = harness.time_ms(setup, run, budget)
    peak = torch.cuda.max_memory_allocated(setup.device) - before if cuda else 0
    return kept[0], ms, peak


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def slowest(setup, value: int) -> int:
    """The largest value over the ranks."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([value], dtype=torch.int64, device=setup.device)
    if setup.world > 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine.item())


def max_diffs(grads, single) -> dict:
    """max |grad - one GPU's grad| and max |one GPU's grad|, per gradient."""
    return {
        name: [(g.float() - s.float()).abs().max().item(), s.float().abs().max().item()]
        for name, g, s in zip(("dq", "dk", "dv"), grads, single, strict=True)
    }


def bench_torch_cp(setup, q, k, v, dout, single, backend: str, budget: float) -> dict:
    """PyTorch's context parallelism, forward + backward over one SDPA backend: K/V expanded
    to Hq heads (its ring has no GQA), dO sharded with the inputs; the gradients unsharded,
    the K/V ones summed over each KV group, and compared with one GPU's."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    group = setup.heads_q // setup.heads_kv
    buffers = [
        q.clone(),
        k.repeat_interleave(group, 1),
        v.repeat_interleave(group, 1),
        dout.clone(),
    ]
    result = {}
    try:  # an API that moved between torch versions is recorded as an error, not a crash
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        if setup.mesh is None:
            setup.mesh = init_device_mesh(setup.device.type, (setup.world,))
        with (
            sdpa_kernel([backends[backend]]),
            context_parallel(
                setup.mesh,
                buffers=buffers,
                buffer_seq_dims=[2] * 4,
                no_restore_buffers=set(buffers),
            ),
        ):
            qt, kt, vt, dt = buffers  # this rank's shards now (sharded in place)

            def step():
                leaves = [t.detach().requires_grad_() for t in (qt, kt, vt)]
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
                return torch.autograd.grad(out, leaves, dt)

            grads, result[f"torch_{backend}_ms"], peak = measure(setup, step, budget)
            result[f"torch_{backend}_bytes"] = slowest(setup, nbytes(qt, kt, vt, dt) + peak)
            grads = context_parallel_unshard(setup.mesh, list(grads), [2, 2, 2])
        grads = [grads[0]] + [
            g.reshape(g.shape[0], -1, group, *g.shape[2:]).sum(2) for g in grads[1:]
        ]
        result[f"torch_{backend}_max_diff"] = max_diffs(grads, single)
    except Exception as err:  # recorded: a backend PyTorch cannot run here is a result too
        result[f"torch_{backend}_error"] = f"{type(err).__name__}: {err}"[:300]
    buffers = grads = None
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def table(results: dict) -> str:
    lines = []
    if results.get("single"):
        lines += [
            "forward + backward",
            "| N | full ms | TFLOP/s | CP ring, 1 rank | CP all-gather, 1 rank |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['N']} | {r['full_ms']:.2f} | {r['full_tflops']:.0f} | "
            f"{r['ring_ms']:.2f} | {r['allgather_ms']:.2f} |"
            for r in results["single"]
        ]
    if results.get("steps"):
        lines += [
            "",
            "| N | W | L | step 0 causal bwd ms | later step bwd ms | TFLOP/s | "
            "K/V + dK/dV MB/step | hiding GB/s |",
            "|---" * 8 + "|",
        ]
        lines += [
            f"| {r['N']} | {r['W']} | {r['L']} | {r['step0_causal_bwd_ms']:.2f} | "
            f"{r['step_full_bwd_ms']:.2f} | {r['step_full_bwd_tflops']:.0f} | "
            f"{(r['kv_bytes_per_step'] + r['dkv_bytes_per_step']) / 1e6:.1f} | "
            f"{r['hiding_bandwidth_gbs']:.1f} |"
            for r in results["steps"]
        ]
    if results.get("multi"):
        world = results["env"]["world_size"]
        lines += [
            "",
            f"forward + backward, {world} GPUs, zigzag; (x): speed-up over one GPU; "
            "best / X: PyTorch's time over attngen's better strategy; memory: a rank's "
            "inputs and peak over one GPU's (G: the ring's backward head groups)",
            "| heads | N | 1 GPU ms | ring ms (x) | all-gather ms (x) | torch cuDNN ms | "
            "torch FA2 ms | best / cuDNN | best / FA2 | ring mem (G) | all-gather mem |",
            "|---" * 11 + "|",
        ]
        lines += [memory_line(r) for r in results["multi"]]
    return "\n".join(lines)


def memory_line(r: dict) -> str:
    """forward's multi_line with the heads before it and the memory ratios after it."""
    one = r["one_gpu_bytes"]
    ratios = [
        f"{r[f'attngen_{s}_bytes'] / one:.2f}" if one and r.get(f"attngen_{s}_bytes") else "-"
        for s in ("ring", "allgather")
    ]
    ratios[0] += f" ({r.get('ring_backward_head_groups', '?')})"
    return f"| {r['heads']} " + fwd.multi_line(r) + f" {ratios[0]} | {ratios[1]} |"


def main() -> None:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything defines a Triton kernel
    import torch.distributed as dist

    setup = harness.Setup(args)
    arch = harness.load_kernels_for(setup, backward=True)
    results = {"env": {**harness.environment(setup, arch), "pass": "forward + backward"}}
    kind = "single" if setup.world == 1 else f"{setup.world}gpu"
    path = args.out / (f"bench_context_parallel_backward_{kind}_{results['env']['date']}.json")

    def save(rows=None) -> None:
        if rows is not None:
            results["multi"] = rows
        if setup.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1))

    if setup.world == 1:
        results["single"] = bench_single(setup, args.budget)
        results["steps"] = bench_steps(setup, args.worlds, args.budget)
    else:
        heads = args.heads or ([(4, 4), (4, 2)] if args.smoke else [(32, 32), (32, 8)])
        bench_multi(setup, args.budget, not args.no_torch_cp, heads, save)
    save()
    if setup.rank == 0:
        print(f"wrote {path}")
        print(table(results))
    if setup.world > 1:
        dist.barrier()  # every rank leaves together, after rank 0 wrote the results
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
