"""Context parallelism on CUDA at real sizes (`pytest -m gpu`): Llama-3-8B heads (32/8, D 128,
bf16, causal) through kernels rendered with the derived configs.

One GPU: a one-process group (no communication) runs both strategies at N = 16384, checked
against the float64 reference on blocks of query rows (rows [a, a + m) of a causal sequence
against keys [0, a + m) are a bottom-right causal problem of their own, so the reference
needs m x N scores, not N x N), and the ring on one rank is bitwise the plain kernel, its
gradients too. Two GPUs (skipped with fewer): a spawned NCCL group at N = 131072, zigzag, ring
and all-gather, against the reference on row blocks and against the one-GPU kernel on the
whole sequence; and the backward: dq, dk, dv of both strategies against the one-GPU gradients
at N = 4096 and 131072, and at 4096 against the float64 reference (on the CPU, for the four
query heads of KV head 0: a GQA group is a problem of its own).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attngen.reference import compare_to_reference
from attngen.spec import specs_from_data
from tests import cp_head_groups_harness as head_groups
from tests.context_parallel_harness import free_port
from tests.runtime_harness import build_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

LLAMA = dict(
    archs=["sm90"], dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8, kernels=["prefill"]
)
SPECS = [
    dict(LLAMA, name="cp_llama", mask="causal", causal_align="bottom_right"),
    dict(LLAMA, name="cp_llama_full", mask="none"),
]
GOLDEN = specs_from_data(dict(LLAMA, name="golden", mask="causal", causal_align="bottom_right"))[0]
# Modules with gradient kernels, in a folder of their own: dispatch picks among forward
# modules by name, so the one-GPU gradient baseline must not find a forward-only one.
BACKWARD_SPECS = [dict(s, name=f"{s['name']}_train", backward=True) for s in SPECS]
GROUP_GOLDEN = specs_from_data(
    dict(
        LLAMA,
        name="golden_group",
        num_q_heads=4,
        num_kv_heads=1,
        mask="causal",
        causal_align="bottom_right",
    )
)[0]
BLOCK_ROWS = 128


def llama_inputs(seq_len: int, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(1, 32, seq_len, 128), (1, 8, seq_len, 128), (1, 8, seq_len, 128)]
    return [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for s in shapes]


def block_problems(out, lse, q, k, v) -> list[str]:
    """The reference check on row blocks at the start, the middle and the end."""
    seq_len = q.shape[2]
    problems = []
    for start in (0, seq_len // 2 - BLOCK_ROWS // 2, seq_len - BLOCK_ROWS):
        rows, keys = slice(start, start + BLOCK_ROWS), slice(0, start + BLOCK_ROWS)
        found = compare_to_reference(
            GOLDEN, out[:, :, rows], lse[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys]
        )
        problems += [f"rows [{start}, {start + BLOCK_ROWS}): {p}" for p in found]
    return problems


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("cp_llama"), SPECS)


@pytest.fixture()
def one_rank(llama_folder):
    from attngen.runtime import registry as registry_module
    from attngen.runtime.registry import load_kernels

    saved = registry_module._current
    load_kernels(llama_folder, replace=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    registry_module._current = saved


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_one_gpu_matches_reference_on_row_blocks(one_rank, strategy, layout):
    from attngen.distributed import context_parallel_attention, last_plan

    q, k, v = llama_inputs(16384, "cuda")
    out, lse = context_parallel_attention(
        q, k, v, causal=True, layout=layout, strategy=strategy, return_lse=True
    )
    assert last_plan().strategy == strategy
    assert block_problems(out, lse, q, k, v) == []


def test_one_rank_ring_is_the_plain_kernel_bitwise(one_rank):
    import attngen
    from attngen.distributed import context_parallel_attention

    q, k, v = llama_inputs(8192, "cuda", seed=1)
    out = context_parallel_attention(q, k, v, causal=True, strategy="ring")
    assert torch.equal(
        out, attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )


def test_triton_merge_matches_torch_merge_on_cuda():
    from attngen.distributed.merge import merge_torch, merge_triton

    gen = torch.Generator(device="cuda").manual_seed(2)
    parts = [
        (
            torch.randn(2, 32, 4099, 128, generator=gen, device="cuda").bfloat16(),
            torch.randn(2, 32, 4099, generator=gen, device="cuda") * 5,
        )
        for _ in range(3)
    ]
    parts[1][1][:, :, :100] = float("-inf")  # rows a partial never reached
    results = []
    for merge in (merge_torch, merge_triton):
        acc = torch.zeros(2, 32, 4099, 128, device="cuda")
        acc_lse = torch.full((2, 32, 4099), float("-inf"), device="cuda")
        for out, lse in parts:
            merge(acc, acc_lse, out, lse)
        results.append((acc, acc_lse))
    (a, a_lse), (b, b_lse) = results
    # The same fp32 formula; the two may differ by FMA contraction: a few fp32 ulps of ~1.
    assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    assert torch.allclose(a_lse, b_lse, atol=1e-6, rtol=1e-6)


def two_gpu_worker(rank: int, port: int, folder: str, out_dir: str, seq_len: int) -> None:
    from attngen.distributed import context_parallel_attention, gather_sequence, shard_sequence
    from attngen.runtime.registry import load_kernels

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", rank),
    )
    load_kernels(Path(folder), replace=True)
    q, k, v = llama_inputs(seq_len, "cuda", seed=3)
    shards = [shard_sequence(t, 2, rank, layout="zigzag") for t in (q, k, v)]
    report = {}
    single = None
    if rank == 0:
        import attngen

        single = attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for strategy in ("ring", "allgather"):
        out, lse = context_parallel_attention(
            *shards, causal=True, strategy=strategy, return_lse=True
        )
        full = gather_sequence(out, layout="zigzag")
        full_lse = gather_sequence(lse[..., None], layout="zigzag")[..., 0]
        if rank == 0:
            report[strategy] = {
                "problems": block_problems(full, full_lse, q, k, v),
                "max_diff_vs_one_gpu": (full.float() - single.float()).abs().max().item(),
            }
    del single
    report["head_groups"] = ring_head_groups_report(shards)
    dist.destroy_process_group()
    if rank == 0:
        Path(out_dir, "two_gpu.json").write_text(json.dumps(report))


def ring_head_groups_report(shards) -> dict:
    """The ring in one group and in eight (one KV head each) on this rank: whether the results
    are the same bytes, and the memory each call allocates beyond its inputs at its peak."""
    from attngen.distributed import context_parallel_attention

    results, extra = [], []
    for groups in (1, 8):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        results.append(
            context_parallel_attention(
                *shards, causal=True, strategy="ring", return_lse=True, ring_head_groups=groups
            )
        )
        torch.cuda.synchronize()
        extra.append(torch.cuda.max_memory_allocated() - before)
    (out_1, lse_1), (out_8, lse_8) = results
    return {
        "bitwise": torch.equal(out_1, out_8) and torch.equal(lse_1, lse_8),
        "peak_extra_bytes": extra,
        "output_bytes": out_1.numel() * out_1.element_size(),
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_match_reference_at_128k(llama_folder, tmp_path):
    context = mp.spawn(
        two_gpu_worker,
        args=(free_port(), str(llama_folder), str(tmp_path), 131072),
        nprocs=2,
        join=False,
    )
    deadline = time.monotonic() + 600
    while not context.join(timeout=1):
        assert time.monotonic() < deadline, "the two-GPU group did not finish in 600 s"
    report = json.loads((tmp_path / "two_gpu.json").read_text())
    groups = report.pop("head_groups")
    assert groups["bitwise"], groups
    # One group: out (512 MiB), its fp32 accumulator (1 GiB), K/V in flight and partials;
    # eight: out and an eighth of the rest.
    one, eight = groups["peak_extra_bytes"]
    assert eight <= groups["output_bytes"] + (one - groups["output_bytes"]) / 4, groups
    for strategy, result in report.items():
        assert result["problems"] == [], strategy
        # Merging bf16 partials in fp32 differs from the one-kernel result by output
        # roundings: a few bf16 ulps at |out| < 1 (2**-8 each).
        assert result["max_diff_vs_one_gpu"] <= 4 * 2**-8, (strategy, result)


# ------------------------------------------------------------------------------- backward


@pytest.fixture(scope="module")
def llama_backward_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("cp_llama_train"), BACKWARD_SPECS)


def one_gpu_gradients(q, k, v, dout):
    import attngen

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attngen.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    return torch.autograd.grad(out, leaves, dout)


def test_one_rank_ring_gradients_are_the_plain_kernels_bitwise(llama_backward_folder):
    from attngen.distributed import context_parallel_attention
    from attngen.runtime import registry as registry_module
    from attngen.runtime.registry import load_kernels

    saved = registry_module._current
    load_kernels(llama_backward_folder, replace=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        q, k, v = llama_inputs(8192, "cuda", seed=6)
        dout = llama_inputs(8192, "cuda", seed=7)[0]
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*leaves, causal=True, strategy="ring")
        grads = torch.autograd.grad(out, leaves, dout)
        for name, got, expected in zip("qkv", grads, one_gpu_gradients(q, k, v, dout), strict=True):
            assert torch.equal(got, expected), name
    finally:
        dist.destroy_process_group()
        registry_module._current = saved


def two_gpu_backward_worker(
    rank: int, port: int, folder: str, out_dir: str, seq_lens: list[int]
) -> None:
    from attngen.distributed import context_parallel_attention, gather_sequence, shard_sequence
    from attngen.reference.backward import compare_gradients
    from attngen.runtime.registry import load_kernels

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", rank),
    )
    load_kernels(Path(folder), replace=True)
    report = {}
    for seq_len in seq_lens:
        q, k, v = llama_inputs(seq_len, "cuda", seed=4)
        dout = llama_inputs(seq_len, "cuda", seed=5)[0]
        single = one_gpu_gradients(q, k, v, dout) if rank == 0 else None
        shards = [shard_sequence(t, 2, rank, layout="zigzag") for t in (q, k, v, dout)]
        for strategy in ("ring", "allgather"):
            leaves = [t.detach().requires_grad_() for t in shards[:3]]
            out = context_parallel_attention(*leaves, causal=True, strategy=strategy)
            grads = torch.autograd.grad(out, leaves, shards[3])
            full = [gather_sequence(g, layout="zigzag") for g in grads]
            if rank != 0:
                continue
            entry = {
                "max_diff_vs_one_gpu": {
                    name: [(g.float() - s.float()).abs().max().item(), s.float().abs().max().item()]
                    for name, g, s in zip(("dq", "dk", "dv"), full, single, strict=True)
                }
            }
            if seq_len <= 4096:  # KV head 0 and its four query heads, on the CPU
                group = [full[0][:, :4], full[1][:, :1], full[2][:, :1]]
                entry["problems"] = compare_gradients(
                    GROUP_GOLDEN,
                    [g.cpu() for g in group],
                    q[:, :4].cpu(),
                    k[:, :1].cpu(),
                    v[:, :1].cpu(),
                    dout[:, :4].cpu(),
                )
            report[f"{strategy}_{seq_len}"] = entry
        q = k = v = dout = single = shards = None
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    if rank == 0:
        Path(out_dir, "two_gpu_backward.json").write_text(json.dumps(report))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_gradients_match_one_gpu_and_the_reference(llama_backward_folder, tmp_path):
    context = mp.spawn(
        two_gpu_backward_worker,
        args=(free_port(), str(llama_backward_folder), str(tmp_path), [4096, 131072]),
        nprocs=2,
        join=False,
    )
    deadline = time.monotonic() + 600
    while not context.join(timeout=1):
        assert time.monotonic() < deadline, "the two-GPU group did not finish in 600 s"
    report = json.loads((tmp_path / "two_gpu_backward.json").read_text())
    assert len(report) == 4, report
    for run, result in report.items():
        assert result.get("problems", []) == [], (run, result)
        for name, (diff, magnitude) in result["max_diff_vs_one_gpu"].items():
            # Each rank's share of a gradient comes as two bf16-rounded partials (one per ring
            # step or chunk pair) summed in fp32 and rounded once, against one rounding on one
            # GPU: at most about three bf16 roundings (2**-9 relative each) of the partials'
            # magnitude, which is the gradient's here (random inputs, no cancellation).
            assert diff <= 4 * 2**-8 * magnitude, (run, name, diff, magnitude)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_backward_head_groups_are_bitwise_and_divide_its_memory(
    llama_backward_folder, tmp_path
):
    """The ring's backward on two GPUs (NCCL) at N = 131072 in 1, 2 and 8 groups of KV heads
    (tests/cp_head_groups_harness.py, the worker the gloo test runs on the CPU): the same
    gradients bit for bit, and each rank's peak beyond its gradients within the memory
    model (tools/cp_bench_setup.py, exact on the CPU) and shrinking as 1 / groups."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from cp_bench_setup import ring_backward_peak

    seq_len, groups = 131072, [1, 2, 8]
    config = dict(
        backend="nccl",
        seq_len=seq_len,
        heads=(32, 8),
        head_dim=128,
        dtype="bfloat16",
        groups=groups,
    )
    context = mp.spawn(
        head_groups.worker,
        args=(2, free_port(), str(llama_backward_folder), str(tmp_path), config),
        nprocs=2,
        join=False,
    )
    deadline = time.monotonic() + 600
    while not context.join(timeout=1):
        assert time.monotonic() < deadline, "the two-GPU group did not finish in 600 s"
    report = json.loads((tmp_path / "head_groups_w2.json").read_text())
    assert report["bitwise"] and report["planned"] == groups, report
    for rank, peaks in enumerate(report["peaks"]):
        extra = [peak - report["gradient_bytes"] for peak in peaks]
        model = [ring_backward_peak(seq_len, 2, rank, (32, 8), 128, 2, g) for g in groups]
        # The caching allocator rounds each block up (512 B, 2 MiB for large ones' segments
        # do not count: allocated bytes): within 5% and 8 MiB of the model.
        for got, expected in zip(extra, model, strict=True):
            assert abs(got - expected) <= 0.05 * expected + 2**23, (rank, extra, model)
        assert extra[2] <= extra[0] / 8 * 1.1 + 2**23, (rank, extra)
