"""Context parallelism (attngen.distributed) on the CPU: gloo groups of 2 and 3 processes against
the float64 reference on the gathered sequence; the planner against a brute-force model of
what each kernel call computes; the LSE merge; and, in a one-process group, the checks,
autograd's refusal and torch.compile."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import example, given
from hypothesis import strategies as st

from attngen.distributed import (
    context_parallel_attention,
    last_plan,
    rank_chunks,
    shard_sequence,
    unshard_sequence,
)
from attngen.distributed.merge import merge_torch, merge_triton
from attngen.distributed.plan import (
    ALIGNS,
    MaskRule,
    PlanError,
    gather_plan,
    ring_plan,
)
from tests import context_parallel_harness as harness
from tests import cp_head_groups_harness as head_groups
from tests.runtime_harness import build_folder

SPAWN_DEADLINE_S = 300


@pytest.fixture(scope="module")
def cp_folder(tmp_path_factory):
    specs = [harness.spec_data(**s) for s in harness.TOY_SPECS]
    return build_folder(tmp_path_factory.mktemp("cp_kernels"), specs)


def spawn_group(worker, nprocs: int, args: tuple) -> None:
    """worker(rank, *args) in `nprocs` spawned processes, killed past SPAWN_DEADLINE_S."""
    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the process group did not finish in {SPAWN_DEADLINE_S} s")


@pytest.fixture(scope="module")
def group_results(cp_folder, tmp_path_factory) -> dict[int, dict]:
    """{world size: {case name: result}}: every case of the harness, run by one spawned gloo
    group of three processes and by two of them as a subgroup."""
    out_dir = tmp_path_factory.mktemp("cp_groups")
    spawn_group(harness.worker, 3, (3, harness.free_port(), str(cp_folder), str(out_dir)))
    return {
        world: {r["name"]: r for r in json.loads((out_dir / f"world{world}.json").read_text())}
        for world in (2, 3)
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", harness.CASES, ids=[c["name"] for c in harness.CASES])
def test_matches_reference_across_processes(group_results, world, case):
    result = group_results[world][case["name"]]
    refused = case.get("refused", {}).get(world)
    if refused:
        assert result.get("error") == refused, result
        assert "queries [" in result["text"], result["text"]  # names the pair it cannot do
        return
    assert "error" not in result, result.get("trace")
    assert result["problems"] == [], result["plan"]
    if "backward_refused" in case:  # every rank refused before any communication
        assert result["backward_error"] == case["backward_refused"], result
        assert (
            "needs a module with gradient kernels (spec `backward: true`) for rows"
            in result["backward_text"]
        ), result["backward_text"]
    else:
        assert result["grad_problems"] == [], result["plan"]
    if "ring_head_groups" in case:
        assert result["head_groups"] == case["ring_head_groups"], result["plan"]
        assert result["groups_bitwise"], result["plan"]
        heads_kv = case["heads"][1]  # the backward in 1, 2 and all-heads groups: same bytes
        groups = {str(g): True for g in (1, min(2, heads_kv), heads_kv)}
        assert result["backward_groups_bitwise"] == groups, result["plan"]
    if case["strategy"] != "auto":
        assert result["strategy"] == case["strategy"]
    elif "expect" in case:
        assert result["strategy"] == case["expect"], result["plan"]


@pytest.fixture(scope="module")
def cp_bf16_folder(tmp_path_factory):
    """bf16 causal and mask-none modules with gradient kernels: the ring's bf16 path (an fp32
    dQ accumulator, each group's gradients cast into place)."""
    specs = [harness.spec_data(**s, dtype="bf16") for s in harness.TOY_SPECS[:2]]
    return build_folder(tmp_path_factory.mktemp("cp_bf16_kernels"), specs)


@pytest.mark.parametrize("world, dtype", [(2, "float32"), (3, "float32"), (2, "bfloat16")])
def test_ring_backward_head_groups_are_bitwise_and_divide_its_memory(
    cp_folder, cp_bf16_folder, tmp_path, world, dtype
):
    """The gloo twin of the two-GPU test (tests/test_context_parallel_gpu.py, the same worker):
    the ring's backward in 1, 2 and 4 groups of KV heads (GQA 8 / 4), its gradients the same
    bytes for every count, and the memory it allocates beyond its gradients, measured on each
    rank, is tools/cp_bench_setup.py's model byte for byte: 1 / groups of one group's (in
    bf16 with the fp32 dQ accumulator that fp32 inputs do without)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from cp_bench_setup import ring_backward_peak

    config = dict(
        backend="gloo",
        seq_len=2 * world * 8 + 1,  # uneven shards: the model follows each rank's lengths
        heads=(8, 4),
        head_dim=harness.HEAD_DIM,
        dtype=dtype,
        groups=[1, 2, 4],
    )
    folder = cp_folder if dtype == "float32" else cp_bf16_folder
    args = (world, harness.free_port(), str(folder), str(tmp_path), config)
    spawn_group(head_groups.worker, world, args)
    report = json.loads((tmp_path / f"head_groups_w{world}.json").read_text())
    assert report["bitwise"] and report["planned"] == [1, 2, 4], report
    shards = [sum(c.length for c in r) for r in rank_chunks(config["seq_len"], world, "zigzag")]
    for rank, peaks in enumerate(report["peaks"]):
        size = 4 if dtype == "float32" else 2
        gradients = (8 + 4 + 4) * shards[rank] * harness.HEAD_DIM * size
        extra = [peak - gradients for peak in peaks]
        model = [
            ring_backward_peak(config["seq_len"], world, rank, (8, 4), harness.HEAD_DIM, size, g)
            for g in (1, 2, 4)
        ]
        assert extra == model, (rank, peaks, model)
        assert extra[1] * 2 == extra[0] and extra[2] * 4 == extra[0], (rank, extra)


# ------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world, seq_len", [(1, 5), (2, 9), (3, 20), (4, 3)])
def test_shard_and_unshard_round_trip(layout, world, seq_len):
    x = torch.arange(seq_len).view(1, 1, seq_len, 1).float()
    shards = [shard_sequence(x, world, r, layout=layout) for r in range(world)]
    assert sorted(s.shape[2] for s in shards)[-1] - sorted(s.shape[2] for s in shards)[0] <= 2
    assert torch.equal(unshard_sequence(shards, layout=layout), x)
    chunks = rank_chunks(seq_len, world, layout)
    for shard, rank in zip(shards, chunks, strict=True):  # its chunks' positions, in order
        positions = [p for c in rank for p in range(c.start, c.stop)]
        assert shard.flatten().tolist() == positions


def test_zigzag_pairs_early_and_late_chunks():
    chunks = rank_chunks(16, 2, "zigzag")
    assert [[(c.start, c.stop) for c in r] for r in chunks] == [
        [(0, 4), (12, 16)],
        [(4, 8), (8, 12)],
    ]


def test_unshard_refuses_wrong_lengths():
    with pytest.raises(ValueError, match=r"shards\[0\]: got 5 tokens .* gives rank 0 4"):
        unshard_sequence([torch.zeros(1, 1, 5, 1), torch.zeros(1, 1, 3, 1)], layout="zigzag")
    with pytest.raises(ValueError, match="layout: got 'ring'"):
        shard_sequence(torch.zeros(1, 1, 4, 1), 2, 0, layout="ring")


# ------------------------------------------------------------------------------ planner


def kernel_sees(call, r, c, num_q, num_k) -> tuple[bool, int]:
    """What the generated kernel does for call row r (padded) and key c: (visible, i' - c)."""
    # Mask-none kernels place rows bottom-right too (flash-attn's ALiBi distance).
    shift = num_k - num_q if call.align == "bottom_right" or call.mask == "none" else 0
    i_pos = r + shift
    if call.mask == "none":
        return True, i_pos - c
    if call.mask == "causal":
        return c <= i_pos, i_pos - c
    left, right = call.window
    return i_pos - left <= c <= i_pos + right, i_pos - c


def globally_sees(rule, i, j) -> bool:
    if rule.mask == "none":
        return True
    if rule.mask == "causal":
        return j <= i
    return i - rule.window[0] <= j <= i + rule.window[1]


def positions(chunks) -> list[int]:
    return [p for c in chunks for p in range(c.start, c.stop)]


def check_calls(rule, calls_with_keys, query_positions, seen) -> None:
    """Each (call, key positions): every pair the kernel sees is a pair the global mask sees,
    at the same offset (what ALiBi needs), counted in `seen`."""
    for call, key_positions in calls_with_keys:
        num_q = call.num_rows + call.pad_front + call.pad_back
        for row in range(*call.rows):
            for key in range(*call.keys):
                r, c = row - call.rows[0] + call.pad_front, key - call.keys[0]
                visible, offset = kernel_sees(call, r, c, num_q, call.num_keys)
                if not visible:
                    continue
                i, j = query_positions[row], key_positions[key]
                assert globally_sees(rule, i, j), (call, i, j)
                if rule.alibi:
                    assert offset == i - j, (call, i, j, offset)
                seen[(i, j)] = seen.get((i, j), 0) + 1


@st.composite
def planner_cases(draw):
    world = draw(st.integers(1, 4))
    seq_len = draw(st.integers(0, 24))
    layout = draw(st.sampled_from(["zigzag", "contiguous"]))
    mask = draw(st.sampled_from(["none", "causal", "sliding_window"]))
    window = (
        (draw(st.integers(0, 12)), draw(st.integers(0, 12))) if mask == "sliding_window" else None
    )
    rule = MaskRule(mask, window, draw(st.booleans()))
    aligns = draw(st.sampled_from([ALIGNS, ("bottom_right",), ("top_left",)]))
    return world, seq_len, layout, rule, aligns


@given(planner_cases())
@example((2, 16, "zigzag", MaskRule("causal"), ALIGNS))
@example((3, 20, "zigzag", MaskRule("sliding_window", (5, 0)), ("bottom_right",)))
def test_plans_compute_exactly_the_global_mask(case):
    """Both strategies' calls, run as the kernels run them, cover every visible (query, key)
    pair exactly once and nothing else, at the global offset; a plan that cannot is refused
    (PlanError), which never happens without ALiBi when both alignments exist (all-gather) or
    for causal and unmasked attention (ring)."""
    world, seq_len, layout, rule, aligns = case
    chunks = rank_chunks(seq_len, world, layout)
    everything = {
        (i, j) for i in range(seq_len) for j in range(seq_len) if globally_sees(rule, i, j)
    }
    try:
        ring = ring_plan(rule, chunks, aligns)
    except PlanError:
        assert rule.alibi or rule.mask == "sliding_window"
    else:
        seen: dict = {}
        for rank, steps in enumerate(ring):
            for step, calls in enumerate(steps):
                keys = positions(chunks[(rank - step) % world])
                check_calls(rule, [(c, keys) for c in calls], positions(chunks[rank]), seen)
        assert set(seen) == everything and set(seen.values()) <= {1}
    try:
        gather = gather_plan(rule, chunks, seq_len, aligns)
    except PlanError:
        assert rule.alibi or aligns != ALIGNS
    else:
        seen = {}
        for rank, calls in enumerate(gather):
            check_calls(
                rule, [(c, list(range(seq_len))) for c in calls], positions(chunks[rank]), seen
            )
        assert set(seen) == everything and set(seen.values()) <= {1}


def test_ring_zigzag_causal_steps_are_one_call_each():
    """Zigzag's causal ring: the own shard in one causal call, then one unmasked call per
    step (an early chunk's keys for both query chunks, or both key chunks for the late one)."""
    plan = ring_plan(MaskRule("causal"), rank_chunks(32, 4, "zigzag"), ALIGNS)
    for steps in plan:
        assert [c.mask for c in steps[0]] == ["causal"]
        for step in steps[1:]:
            assert [c.mask for c in step] == ["none"]
            assert step[0].num_rows * step[0].num_keys == 8 * 4  # balanced: 2 x 1 chunks


def test_ring_refusal_names_the_pair_and_the_way_out():
    with pytest.raises(
        PlanError,
        match=r"ring step 1, rank 0 .*queries \[12, 16\) against "
        r"keys \[4, 8\)",
    ):
        ring_plan(
            MaskRule("sliding_window", (5, 0)), rank_chunks(16, 2, "zigzag"), ("bottom_right",)
        )


# -------------------------------------------------------------------------------- merge


def reference_parts(seed, split):
    """Attention over 12 keys in float64, whole and as partials over key ranges `split`;
    queries 0-1 see no key of the first range, query 2 sees none at all."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for n in (5, 12, 12))
    visible = torch.ones(5, 12, dtype=torch.bool)
    visible[:2, : split[0][1]] = False
    visible[2] = False
    scores = (q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))

    def attend(cols):
        s = scores[..., cols[0] : cols[1]]
        lse = torch.logsumexp(s, -1)
        probs = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
        probs = probs.nan_to_num(0.0)
        return probs @ v[..., cols[0] : cols[1], :], lse

    return attend((0, 12)), [attend(cols) for cols in split]


@pytest.mark.parametrize("merge", [merge_torch, merge_triton], ids=["torch", "triton"])
def test_merge_is_exact_and_keeps_empty_rows_zero(merge):
    (whole, whole_lse), parts = reference_parts(0, [(0, 5), (5, 6), (6, 12)])
    acc = torch.zeros(2, 3, 5, 8)
    acc_lse = torch.full((2, 3, 5), float("-inf"))
    for out, lse in parts:
        merge(acc, acc_lse, out.float(), lse.float())
    assert not acc.isnan().any() and not acc_lse.isnan().any()
    assert torch.equal(acc[:, :, 2], torch.zeros(2, 3, 8))
    assert torch.equal(acc_lse[:, :, 2], torch.full((2, 3), float("-inf")))
    # fp32 partials, merged in fp32: a few fp32 roundings of values of magnitude ~1.
    assert torch.allclose(acc.double(), whole, atol=4e-6, rtol=0)
    assert torch.allclose(acc_lse.double(), whole_lse, atol=4e-6, rtol=0)


@pytest.mark.parametrize("merge", [merge_torch, merge_triton], ids=["torch", "triton"])
def test_merge_into_strided_views_and_nan_propagates(merge):
    (whole, _), parts = reference_parts(1, [(0, 6), (6, 12)])
    acc = torch.zeros(2, 3, 9, 8)
    acc_lse = torch.full((2, 3, 9), float("-inf"))
    wide = torch.full((2, 3, 7, 8), float("nan"))
    for out, lse in parts:
        wide[:, :, 1:6] = out.float()  # a view with a storage offset and a wider row stride
        merge(acc[:, :, 2:7], acc_lse[:, :, 2:7], wide[:, :, 1:6], lse.float())
    assert torch.allclose(acc[:, :, 2:7].double(), whole, atol=4e-6, rtol=0)
    assert torch.equal(acc[:, :, :2], torch.zeros(2, 3, 2, 8))
    nan_lse = torch.full((2, 3, 5), float("nan"))
    merge(acc[:, :, 2:7], acc_lse[:, :, 2:7], parts[0][0].float(), nan_lse)
    assert acc[:, :, 2:7].isnan().all() and acc_lse[:, :, 2:7].isnan().all()


# ------------------------------------------------------------------- one-process group


@pytest.fixture()
def single_group(cp_folder):
    """A one-process gloo group and the toy kernels as the registry, for one test."""
    from attngen.runtime import registry as registry_module
    from attngen.runtime.registry import load_kernels

    saved = registry_module._current
    load_kernels(cp_folder, replace=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    registry_module._current = saved


def toy_inputs(seq_len=12, heads=(4, 2), seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads[0], seq_len, harness.HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, heads[1], seq_len, harness.HEAD_DIM, generator=gen) for _ in "kv")
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_one_rank_is_the_plain_kernel_bitwise(single_group, strategy):
    import attngen

    q, k, v = toy_inputs()
    out = context_parallel_attention(q, k, v, causal=True, layout="contiguous", strategy=strategy)
    plain = attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, plain)
    assert last_plan().strategy == strategy
    assert attngen.last_dispatch().module == "sm90/cp_causal_prefill_fp32_d16_causal_br_bwd"


def test_ring_head_groups_split_the_kv_heads_evenly():
    from attngen.distributed.execute import head_ranges

    assert head_ranges(8, 1) == [(0, 8)]
    assert head_ranges(8, 8) == [(h, h + 1) for h in range(8)]
    assert head_ranges(3, 2) == [(0, 2), (2, 3)]
    assert head_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize(
    "heads, rows, budget, groups",
    [
        ((4, 2), 8, 2 * 8 * 16 * 4 * 2, 1),  # the whole accumulator fits: one trip
        ((4, 2), 8, 2 * 8 * 16 * 4, 2),
        ((4, 2), 8, 1, 2),  # never more groups than KV heads
        ((6, 3), 8, 2 * 2 * 8 * 16 * 4, 2),  # groups of ceil(3 / 2) = 2 KV heads
    ],
)
def test_auto_head_groups_keep_the_accumulator_within_the_budget(heads, rows, budget, groups):
    from attngen.distributed.execute import auto_head_groups

    q = torch.empty(1, heads[0], rows - 1, harness.HEAD_DIM, device="meta")
    v = torch.empty(1, heads[1], rows - 1, harness.HEAD_DIM, device="meta")
    assert auto_head_groups(q, v, rows, budget) == groups  # from the longest shard's rows


@pytest.mark.parametrize("alibi", [False, True])
def test_ring_head_groups_are_bitwise_one_group_in_one_process(single_group, alibi):
    """One group per KV head against one group, forward and backward (through the output and
    the LSE), with the automatic choice forced to split; with ALiBi each group takes its own
    heads' slopes."""
    from attngen.distributed import context

    q, k, v = toy_inputs(seq_len=12, heads=(4, 2), requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    out_grads = (torch.randn(1, 4, 12, harness.HEAD_DIM, generator=gen), torch.randn(1, 4, 12))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    kwargs = dict(causal=True, strategy="ring", return_lse=True, alibi_slopes=slopes)
    kwargs["layout"] = "contiguous"  # one rank: one call, ALiBi placed by its alignment

    def run():
        results = context_parallel_attention(q, k, v, **kwargs)
        return [*results, *torch.autograd.grad(results, (q, k, v), out_grads)]

    expected = run()
    assert (last_plan().head_groups, last_plan().backward_head_groups) == (1, 1)
    saved = context.RING_ACCUMULATOR_BYTES
    context.RING_ACCUMULATOR_BYTES = 1
    try:
        got = run()
    finally:
        context.RING_ACCUMULATOR_BYTES = saved
    assert (last_plan().head_groups, last_plan().backward_head_groups) == (2, 2)
    assert "2 head groups, backward in 2" in last_plan().describe()
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, expected, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "heads, rows, budget, groups",
    [
        # per KV head: dQ of 2 query heads and three fp32 dK/dV: 8 x 4 x (2 x 16 + 3 x 32)
        ((4, 2), 8, 2 * 8 * 4 * (2 * 16 + 3 * 32), 1),
        ((4, 2), 8, 2 * 8 * 4 * (2 * 16 + 3 * 32) - 1, 2),
        ((8, 8), 8, 3 * 8 * 4 * (16 + 3 * 32), 3),  # groups of ceil(8 / 3) = 3 KV heads
    ],
)
def test_backward_head_groups_keep_its_accumulators_within_the_budget(heads, rows, budget, groups):
    from attngen.distributed.execute import auto_head_groups

    q = torch.empty(1, heads[0], rows, harness.HEAD_DIM, device="meta")
    v = torch.empty(1, heads[1], rows, harness.HEAD_DIM, device="meta")
    assert auto_head_groups(q, v, rows, budget, backward=True) == groups


def test_long_sequences_train_in_groups_of_kv_heads():
    """The automatic choice at Llama-3-8B's heads on two ranks: the forward splits from 256k
    tokens (its 1 GiB accumulator at 128k rows a rank), the backward, with its dQ and three
    dK/dV (40 KiB a row), earlier."""
    from attngen.distributed.context import _head_groups

    for seq_len, forward, backward in ((32768, 1, 1), (65536, 1, 2), (262144, 2, 8)):
        q = torch.empty(1, 32, seq_len // 2, 128, dtype=torch.bfloat16, device="meta")
        v = torch.empty(1, 8, seq_len // 2, 128, dtype=torch.bfloat16, device="meta")
        chunks = rank_chunks(seq_len, 2, "zigzag")
        assert _head_groups(None, q, v, chunks) == (forward, backward), seq_len
    assert _head_groups(3, q, v, chunks) == (3, 3)  # asked: for both


def test_strided_inputs_give_the_same_bytes(single_group):
    """[B, N, H, D] tensors transposed to [B, H, N, D] views, as a model holds them."""
    q, k, v = toy_inputs(seq_len=10)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    for strategy in ("ring", "allgather"):
        expected = context_parallel_attention(q, k, v, causal=True, strategy=strategy)
        got = context_parallel_attention(*strided, causal=True, strategy=strategy)
        assert torch.equal(got, expected), strategy


@pytest.mark.parametrize(
    "world, heads, expected",
    [
        (2, (32, 8), "allgather"),
        (6, (32, 8), "allgather"),
        (8, (32, 8), "ring"),
        (3, (32, 32), "allgather"),
        (4, (32, 32), "ring"),
    ],
)
def test_auto_gathers_while_that_takes_no_more_memory_than_the_ring(world, heads, expected):
    """docs/context_parallel.md's rule: Llama-3-8B heads gather up to 6 GPUs, MHA up to 3."""
    from attngen.distributed.context import _choose

    seq_len = world * 65536
    q = torch.empty(1, heads[0], seq_len // world, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, heads[1], seq_len // world, 128, dtype=torch.bfloat16, device="meta")
    chosen, reason, _, _ = _choose(
        "auto", MaskRule("causal"), seq_len, world, "zigzag", ALIGNS, 0, q, k, k
    )
    assert chosen == expected, reason


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("through", ["out", "lse", "both"])
def test_one_rank_gradients_are_the_plain_kernels_bitwise(single_group, strategy, through):
    """One rank runs the whole causal attention in one call per query chunk; its gradients,
    through the output, the LSE or both, are the plain module's (contiguous: one call, so
    bitwise)."""
    from attngen.runtime.dispatch import Call
    from attngen.runtime.launch import run_dense
    from attngen.spec import CausalAlign, Mask

    q, k, v = toy_inputs(requires_grad=True)
    gen = torch.Generator().manual_seed(5)
    dout, dlse = (
        torch.randn(1, 4, 12, harness.HEAD_DIM, generator=gen),
        torch.randn(1, 4, 12, generator=gen),
    )
    out, lse = context_parallel_attention(
        q, k, v, causal=True, layout="contiguous", strategy=strategy, return_lse=True
    )
    plain = run_dense(
        "plain",
        q,
        k,
        v,
        Call(mask=Mask.causal, align=CausalAlign.bottom_right, softcap=0.0, return_lse=True),
    )
    picked = {"out": [0], "lse": [1], "both": [0, 1]}[through]
    grads = [
        torch.autograd.grad(
            [(out, lse)[i] for i in picked], (q, k, v), [(dout, dlse)[i] for i in picked]
        )
        for out, lse in ((out, lse), plain)
    ]
    for name, got, expected in zip("qkv", *grads, strict=True):
        assert torch.equal(got, expected), name


def test_backward_runs_gradient_modules_through_dispatch(single_group):
    """The backward's kernels are chosen by dispatch (recorded, need.backward set) and counted
    by the runtime; the forward of a call without gradients needs no gradient kernels."""
    import attngen
    from attngen.runtime import ops

    q, k, v = toy_inputs(seq_len=10, requires_grad=True)
    out = context_parallel_attention(q, k, v, causal=True, layout="zigzag", strategy="ring")
    ops.reset_run_counts()
    with attngen.dispatch_log() as log:
        out.sum().backward()
    assert {d.need.backward for d in log} == {True}
    assert {d.module for d in log} == {"sm90/cp_causal_prefill_fp32_d16_causal_br_bwd"}
    assert sum(ops.run_counts().values()) == len(last_plan().steps[0])
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    with torch.no_grad():
        assert not context_parallel_attention(q, k, v, causal=True).requires_grad


def test_gradients_need_gradient_kernels(single_group, tmp_path):
    """A call with gradients whose calls no module with gradient kernels serves is refused at
    the forward, naming the forward-only module; a registry replaced between forward and
    backward is checked again before the backward communicates."""
    from attngen.runtime import NoKernelError
    from attngen.runtime.registry import load_kernels

    q, k, v = toy_inputs(requires_grad=True)
    with pytest.raises(
        NoKernelError,
        match=r"backward needs a module with gradient kernels .*"
        r"cp_win_fwd_prefill_fp32_d16_win2x1_br serves it "
        r"without them",
    ):
        context_parallel_attention(q, k, v, window=(2, 1))
    with torch.no_grad():  # the forward alone runs on the forward-only module
        context_parallel_attention(q, k, v, window=(2, 1))
    out = context_parallel_attention(q, k, v, causal=True)
    load_kernels(
        build_folder(
            tmp_path,
            [harness.spec_data(name="cp_causal", mask="causal", causal_align="bottom_right")],
        ),
        replace=True,
    )
    with pytest.raises(NoKernelError, match="backward needs a module with gradient kernels"):
        out.sum().backward()


def test_empty_batch_has_empty_gradients(single_group):
    q, k, v = (t[:0].detach().requires_grad_() for t in toy_inputs())
    context_parallel_attention(q, k, v, causal=True).sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_runs_eagerly_inside_torch_compile(single_group):
    q, k, v = toy_inputs()

    def layer(q, k, v):
        return context_parallel_attention(q * 2, k, v, causal=True) + 1

    compiled = torch.compile(layer, backend="eager")
    assert torch.equal(compiled(q, k, v), layer(q, k, v))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(causal=True, window=(4, 0)), "causal: must be False with window"),
        (dict(window=(4,)), r"window: got \(4,\)"),
        (dict(softcap=-1.0), "softcap: got -1.0"),
        (dict(sm_scale=0.0), "sm_scale: got 0.0"),
        (dict(strategy="tree"), "strategy: got 'tree'"),
        (dict(layout="striped"), "layout: got 'striped'"),
        (
            dict(seq_len=13),
            r"q: rank 0 holds 12 tokens, but layout 'zigzag' over 1 ranks of a "
            r"13-token sequence gives it 13",
        ),
        (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes: got \(3,\) torch.float32"),
        (dict(ring_head_groups=3), "ring_head_groups: got 3; allowed: None or an int from 1"),
        (dict(ring_head_groups=0), "ring_head_groups: got 0"),
        (dict(ring_head_groups=True), "ring_head_groups: got True"),
    ],
)
def test_refuses_bad_arguments_by_name(single_group, kwargs, message):
    q, k, v = toy_inputs()
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(q, k, v, **kwargs)


def test_refuses_without_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        context_parallel_attention(*toy_inputs(), causal=True)


def test_refuses_mismatched_shapes_and_heads(single_group):
    q, k, v = toy_inputs()
    with pytest.raises(ValueError, match="expected the same batch and shard length"):
        context_parallel_attention(q, k[:, :, :5], v[:, :, :5])
    with pytest.raises(ValueError, match="q heads a multiple of k/v heads, got 4 and 3"):
        context_parallel_attention(q, *toy_inputs(heads=(3, 3))[1:])


def test_missing_kernel_names_the_call_that_needs_it(single_group):
    from attngen.runtime import NoKernelError

    q, k, v = toy_inputs()
    with pytest.raises(
        NoKernelError,
        match=r"needs a kernel for .*sliding_window.*"
        r"no generated kernel serves",
    ):
        context_parallel_attention(q, k, v, window=(7, 7))


def test_empty_batch_gives_empty_output(single_group):
    q, k, v = (t[:0] for t in toy_inputs())
    out, lse = context_parallel_attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (0, 4, 12, harness.HEAD_DIM) and lse.shape == (0, 4, 12)


def test_benchmark_script_runs_on_the_cpu(tmp_path):
    """tools/bench_context_parallel.py's one-process path, at toy sizes under the interpreter
    (the measurement itself needs a GPU; this keeps the script working)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            str(root / "tools" / "bench_context_parallel.py"),
            "--smoke",
            "--worlds",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = tmp_path.glob("bench_context_parallel_single_*.json")
    data = json.loads(result.read_text())
    assert [r["W"] for r in data["steps"]] == [2] and data["single"][0]["N"] == 64
    assert {"merge_torch_ms", "merge_triton_ms", "kv_bytes_per_step"} <= set(data["steps"][0])
    assert "| N | W | L |" in done.stdout


def test_backward_benchmark_runs_on_the_cpu(single_group, tmp_path):
    """tools/bench_context_parallel_backward.py at toy sizes under the interpreter: its
    one-process sections in this process's group, and its two-process path under torchrun
    with gloo (what the two-GPU run executes, but PyTorch's context parallelism, which needs
    CUDA)."""
    import argparse
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = root / "tools" / "bench_context_parallel_backward.py"
    loader = importlib.util.spec_from_file_location("bench_cp_backward", script)
    bench = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(bench)
    assert bench.parse_heads("32/32,32/8") == [(32, 32), (32, 8)]
    for bad in ("32/5", "32", "a/b", "8/0"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            bench.parse_heads(bad)
    setup = bench.fwd.Setup(argparse.Namespace(smoke=True, seqlens=[32]))
    results = {
        "single": bench.bench_single(setup, 0.0),
        "steps": bench.bench_steps(setup, [2], 0.0),
    }
    assert results["steps"][0]["dkv_bytes_per_step"] == 2 * 2 * 16 * 16 * 4
    assert "| N | W | L | step 0 causal bwd ms |" in bench.table(results)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(harness.free_port()),
            str(script),
            "--smoke",
            "--seqlens",
            "32",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (multi,) = tmp_path.glob("bench_context_parallel_backward_2gpu_*.json")
    rows = json.loads(multi.read_text())["multi"]
    assert [(r["heads"], r["N"]) for r in rows] == [("4/4", 32), ("4/2", 32)]
    for row in rows:
        for strategy in ("ring", "allgather"):  # fp32 gradients of two ranks against one's
            assert row[f"attngen_{strategy}_bytes"] == row["one_gpu_bytes"] // 2  # the inputs
            for diff, magnitude in row[f"attngen_{strategy}_max_diff"].values():
                # fp32 sums over 32 tokens split in other places, each partial rounded once
                # before the fp32 sum: a few ulps of the largest gradient (<= 6 at N 64).
                assert diff <= 16 * 2**-23 * magnitude, (strategy, row)
        for backend in ("cudnn", "flash"):  # PyTorch's runs up to its backend on the CPU
            assert f"torch_{backend}_ms" in row or f"torch_{backend}_error" in row, row
        assert row["ring_backward_head_groups"] == 1
    last = done.stdout.strip().splitlines()
    assert last[-4].startswith("| heads | N | 1 GPU ms |") and last[-1].startswith("| 4/2 | 32 |")


def test_long_sequence_script_runs_on_the_cpu(tmp_path):
    """tools/cp_long_sequence.py under torchrun with gloo at toy sizes (--smoke: fp32, the
    interpreter): the two-rank ring in two head groups, the sampled rows' blockwise reference
    joined across ranks, the JSON and the table (the sizes that matter need two H200s)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(harness.free_port()),
            str(root / "tools" / "cp_long_sequence.py"),
            "--smoke",
            "--head-groups",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = tmp_path.glob("cp_long_sequence_smoke_smoke_*.json")
    data = json.loads(result.read_text())
    assert data["seq_len"] == 64 and data["head_groups"] == 2 and data["world_size"] == 2
    assert data["check"]["rows"] == 32 and data["check"]["problems"] == []
    assert data["check"]["out"]["max_err"] <= data["check"]["out"]["max_bound"]
    assert "check (32 sampled rows)" in done.stdout.splitlines()[-1]


def test_training_step_script_runs_on_the_cpu(tmp_path):
    """tools/cp_train_step.py under torchrun with gloo at toy sizes (--smoke: fp32, the
    interpreter): forward + backward of the two-rank ring in two head groups, the sampled
    rows of dq and keys of dk, dv against their references joined across ranks, the memory
    model, the JSON and the table (the sizes that matter need two H200s)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(harness.free_port()),
            str(root / "tools" / "cp_train_step.py"),
            "--smoke",
            "--head-groups",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = tmp_path.glob("cp_train_step_smoke_smoke_*.json")
    data = json.loads(result.read_text())
    assert data["seq_len"] == 64 and data["head_groups"] == [2, 2] and data["world_size"] == 2
    check = data["check"]
    assert check["rows"] == 32 and check["problems"] == [], check
    for name in ("dq", "dk", "dv"):
        assert 0 < check[name]["max_err"] <= check[name]["max_bound"], (name, check)
    # 32 tokens a rank: q, k, v, out, dO, dq, dk, dv, LSE and delta, and the backward's peak
    per_token = 4 * (4 + 2) * 16 * 4 + 2 * 4 * 4
    assert data["rank_model_bytes"][0] > 32 * per_token and data["one_gpu_bytes"] == 64 * per_token
    assert "check (32 rows, 32 keys)" in done.stdout.splitlines()[-1]
