"""The ring's backward in groups of KV heads, run by a spawned process group: the same worker
runs with gloo on the CPU (tests/test_context_parallel.py, toy fp32 kernels) and with NCCL
on two GPUs (tests/test_context_parallel_gpu.py, Llama-3-8B heads in bf16).

For each group count, every rank runs the zigzag causal ring's forward, then its backward
while measuring the memory the backward allocates beyond what existed before it (its
gradients included): on CUDA the allocator's peak (max_memory_allocated), on the CPU the
peak of the bytes of live storages that torch ops create (`LiveBytes`: every op's output
whose storage is new, until its last tensor dies). The first rank writes
head_groups_w<W>.json: whether every group count's gradients are the first's bit for bit,
each rank's peak per group count, the gradients' bytes and the backward's groups as the plan
recorded them.
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """The bytes of storages created by torch ops inside the mode and still alive, and their
    peak. An output that shares storage with an input (a view, an in-place op, set_) is not
    new memory; storages made before the mode are not counted."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr and ptr not in given and ptr not in self.live:
                self.live[ptr] = t.untyped_storage().nbytes()
                self.now += self.live[ptr]
                self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.now -= self.live.pop(ptr, 0)


def measured(fn, device: torch.device):
    """(fn(), the bytes allocated at its peak beyond those before it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    with LiveBytes() as live:
        result = fn()
    return result, live.peak


def inputs(seq_len: int, heads: tuple[int, int], head_dim: int, dtype, device, seed=0):
    """q, k, v and dO of the whole sequence (the same on every rank: the same seed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(1, h, seq_len, head_dim) for h in (heads[0], heads[1], heads[1], heads[0])]
    return [torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes]


def worker(rank: int, world: int, port: int, folder: str, out_dir: str, config: dict) -> None:
    """config: backend, seq_len, heads (Hq, Hkv), head_dim, dtype ("float32", "bfloat16"),
    groups (the group counts, the first is the baseline)."""
    if config["backend"] == "gloo":
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        torch.set_num_threads(1)
        from tests import interpreter_bf16

        interpreter_bf16.install()  # bf16 math under the interpreter, as conftest does
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    import torch.distributed as dist

    from attngen.distributed import context_parallel_attention, last_plan, shard_sequence
    from attngen.runtime.registry import load_kernels

    options = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        config["backend"],
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        **options,
    )
    load_kernels(Path(folder), replace=True)
    dtype = getattr(torch, config["dtype"])
    full = inputs(config["seq_len"], tuple(config["heads"]), config["head_dim"], dtype, device)
    shards = [shard_sequence(t, world, rank, layout="zigzag") for t in full]
    del full
    first, bitwise, peaks, planned = None, True, [], []
    for groups in config["groups"]:
        leaves = [t.detach().requires_grad_() for t in shards[:3]]
        out = context_parallel_attention(
            *leaves,
            causal=True,
            strategy="ring",
            seq_len=config["seq_len"],
            ring_head_groups=groups,
        )
        planned.append(last_plan().backward_head_groups)
        backward = functools.partial(torch.autograd.grad, out, leaves, shards[3])
        grads, peak = measured(backward, device)
        del backward
        peaks.append(peak)
        if first is None:
            first = grads
        else:
            bitwise = bitwise and all(torch.equal(a, b) for a, b in zip(first, grads, strict=True))
        del out, leaves, grads
    every = [None] * world
    dist.all_gather_object(every, {"peaks": peaks, "bitwise": bitwise})
    if rank == 0:
        report = {
            "groups": config["groups"],
            "planned": planned,
            "bitwise": all(r["bitwise"] for r in every),
            "peaks": [r["peaks"] for r in every],  # [rank][group count]
            "gradient_bytes": sum(g.numel() * g.element_size() for g in first),
        }
        Path(out_dir, f"head_groups_w{world}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
