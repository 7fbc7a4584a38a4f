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

import json
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cp_bench_setup import (  # noqa: E402  (tools/ is not a package)
    Setup,
    argument_parser,
    environment,
    load_kernels_for,
    time_ms,
)


def parse_args():
    return argument_parser(__doc__.split("\n")[0]).parse_args()


def bench_single(setup: Setup, budget: float) -> list[dict]:
    import attngen
    from attngen.distributed import context_parallel_attention

    rows = []
    for seq_len in setup.seqlens:
        q, k, v = setup.inputs(seq_len)
        full = partial(
            attngen.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True
        )
        row = {"N": seq_len, "full_ms": time_ms(setup, full, budget)}
        for strategy in ("ring", "allgather"):
            row[f"{strategy}_ms"] = time_ms(
                setup,
                partial(context_parallel_attention, q, k, v, causal=True, strategy=strategy),
                budget,
            )
        row["full_tflops"] = setup.causal_flops(seq_len) / row["full_ms"] / 1e9
        rows.append(row)
    return rows


def bench_steps(setup: Setup, worlds, budget: float) -> list[dict]:
    """One zigzag ring step of W ranks, on this GPU: step 0 is the causal call on the own
    shard (L = N / W tokens), a later step the unmasked call of L queries on L / 2 keys."""
    import torch

    rows = []
    for seq_len in setup.seqlens:
        for world in worlds:
            rows.append(step_row(setup, seq_len, world, budget))
            if setup.device.type == "cuda":  # the step's tensors are freed: before the next,
                torch.cuda.empty_cache()  # larger inputs
    return rows


def step_row(setup: Setup, seq_len: int, world: int, budget: float) -> dict:
    """bench_steps' row of N = seq_len tokens over W = world ranks."""
    from attngen.distributed.merge import merge_torch, merge_triton
    from attngen.runtime.dispatch import Call
    from attngen.runtime.launch import run_dense
    from attngen.spec import CausalAlign, Mask

    local = seq_len // world
    q, k, v = setup.inputs(local, seed=world)
    kwargs = dict(
        softcap=0.0, alibi_slopes=None, scale=None, return_lse=True, fallback=None, window=None
    )
    step0 = partial(
        run_dense,
        "bench",
        q,
        k,
        v,
        Call(mask=Mask.causal, align=CausalAlign.bottom_right, **kwargs),
    )
    later = partial(
        run_dense,
        "bench",
        q,
        k[:, :, : local // 2],
        v[:, :, : local // 2],
        Call(mask=Mask.none, align=None, **kwargs),
    )
    row = {
        "N": seq_len,
        "W": world,
        "L": local,
        "kv_bytes_per_step": 2 * k.numel() * k.element_size(),
        "step0_causal_ms": time_ms(setup, step0, budget),
        "step_full_ms": time_ms(setup, later, budget),
    }
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
    return row


def bench_multi(setup: Setup, budget: float, torch_cp: bool) -> list[dict]:
    """Per N: one GPU, attngen's two strategies over every GPU, PyTorch's context parallelism."""
    import attngen
    from attngen.distributed import context_parallel_attention, gather_sequence, shard_sequence

    rows = []
    for seq_len in setup.seqlens:
        q, k, v = setup.inputs(seq_len)  # the same seed on every rank: the same tensors
        one_gpu = partial(
            attngen.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True
        )
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
        with (
            sdpa_kernel([backends[backend]]),
            context_parallel(
                mesh,
                buffers=[qt, kt, vt],
                buffer_seq_dims=[2, 2, 2],
                no_restore_buffers={qt, kt, vt},
            ),
        ):
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
        lines += [
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
            "| N | W | L | step 0 causal ms | later step ms | TFLOP/s | K/V MB/step | "
            "hiding GB/s | merge torch ms | merge triton ms |",
            "|---" * 10 + "|",
        ]
        for r in results["steps"]:
            triton_ms = f"{r['merge_triton_ms']:.3f}" if "merge_triton_ms" in r else "-"
            lines.append(
                f"| {r['N']} | {r['W']} | {r['L']} | {r['step0_causal_ms']:.2f} | "
                f"{r['step_full_ms']:.2f} | {r['step_full_tflops']:.0f} | "
                f"{r['kv_bytes_per_step'] / 1e6:.1f} | {r['hiding_bandwidth_gbs']:.1f} "
                f"| {r['merge_torch_ms']:.3f} | {triton_ms} |"
            )
    if results.get("multi"):
        world = results["env"]["world_size"]
        lines += [
            "",
            f"{world} GPUs, zigzag; (x): speed-up over one GPU; best / X: PyTorch's "
            "time over attngen's better strategy",
            "| N | 1 GPU ms | ring ms (x) | all-gather ms (x) | torch cuDNN ms | "
            "torch FA2 ms | best / cuDNN | best / FA2 |",
            "|---" * 8 + "|",
        ]
        for r in results["multi"]:
            lines.append(multi_line(r))
    return "\n".join(lines)


def multi_line(r: dict) -> str:
    one = r["one_gpu_ms"]
    best = min(r["attngen_ring_ms"], r["attngen_allgather_ms"])
    cells = [
        str(r["N"]),
        f"{one:.1f}",
        f"{r['attngen_ring_ms']:.1f} ({one / r['attngen_ring_ms']:.2f}x)",
        f"{r['attngen_allgather_ms']:.1f} ({one / r['attngen_allgather_ms']:.2f}x)",
    ]
    for backend in ("cudnn", "flash"):
        ms = r.get(f"torch_{backend}_ms")
        cells.append(f"{ms:.1f}" if ms else "error" if f"torch_{backend}_error" in r else "-")
    for backend in ("cudnn", "flash"):
        ms = r.get(f"torch_{backend}_ms")
        cells.append(f"{ms / best:.2f}" if ms else "-")
    return "| " + " | ".join(cells) + " |"


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
