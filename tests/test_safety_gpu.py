"""Memory safety and the kernel contracts at real sizes on a CUDA GPU (the H200): `pytest -m gpu`.

The CPU interpreter and the GPU fail differently (the interpreter checks no bounds but runs
programs one at a time; the GPU faults only past an allocation), so the cases of
tests/test_memory_safety.py run here on CUDA with guard regions (tests/safety_harness.py):
decode (contiguous, pages of 16 and 64, one split and many, with and without new keys) and
varlen with one sequence's index entries made bad; windows at the int32 limit; the numerics
that only the compiled kernels show (fp32 scores near 1e10, where an FMA-folded scale
overflows exp2). For out-of-bounds reads that stay inside an allocation, run it under
compute-sanitizer as well:

    compute-sanitizer --tool memcheck python -m pytest -m gpu tests/test_safety_gpu.py -k bad
"""

from __future__ import annotations

import pytest
import torch

from tests.decode_harness import (
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
)
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec
from tests.safety_harness import (
    DECODE_BAD,
    PAGE_BAD,
    VARLEN_BAD,
    check_bad_decode,
    check_bad_varlen,
    decode_problem,
)
from tests.test_fast_launch import VARLEN
from tests.test_varlen_plans import EVERY_ROW_CASES, check_every_row_written
from tests.test_varlen_properties import assert_each_sequence_matches, cu_seqlens, packed_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

LAYOUTS = [("contiguous", None), ("paged", 16), ("paged", 64)]
CASES = [
    (layout, page, case)
    for layout, page in LAYOUTS
    for case in DECODE_BAD + (PAGE_BAD if layout == "paged" else [])
]
LENGTHS = [4096, 3000, 777, 0, 8190]  # sequence 1 is the one made bad
WINDOW_LIMITS = [2**31 - 1, 2**31 - 2, 2**30]


def _decode_spec(layout, page_size, dtype="bf16", **fields):
    fields = {"mask": "causal", "causal_align": "bottom_right", **fields}
    return make_decode_spec(
        layout,
        page_size,
        dtype=dtype,
        head_dim=128,
        num_q_heads=32,
        num_kv_heads=8,
        max_query_tokens=4,
        **fields,
    )


@pytest.mark.parametrize(
    "layout, page_size, case", CASES, ids=[f"{lay}{page or ''}-{c.name}" for lay, page, c in CASES]
)
@pytest.mark.parametrize("num_new, num_q_tokens", [(1, 1), (4, 4)])
def test_bad_decode_indices(layout, page_size, case, num_new, num_q_tokens):
    spec = _decode_spec(layout, page_size)
    kernel = load_decode(spec)
    for splits in (1, 16):  # one program per sequence (direct store), and split-KV
        problem = decode_problem(
            spec, LENGTHS, case, num_new=num_new, num_q_tokens=num_q_tokens, seed=21, device="cuda"
        )
        check_bad_decode(kernel, spec, problem, splits=splits)
        torch.cuda.synchronize()


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
def test_bad_length_without_new_keys(layout, page_size):
    spec = _decode_spec(layout, page_size)
    problem = decode_problem(
        spec, LENGTHS, DECODE_BAD[2], num_new=0, num_q_tokens=2, seed=22, device="cuda", bad=4
    )
    check_bad_decode(load_decode(spec), spec, problem)


def test_bad_decode_page_left_of_the_window_is_not_needed():
    spec = _decode_spec("paged", 16, mask="sliding_window", window_left=1000, window_right=0)
    problem = decode_problem(
        spec, LENGTHS, PAGE_BAD[0], num_new=1, num_q_tokens=1, seed=22, device="cuda"
    )
    check_bad_decode(load_decode(spec), spec, problem, expect_nan=False)


@pytest.mark.parametrize("case", VARLEN_BAD, ids=lambda c: c.name)
def test_bad_varlen_indices(case):
    spec = make_spec(
        dtype="bf16",
        head_dim=128,
        num_q_heads=8,
        num_kv_heads=2,
        mask="causal",
        causal_align="bottom_right",
        kernels=["varlen"],
    )
    kernel = load_kernel(spec, kind="varlen")
    check_bad_varlen(kernel, spec, [700, 1500, 300], [900, 1600, 300], case, seed=23, device="cuda")
    torch.cuda.synchronize()


@pytest.mark.parametrize("cu", EVERY_ROW_CASES)
def test_varlen_writes_every_row_without_a_host_fill(cu):
    """Fresh CUDA memory is not zero: the rows no sequence covers are the kernel's writes."""
    check_every_row_written(load_kernel(VARLEN, kind="varlen"), cu, "cuda")


def test_varlen_sequence_longer_than_max_seqlen_q():
    spec = make_spec(
        dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=1, mask="none", kernels=["varlen"]
    )
    kernel = load_kernel(spec, kind="varlen")
    block_m = kernel.CONFIG["BLOCK_M"]
    check_bad_varlen(
        kernel,
        spec,
        [block_m, 5 * block_m + 3, 7],
        [900, 1600, 300],
        None,
        seed=24,
        device="cuda",
        max_seqlen_q=block_m,
        bad=1,
    )


@pytest.mark.parametrize(
    "left, right",
    [(WINDOW_LIMITS[0], WINDOW_LIMITS[0]), (0, WINDOW_LIMITS[1]), (WINDOW_LIMITS[2], 0)],
)
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_prefill_and_varlen_windows_at_the_int32_limit(left, right, align):
    spec = make_spec(
        dtype="bf16",
        head_dim=128,
        num_q_heads=8,
        num_kv_heads=2,
        mask="sliding_window",
        causal_align=align,
        window_left=left,
        window_right=right,
        kernels=["prefill", "varlen"],
    )
    q, k, v, _ = make_inputs(spec, 2, 1000, 1500, seed=25, device="cuda")
    out, lse = load_kernel(spec).attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())
    lengths_q, lengths_k = [1000, 1, 300], [1500, 700, 0]
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=26)
    out, lse = load_kernel(spec, kind="varlen").attention_varlen(
        q.cuda(),
        k.cuda(),
        v.cuda(),
        cu_seqlens(lengths_q).cuda(),
        cu_seqlens(lengths_k).cuda(),
        1000,
        1500,
        return_lse=True,
    )
    assert_each_sequence_matches(spec, out.cpu(), lse.cpu(), q, k, v, lengths_q, lengths_k, None)


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
@pytest.mark.parametrize("left", WINDOW_LIMITS)
def test_decode_windows_at_the_int32_limit(layout, page_size, left):
    spec = _decode_spec(
        layout, page_size, mask="sliding_window", window_left=left, window_right=left
    )
    kernel = load_decode(spec)
    cache = make_cache(spec, [4096, 1, 0, 5000], seed=27, room=2)
    q, k_new, v_new, _ = make_queries(spec, 4, 2, seed=27, num_new=2)
    moved = cache.clone().to("cuda")
    out, lse = kernel.decode(
        q.cuda(),
        moved.k,
        moved.v,
        moved.lengths,
        block_table=moved.block_table,
        k_new=k_new.cuda(),
        v_new=v_new.cuda(),
        return_lse=True,
    )
    assert not decode_problems(spec, cache, out.cpu(), lse.cpu(), q, k_new, v_new)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_fp32_scores_near_1e10(kind):
    """With the scale folded into the exponent's FMA, the row maximum's exponent is its own
    rounding error (up to 512 at 1e10), and exp2 overflows: NaN or 0 rows on the GPU."""
    if kind == "prefill":
        spec = make_spec(dtype="fp32", head_dim=64, num_q_heads=4, num_kv_heads=4, mask="none")
        q, k, v, _ = make_inputs(spec, 2, 256, 300, seed=28, scale=1e10, device="cuda")
        out, lse = load_kernel(spec).attention(q, k, v, return_lse=True)
        assert_matches_reference(spec, out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())
        return
    spec = make_decode_spec(
        "contiguous",
        None,
        dtype="fp32",
        head_dim=64,
        num_q_heads=4,
        num_kv_heads=4,
        mask="none",
        max_query_tokens=4,
    )
    cache = make_cache(spec, [300, 1000], seed=29)
    q, *_ = make_queries(spec, 2, 4, seed=29, scale=1e10)
    moved = cache.clone().to("cuda")
    out, lse = load_decode(spec).decode(q.cuda(), moved.k, moved.v, moved.lengths, return_lse=True)
    assert not decode_problems(spec, cache, out.cpu(), lse.cpu(), q)


def test_a_key_block_all_minus_inf_for_a_row():
    spec = make_spec(dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2, mask="none")
    q, k, v, _ = make_inputs(spec, 1, 300, 1000, seed=30, device="cuda")
    q[..., 0] = q[..., 0].abs() + 0.5
    k[..., :256, 0] = float("-inf")  # more than one key block of every config
    out, lse = load_kernel(spec).attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())
