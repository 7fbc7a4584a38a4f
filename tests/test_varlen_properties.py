"""The varlen kind: packed sequences against the float64 reference, one sequence at a time.

Hypothesis draws spec fields (dtype, head dims, GQA, masks, alignments, windows, softcap,
ALiBi), block sizes and per-sequence lengths biased to 0, 1 and the block boundaries; the
packed tensors carry NaN in rows no sequence covers, which must never reach an output.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attngen.reference import compare_to_reference
from tests.kernel_harness import TORCH_DTYPES, load_kernel, make_spec
from tests.test_prefill_properties import spec_fields


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_inputs(spec, lengths_q, lengths_k, seed, pad=3):
    """Packed q, k, v with `pad` NaN rows after the last sequence, and ALiBi slopes."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[spec.dtype.value]

    def randn(rows, heads, dim):
        t = torch.randn(rows + pad, heads, dim, generator=gen).to(dtype)
        t[rows:] = float("nan")
        return t

    q = randn(sum(lengths_q), spec.num_q_heads, spec.head_dim)
    k = randn(sum(lengths_k), spec.num_kv_heads, spec.head_dim)
    v = randn(sum(lengths_k), spec.num_kv_heads, spec.value_head_dim)
    slopes = None
    if spec.alibi:
        hq = spec.num_q_heads
        slopes = 2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)
    return q, k, v, slopes


def assert_each_sequence_matches(spec, out, lse, q, k, v, lengths_q, lengths_k, slopes):
    cu_q, cu_k = cu_seqlens(lengths_q).tolist(), cu_seqlens(lengths_k).tolist()
    for b in range(len(lengths_q)):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])

        def heads_first(t):
            return t.transpose(0, 1)[None]

        problems = compare_to_reference(
            spec,
            heads_first(out[rows_q]),
            lse[:, rows_q][None],
            heads_first(q[rows_q]),
            heads_first(k[rows_k]),
            heads_first(v[rows_k]),
            alibi_slopes=slopes,
        )
        assert not problems, f"sequence {b}: " + "; ".join(problems)
    covered = cu_q[-1]
    assert torch.all(out[covered:] == 0) and torch.all(lse[:, covered:] == float("-inf"))


def load_varlen(spec, block_m, block_n):
    return load_kernel(spec, block_m, block_n, kind="varlen")


@st.composite
def case(draw):
    fields = draw(spec_fields())
    block_m = draw(st.sampled_from([16, 32]))
    block_n = draw(st.sampled_from([16, 32]))
    lengths = st.sampled_from([0, 1, 3, block_m - 1, block_m, block_m + 1, 2 * block_n + 1])
    batch = draw(st.integers(1, 3))
    lengths_q = draw(st.lists(lengths, min_size=batch, max_size=batch))
    same = draw(st.booleans())
    lengths_k = lengths_q if same else draw(st.lists(lengths, min_size=batch, max_size=batch))
    return fields, block_m, block_n, lengths_q, lengths_k, draw(st.integers(0, 2**16))


@given(case())
@example(  # GQA 7:1, a sequence with more queries than keys under bottom-right causal, an
    # empty sequence and a one-token sequence in one batch
    (
        dict(
            dtype="fp16",
            head_dim=64,
            mask="causal",
            causal_align="bottom_right",
            num_kv_heads=1,
            num_q_heads=7,
        ),
        16,
        16,
        [33, 0, 1],
        [17, 0, 1],
        0,
    )
)
@example(  # window, softcap and ALiBi, per-sequence top-left alignment, head dim 80
    (
        dict(
            dtype="bf16",
            head_dim=80,
            mask="sliding_window",
            causal_align="top_left",
            window_left=1,
            window_right=3,
            num_kv_heads=1,
            num_q_heads=2,
            softcap=30.0,
            alibi=True,
        ),
        32,
        16,
        [17, 5],
        [31, 0],
        1,
    )
)
def test_varlen_matches_reference_per_sequence(params):
    fields, block_m, block_n, lengths_q, lengths_k, seed = params
    spec = make_spec(**fields, kernels=["varlen"])
    kernel = load_varlen(spec, block_m, block_n)
    q, k, v, slopes = packed_inputs(spec, lengths_q, lengths_k, seed)
    out, lse = kernel.attention_varlen(
        q,
        k,
        v,
        cu_seqlens(lengths_q),
        cu_seqlens(lengths_k),
        max(lengths_q),
        max(lengths_k),
        alibi_slopes=slopes,
        return_lse=True,
    )
    assert out.shape == (q.shape[0], spec.num_q_heads, spec.value_head_dim)
    assert lse.shape == (spec.num_q_heads, q.shape[0]) and lse.dtype == torch.float32
    assert_each_sequence_matches(spec, out, lse, q, k, v, lengths_q, lengths_k, slopes)


def test_seqused_k_reads_a_cache_in_place():
    """Keys of sequence b start at cu_seqlens_k[b]; only seqused_k[b] of them are read: the
    rest (NaN here, a cache's unwritten tail) never reach the output."""
    spec = make_spec(dtype="fp32", head_dim=16, num_q_heads=2, num_kv_heads=1, kernels=["varlen"])
    kernel = load_varlen(spec, 16, 16)
    capacity, used = 20, [7, 0, 20]
    q, _, _, _ = packed_inputs(spec, [1, 1, 1], [1], seed=3, pad=0)
    cache = torch.randn(3 * capacity, 1, 16, generator=torch.Generator().manual_seed(4))
    values = torch.randn_like(cache)
    for b, n in enumerate(used):
        cache[b * capacity + n : (b + 1) * capacity] = float("nan")
    steps = torch.arange(4, dtype=torch.int32)
    out, lse = kernel.attention_varlen(
        q,
        cache,
        values,
        steps,
        steps * capacity,
        1,
        capacity,
        seqused_k=torch.tensor(used, dtype=torch.int32),
        return_lse=True,
    )
    dense_k = [cache[b * capacity : b * capacity + n] for b, n in enumerate(used)]
    dense_v = [values[b * capacity : b * capacity + n] for b, n in enumerate(used)]
    assert_each_sequence_matches(
        spec, out, lse, q, torch.cat(dense_k), torch.cat(dense_v), [1, 1, 1], used, None
    )


def test_varlen_validates_inputs():
    spec = make_spec(dtype="fp32", head_dim=16, kernels=["varlen"])
    kernel = load_varlen(spec, 16, 16)
    q = torch.randn(5, 4, 16)
    k = v = torch.randn(5, 2, 16)
    cu = cu_seqlens([5])
    with pytest.raises(ValueError, match="cu_seqlens_q: expected a 1-D int32 tensor"):
        kernel.attention_varlen(q, k, v, cu.long(), cu, 5, 5)
    with pytest.raises(ValueError, match=r"expected the same shape \[B \+ 1\]"):
        kernel.attention_varlen(q, k, v, cu, cu_seqlens([2, 3]), 5, 5)
    with pytest.raises(ValueError, match="max_seqlen_q: expected a Python int >= 0"):
        kernel.attention_varlen(q, k, v, cu, cu, torch.tensor(5), 5)
    with pytest.raises(ValueError, match=r"q: expected rank 3 \[T, H, D\]"):
        kernel.attention_varlen(q[None], k, v, cu, cu, 5, 5)
    empty = kernel.attention_varlen(
        q[:0], k[:0], v[:0], cu_seqlens([0, 0]), cu_seqlens([0, 0]), 0, 0
    )
    assert empty.shape == (0, 4, 16)
