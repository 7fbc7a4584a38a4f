"""Any head dim 1..256: the kernels pad D and DV to a power of two >= 16 and mask the padded
lanes on every load and store, for prefill, varlen and decode; TMA only where a row is a
multiple of 16 bytes (tiling.prefill.tma_strides_aligned), and the tiling model follows."""

from __future__ import annotations

import pytest

from attngen.spec import KernelKind, module_name
from attngen.tiling.code_paths import code_paths
from attngen.tiling.prefill import derive_tiles, padded_head_dim
from attngen.tiling.rows import tma_strides_aligned
from tests.decode_harness import (
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
)
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec
from tests.test_varlen_properties import (
    assert_each_sequence_matches,
    cu_seqlens,
    load_varlen,
    packed_inputs,
)


@pytest.mark.parametrize(
    "dims, dtype, mask, arch",
    [
        ((1, 1), "fp32", "causal", "sm90"),
        ((3, 5), "fp16", "none", "sm80"),
        ((59, 59), "fp16", "causal", "sm90"),  # 118-byte rows: pointer loads on Hopper
        ((111, 40), "fp16", "sliding_window", "sm80"),
        ((200, 200), "fp16", "causal", "sm90"),
    ],
)
def test_prefill_at_any_head_dim_matches_the_reference(dims, dtype, mask, arch):
    fields = dict(head_dim=dims[0], head_dim_v=dims[1], dtype=dtype, mask=mask)
    if mask == "sliding_window":
        fields.update(window_left=5, window_right=2)
    spec = make_spec(**fields)
    kernel = load_kernel(spec, arch=arch)
    q, k, v, *_ = make_inputs(spec, 2, 19, 23, seed=dims[0])
    out, lse = kernel.attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v)


def test_varlen_at_an_odd_head_dim_matches_per_sequence():
    spec = make_spec(head_dim=59, dtype="fp16", mask="causal", kernels=["varlen"])
    lengths_q, lengths_k = [5, 0, 17], [9, 3, 17]
    q, k, v, slopes = packed_inputs(spec, lengths_q, lengths_k, seed=2)
    out, lse = load_varlen(spec, 16, 16).attention_varlen(
        q, k, v, cu_seqlens(lengths_q), cu_seqlens(lengths_k), 17, 17, return_lse=True
    )
    assert_each_sequence_matches(spec, out, lse, q, k, v, lengths_q, lengths_k, slopes)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_decode_at_an_odd_head_dim_appends_and_matches(layout):
    spec = make_decode_spec(
        layout, head_dim=59, head_dim_v=33, dtype="fp16", mask="causal", max_query_tokens=2
    )
    cache = make_cache(spec, [7, 20], seed=4, room=2)
    q, k_new, v_new, slopes = make_queries(spec, 2, 2, seed=4, num_new=2)
    out, lse = run_decode(load_decode(spec), cache, q, k_new, v_new, slopes)
    assert not decode_problems(spec, cache, out, lse, q, k_new, v_new, slopes)


def test_tma_only_for_rows_of_16_byte_multiples():
    odd, even = make_spec(head_dim=59), make_spec(head_dim=72)
    assert not tma_strides_aligned(odd) and tma_strides_aligned(even)
    assert "not multiples of 16 B" in code_paths(odd, "sm90", KernelKind.prefill).why_not_tma
    assert code_paths(even, "sm90", KernelKind.prefill).tma
    assert not tma_strides_aligned(make_spec(head_dim=64, head_dim_v=60))  # DV counts too
    assert tma_strides_aligned(make_spec(head_dim=60, dtype="fp32"))  # 240 bytes
    # the model leaves the TMA barriers out where the kernel has no TMA loads
    assert not derive_tiles(odd, "sm90").tma and derive_tiles(even, "sm90").tma
    assert derive_tiles(odd, "sm90").dims["D"] == padded_head_dim(59) == 64
    # rows that are not 16-element aligned are read element by element, unbuffered: a stage
    # more costs no shared memory (measured: tests/test_verify_tiling.py)
    by_stages = {
        c.config.num_stages: c.smem_bytes
        for c in derive_tiles(odd, "sm80").candidates
        if (c.config.block_m, c.config.block_n, c.config.num_warps) == (64, 64, 4)
    }
    assert len(set(by_stages.values())) == 1 and not derive_tiles(odd, "sm80").pipelined
    assert derive_tiles(make_spec(head_dim=64), "sm80").pipelined
    assert padded_head_dim(1) == 16 and padded_head_dim(129) == 256


def test_module_names_carry_the_exact_head_dims():
    spec = make_spec(head_dim=59, head_dim_v=111)
    assert module_name(spec, KernelKind.prefill).startswith("t_prefill_fp16_d59_dv111_")
