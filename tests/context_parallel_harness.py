"""Context-parallel test setup: toy fp32 kernels and cases run in a spawned gloo group.

One `torch.multiprocessing.spawn` of three processes runs every case in `CASES` on all three,
then on two of them (ranks 1 and 2 as a subgroup); spawning costs seconds, a case a fraction
of one. each process builds the full inputs from the case's
seed, takes its shard, calls context_parallel_attention and gathers the output; rank 0
compares it with the float64 reference on the whole sequence (attngen.reference, the rule of
shared/RELIABILITY.md) and writes one JSON line per case. Expected refusals are recorded as
the error's type and text.

TRITON_INTERPRET=1 is set before anything imports triton (the kernels are defined when the
registry loads them), so this module imports torch-side code only inside `worker`.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path

HEAD_DIM = 16
TOY_SPECS = [
    dict(name="cp_causal", mask="causal", causal_align="bottom_right"),
    dict(name="cp_none", mask="none"),
    dict(name="cp_win", mask="sliding_window", causal_align="bottom_right", window_left=5,
         window_right=0),
    dict(name="cp_win2", mask="sliding_window", causal_align="bottom_right", window_left=3,
         window_right=2),
    dict(name="cp_alibi", mask="causal", causal_align="bottom_right", alibi=True),
    dict(name="cp_cap", mask="causal", causal_align="bottom_right", softcap=5.0),
    dict(name="cp_alibi_none", mask="none", alibi=True),
]

# Each case: its layout and strategy, `extra` tokens past whole chunks (uneven lengths), the
# heads (Hq, Hkv), the mask arguments, `expect`: the strategy auto must choose, `refused`:
# {world size: the error's type name} where the call must be refused.
CASES = [
    dict(name="zigzag-causal-ring-gqa-uneven", layout="zigzag", strategy="ring", extra=1,
         heads=(2, 1), causal=True),
    dict(name="zigzag-causal-allgather-gqa", layout="zigzag", strategy="allgather", extra=0,
         heads=(2, 1), causal=True, return_lse=True),
    dict(name="contiguous-causal-ring-uneven", layout="contiguous", strategy="ring", extra=2,
         heads=(2, 2), causal=True, return_lse=True),
    dict(name="contiguous-none-ring-gqa", layout="contiguous", strategy="ring", extra=0,
         heads=(2, 1)),
    dict(name="zigzag-none-allgather-uneven", layout="zigzag", strategy="allgather", extra=3,
         heads=(2, 2)),
    dict(name="zigzag-window-auto-uneven", layout="zigzag", strategy="auto", extra=1,
         heads=(2, 1), window=(5, 0), expect="allgather", return_lse=True),
    dict(name="contiguous-window-two-sided", layout="contiguous", strategy="auto", extra=0,
         heads=(2, 2), window=(3, 2), expect="allgather"),
    dict(name="zigzag-causal-alibi-auto", layout="zigzag", strategy="auto", extra=0,
         heads=(2, 2), causal=True, alibi=True, expect="allgather"),
    dict(name="zigzag-causal-softcap", layout="zigzag", strategy="allgather", extra=0,
         heads=(2, 1), causal=True, softcap=5.0),
    dict(name="zigzag-window-ring-refused", layout="zigzag", strategy="ring", extra=0,
         heads=(2, 2), window=(5, 0), refused={2: "ValueError", 3: "ValueError"}),
    # ALiBi without a mask: chunk [4, 8) takes 4 fake rows before it (as many as it has);
    # chunk [8, 12) of three ranks would take 8 and is refused.
    dict(name="contiguous-none-alibi", layout="contiguous", strategy="auto", extra=0,
         heads=(2, 2), alibi=True, refused={3: "PlanError"}),
]
CHUNK = 4  # tokens per chunk before `extra`: zigzag N = 2W x CHUNK + extra, contiguous W x CHUNK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_data(**fields) -> dict:
    return {"archs": ["sm90"], "dtype": "fp32", "head_dim": HEAD_DIM, "num_q_heads": 4,
            "num_kv_heads": 2, "kernels": ["prefill"], **fields}


def seq_len_of(case: dict, world: int) -> int:
    chunks = 2 * world if case["layout"] == "zigzag" else world
    return chunks * CHUNK + case["extra"]


def worker(rank: int, world: int, port: int, folder: str, out_dir: str) -> None:
    """Every case on all `world` ranks, then (with 3) every case again on ranks 1 and 2 as a
    group of their own, whose group ranks are not the global ones. The first rank of each
    group writes world<size>.json."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.distributed as dist

    from attngen.runtime.registry import load_kernels

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    load_kernels(Path(folder), replace=True)
    try:
        groups = [(None, list(range(world)))]
        if world == 3:
            groups.append((dist.new_group([1, 2]), [1, 2]))
        for group, members in groups:
            if rank not in members:
                continue
            results = []
            for case in CASES:
                started = time.perf_counter()
                results.append(run_case(case, dist.get_rank(group), len(members), group))
                results[-1]["seconds"] = round(time.perf_counter() - started, 2)
            if rank == members[0]:
                Path(out_dir, f"world{len(members)}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_case(case: dict, rank: int, world: int, group=None) -> dict:
    import torch

    from attngen.distributed import (
        context_parallel_attention,
        gather_sequence,
        last_plan,
        shard_sequence,
    )

    seq_len = seq_len_of(case, world)
    hq, hkv = case["heads"]
    gen = torch.Generator().manual_seed(len(case["name"]) * 7919 + world)
    q = torch.randn(1, hq, seq_len, HEAD_DIM, generator=gen)
    k = torch.randn(1, hkv, seq_len, HEAD_DIM, generator=gen)
    v = torch.randn(1, hkv, seq_len, HEAD_DIM, generator=gen)
    slopes = (2.0 ** (-8.0 * torch.arange(1, hq + 1) / hq)) if case.get("alibi") else None
    layout = case["layout"]
    shards = [shard_sequence(t, world, rank, layout=layout) for t in (q, k, v)]
    kwargs = dict(causal=case.get("causal", False), window=case.get("window"),
                  softcap=case.get("softcap", 0.0), alibi_slopes=slopes, layout=layout,
                  strategy=case["strategy"], seq_len=seq_len, return_lse=True, group=group)
    try:
        out, lse = context_parallel_attention(*shards, **kwargs)
    except Exception as err:  # a refusal is the result of the case
        return {"name": case["name"], "error": type(err).__name__, "text": str(err),
                "trace": traceback.format_exc(limit=3)}
    full_out = gather_sequence(out, seq_len=seq_len, layout=layout, group=group)
    full_lse = gather_sequence(lse[..., None], seq_len=seq_len, layout=layout, group=group)[..., 0]
    result = {"name": case["name"], "strategy": last_plan().strategy,
              "plan": last_plan().describe()}
    if rank == 0:
        result["problems"] = compare(case, full_out, full_lse, q, k, v, slopes)
    return result


def compare(case, out, lse, q, k, v, slopes) -> list[str]:
    from attngen.reference import compare_to_reference
    from attngen.spec import specs_from_data

    window = case.get("window")
    if window:
        mask = dict(mask="sliding_window", causal_align="bottom_right", window_left=window[0],
                    window_right=window[1])
    elif case.get("causal"):
        mask = dict(mask="causal", causal_align="bottom_right")
    else:
        mask = dict(mask="none")
    data = spec_data(name="golden", softcap=case.get("softcap", 0.0),
                     alibi=bool(case.get("alibi")), num_q_heads=q.shape[1],
                     num_kv_heads=k.shape[1], **mask)
    spec = specs_from_data(data)[0]
    return compare_to_reference(spec, out, lse, q, k, v, alibi_slopes=slopes)
