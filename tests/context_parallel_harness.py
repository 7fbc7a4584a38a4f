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
# Modules with gradient kernels (backward: true), but for the window (2, 1): its calls are
# served forward-only, so a call that needs gradients is refused (NoKernelError) before any
# communication. cp_win_tl aligns top-left: the ring's window steps take fake rows before the
# chunk.
TOY_SPECS = [
    dict(name="cp_causal", mask="causal", causal_align="bottom_right", backward=True),
    dict(name="cp_none", mask="none", backward=True),
    dict(
        name="cp_win",
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=5,
        window_right=0,
        backward=True,
    ),
    dict(
        name="cp_win2",
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=3,
        window_right=2,
        backward=True,
    ),
    dict(
        name="cp_win_tl",
        mask="sliding_window",
        causal_align="top_left",
        window_left=3,
        window_right=0,
        backward=True,
    ),
    dict(
        name="cp_win_fwd",
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=2,
        window_right=1,
    ),
    dict(name="cp_alibi", mask="causal", causal_align="bottom_right", alibi=True, backward=True),
    dict(name="cp_cap", mask="causal", causal_align="bottom_right", softcap=5.0, backward=True),
    dict(name="cp_alibi_none", mask="none", alibi=True, backward=True),
]

# Each case: its layout and strategy, `extra` tokens past whole chunks (uneven lengths), the
# heads (Hq, Hkv), the mask arguments, `expect`: the strategy auto must choose, `refused`:
# {world size: the error's type name} where the call must be refused. Every case that runs
# also runs its backward (with the LSE's gradient too where return_lse is set), unless
# `backward_refused` names the error a call with gradients must raise.
CASES = [
    dict(
        name="zigzag-causal-ring-gqa-uneven",
        layout="zigzag",
        strategy="ring",
        extra=1,
        heads=(2, 1),
        causal=True,
    ),
    dict(
        name="zigzag-causal-allgather-gqa",
        layout="zigzag",
        strategy="allgather",
        extra=0,
        heads=(2, 1),
        causal=True,
        return_lse=True,
    ),
    dict(
        name="contiguous-causal-ring-uneven",
        layout="contiguous",
        strategy="ring",
        extra=2,
        heads=(2, 2),
        causal=True,
        return_lse=True,
    ),
    dict(
        name="contiguous-none-ring-gqa", layout="contiguous", strategy="ring", extra=0, heads=(2, 1)
    ),
    dict(
        name="zigzag-none-allgather-uneven",
        layout="zigzag",
        strategy="allgather",
        extra=3,
        heads=(2, 2),
    ),
    dict(
        name="zigzag-window-auto-uneven",
        layout="zigzag",
        strategy="auto",
        extra=1,
        heads=(2, 1),
        window=(5, 0),
        expect="allgather",
        return_lse=True,
    ),
    dict(
        name="contiguous-window-two-sided",
        layout="contiguous",
        strategy="auto",
        extra=0,
        heads=(2, 2),
        window=(3, 2),
        expect="allgather",
    ),
    dict(
        name="zigzag-window-ring-top-left",
        layout="zigzag",
        strategy="ring",
        extra=0,
        heads=(2, 1),
        window=(3, 0),
        return_lse=True,
    ),
    dict(
        name="contiguous-window-forward-only-kernels",
        layout="contiguous",
        strategy="allgather",
        extra=1,
        heads=(2, 2),
        window=(2, 1),
        backward_refused="NoKernelError",
    ),
    dict(
        name="zigzag-causal-alibi-auto",
        layout="zigzag",
        strategy="auto",
        extra=0,
        heads=(2, 2),
        causal=True,
        alibi=True,
        expect="allgather",
    ),
    dict(
        name="zigzag-causal-softcap",
        layout="zigzag",
        strategy="allgather",
        extra=0,
        heads=(2, 1),
        causal=True,
        softcap=5.0,
    ),
    dict(
        name="zigzag-window-ring-refused",
        layout="zigzag",
        strategy="ring",
        extra=0,
        heads=(2, 2),
        window=(5, 0),
        refused={2: "ValueError", 3: "ValueError"},
    ),
    # The ring one group of KV heads at a time (`ring_head_groups`): the same bytes as one
    # group (checked in run_case), uneven groups (3 KV heads in 2), one head a group.
    dict(
        name="zigzag-causal-ring-head-groups-uneven",
        layout="zigzag",
        strategy="ring",
        extra=1,
        heads=(6, 3),
        causal=True,
        return_lse=True,
        ring_head_groups=2,
    ),
    dict(
        name="contiguous-none-ring-head-groups",
        layout="contiguous",
        strategy="ring",
        extra=2,
        heads=(3, 3),
        ring_head_groups=3,
    ),
    # ALiBi without a mask: chunk [4, 8) takes 4 fake rows before it (as many as it has);
    # chunk [8, 12) of three ranks would take 8 and is refused.
    dict(
        name="contiguous-none-alibi",
        layout="contiguous",
        strategy="auto",
        extra=0,
        heads=(2, 2),
        alibi=True,
        refused={3: "PlanError"},
    ),
]
CHUNK = 4  # tokens per chunk before `extra`: zigzag N = 2W x CHUNK + extra, contiguous W x CHUNK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_data(**fields) -> dict:
    return {
        "archs": ["sm90"],
        "dtype": "fp32",
        "head_dim": HEAD_DIM,
        "num_q_heads": 4,
        "num_kv_heads": 2,
        "kernels": ["prefill"],
        **fields,
    }


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
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
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
    """The case's forward (with gradients unless its backward is refused), gathered and, on the
    group's first rank, compared with the reference; then its backward likewise."""
    import torch

    from attngen.distributed import context_parallel_attention, last_plan, shard_sequence

    seq_len = seq_len_of(case, world)
    q, k, v, slopes, dout, dlse = case_inputs(case, seq_len)
    layout = case["layout"]
    trains = "backward_refused" not in case
    shards = [
        shard_sequence(t, world, rank, layout=layout).clone().requires_grad_(trains)
        for t in (q, k, v)
    ]
    kwargs = dict(
        causal=case.get("causal", False),
        window=case.get("window"),
        softcap=case.get("softcap", 0.0),
        alibi_slopes=slopes,
        layout=layout,
        strategy=case["strategy"],
        seq_len=seq_len,
        return_lse=True,
        group=group,
    )
    try:
        out, lse = context_parallel_attention(
            *shards, **kwargs, ring_head_groups=case.get("ring_head_groups")
        )
    except Exception as err:  # a refusal is the result of the case
        return {
            "name": case["name"],
            "error": type(err).__name__,
            "text": str(err),
            "trace": traceback.format_exc(limit=3),
        }
    gather = _gatherer(seq_len, layout, group)
    result = {
        "name": case["name"],
        "strategy": last_plan().strategy,
        "plan": last_plan().describe(),
    }
    full_out, full_lse = gather(out), gather(lse)  # collectives: on every rank
    if "ring_head_groups" in case:  # the groups change the memory, not one bit of the result
        result["head_groups"] = last_plan().head_groups
        with torch.no_grad():
            one_out, one_lse = context_parallel_attention(*shards, **kwargs, ring_head_groups=1)
        result["groups_bitwise"] = torch.equal(out, one_out) and torch.equal(lse, one_lse)
    if rank == 0:
        result["problems"] = compare(case, full_out, full_lse, q, k, v, slopes)
    if not trains:  # the same call with gradients must be refused, on every rank
        try:
            context_parallel_attention(*(t.detach().requires_grad_() for t in shards), **kwargs)
            result["backward_error"] = None
        except Exception as err:
            result["backward_error"] = type(err).__name__
            result["backward_text"] = str(err)
        return result
    outputs, out_grads = [out], [shard_sequence(dout, world, rank, layout=layout)]
    if case.get("return_lse"):  # the LSE in the loss too: its gradient enters delta
        outputs.append(lse)
        out_grads.append(shard_sequence(dlse[..., None], world, rank, layout=layout)[..., 0])
    grads = torch.autograd.grad(outputs, shards, out_grads)
    if "ring_head_groups" in case:  # the backward's groups: the same bytes for 1, 2 and all
        result["backward_groups_bitwise"] = backward_groups_bitwise(
            shards, kwargs, out_grads, grads, case["heads"][1]
        )
    full = [gather(g) for g in grads]
    if rank == 0:
        result["grad_problems"] = compare_gradients(
            case, full, q, k, v, slopes, dout, dlse if case.get("return_lse") else None
        )
    return result


def backward_groups_bitwise(shards, kwargs, out_grads, expected, num_kv_heads) -> dict:
    """{group count: whether the ring's gradients in that many groups of KV heads (the plan
    saying so) are `expected` bit for bit}, for 1, 2 and one KV head a group."""
    import torch

    from attngen.distributed import context_parallel_attention, last_plan

    same = {}
    for groups in sorted({1, min(2, num_kv_heads), num_kv_heads}):
        leaves = [t.detach().requires_grad_() for t in shards]
        out, lse = context_parallel_attention(*leaves, **kwargs, ring_head_groups=groups)
        outputs = [out, lse][: len(out_grads)]
        got = torch.autograd.grad(outputs, leaves, out_grads)
        same[groups] = last_plan().backward_head_groups == groups and all(
            torch.equal(a, b) for a, b in zip(got, expected, strict=True)
        )
    return same


def case_inputs(case: dict, seq_len: int):
    """q, k, v, ALiBi slopes (or None), dO and dLSE of the whole sequence, from the case."""
    import torch

    hq, hkv = case["heads"]
    gen = torch.Generator().manual_seed(len(case["name"]) * 7919 + seq_len)
    q = torch.randn(1, hq, seq_len, HEAD_DIM, generator=gen)
    k = torch.randn(1, hkv, seq_len, HEAD_DIM, generator=gen)
    v = torch.randn(1, hkv, seq_len, HEAD_DIM, generator=gen)
    slopes = (2.0 ** (-8.0 * torch.arange(1, hq + 1) / hq)) if case.get("alibi") else None
    dout = torch.randn(1, hq, seq_len, HEAD_DIM, generator=gen)
    dlse = torch.randn(1, hq, seq_len, generator=gen)
    return q, k, v, slopes, dout, dlse


def _gatherer(seq_len: int, layout: str, group):
    """The whole sequence of a shard [B, H, n, ...] ([B, H, n] too), on every rank."""
    from attngen.distributed import gather_sequence

    def gather(x):
        flat = x.detach()
        if flat.dim() == 3:
            return gather_sequence(flat[..., None], seq_len=seq_len, layout=layout, group=group)[
                ..., 0
            ]
        return gather_sequence(flat, seq_len=seq_len, layout=layout, group=group)

    return gather


def golden_spec(case: dict, heads: tuple[int, int]):
    from attngen.spec import specs_from_data

    window = case.get("window")
    if window:
        mask = dict(
            mask="sliding_window",
            causal_align="bottom_right",
            window_left=window[0],
            window_right=window[1],
        )
    elif case.get("causal"):
        mask = dict(mask="causal", causal_align="bottom_right")
    else:
        mask = dict(mask="none")
    data = spec_data(
        name="golden",
        softcap=case.get("softcap", 0.0),
        alibi=bool(case.get("alibi")),
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        **mask,
    )
    return specs_from_data(data)[0]


def compare(case, out, lse, q, k, v, slopes) -> list[str]:
    from attngen.reference import compare_to_reference

    spec = golden_spec(case, (q.shape[1], k.shape[1]))
    return compare_to_reference(spec, out, lse, q, k, v, alibi_slopes=slopes)


def compare_gradients(case, grads, q, k, v, slopes, dout, dlse) -> list[str]:
    """The gathered (dq, dk, dv) against the float64 reference (RELIABILITY.md's rule for
    gradients), and against one process's attngen gradients of the whole sequence (the same
    modules, through the runtime's autograd)."""
    from attngen.reference import backward as reference_backward

    spec = golden_spec(case, (q.shape[1], k.shape[1]))
    options = dict(alibi_slopes=slopes, dlse=dlse)
    problems = reference_backward.compare_gradients(spec, grads, q, k, v, dout, **options)
    golden = reference_backward.golden_backward(spec, q, k, v, dout, **options)[2:]
    lowp = reference_backward.lowp_backward(spec, q, k, v, dout, **options)[1:]
    single = one_process_gradients(case, q, k, v, slopes, dout, dlse)
    for name, got, one, gold, low in zip(
        ("dq", "dk", "dv"), grads, single, golden, lowp, strict=True
    ):
        problems += _against_one_process(name, got, one, gold, low)
    return problems


def _against_one_process(name, got, one, gold, low) -> list[str]:
    """Split over chunk pairs, the kernels sum the same products in another order, and dK/dV
    (and dQ) are rounded once per partial before their fp32 sum: the difference from one
    process is a reordering of the fp32 sums, bounded here by the error the same math in the
    kernels' dtype has against the float64 reference (the yardstick of RELIABILITY.md) plus
    the rule's floor (four fp32 ulps at the gradient's magnitude)."""
    from attngen.reference import ulp

    floor = 4 * ulp(got.dtype, gold.abs().max().item())
    bound = (low.double() - gold).abs().max().item() + floor
    diff = (got.double() - one.double()).abs().max().item()
    return (
        []
        if diff <= bound
        else [f"{name}: {diff:.3e} from one process's, more than the yardstick's {bound:.3e}"]
    )


def one_process_gradients(case, q, k, v, slopes, dout, dlse):
    """(dq, dk, dv) of the whole sequence in this process, through the runtime."""
    import torch

    from attngen.runtime.dispatch import Call
    from attngen.runtime.launch import run_dense
    from attngen.spec import CausalAlign, Mask

    window = case.get("window")
    mask = Mask.sliding_window if window else Mask.causal if case.get("causal") else Mask.none
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = run_dense(
        "one_process",
        *leaves,
        Call(
            mask=mask,
            align=None if mask is Mask.none else CausalAlign.bottom_right,
            window=window,
            softcap=case.get("softcap", 0.0),
            alibi_slopes=slopes,
            scale=None,
            return_lse=True,
            fallback=None,
        ),
    )
    outputs, grads = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
    return torch.autograd.grad(outputs, leaves, grads)
