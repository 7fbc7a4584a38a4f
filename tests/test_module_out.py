"""out= in the generated modules' entry points: the caller's tensor, of the output's shape,
dtype and device and any strides whose elements do not overlap, is written in place and
returned, bitwise what the module allocates itself; anything else is refused by name."""

from __future__ import annotations

import pytest
import torch

from tests.decode_harness import load_decode, make_cache, make_decode_spec, make_queries
from tests.kernel_harness import load_kernel, make_inputs, make_spec

SPEC = make_spec(name="mo", dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=2)
DECODE = make_decode_spec(
    "contiguous",
    None,
    name="mod",
    dtype="fp32",
    head_dim=16,
    num_q_heads=4,
    num_kv_heads=2,
    max_query_tokens=2,
)


def heads_last_out(batch, seqlen, heads, dim):
    """A [B, H, N, D] view of a NaN-filled contiguous [B, N, H, D] tensor (flash layout)."""
    return torch.full((batch, seqlen, heads, dim), float("nan")).transpose(1, 2)


def test_prefill_writes_a_flash_layout_out_bitwise_as_its_own():
    module = load_kernel(SPEC, kind="prefill")
    q, k, v = make_inputs(SPEC, 2, 9, 13, seed=3)[:3]
    expected, lse = module.attention(q, k, v, return_lse=True)
    out = heads_last_out(2, 9, 4, 16)
    got, got_lse = module.attention(q, k, v, return_lse=True, out=out)
    assert got is out and torch.equal(out, expected) and torch.equal(got_lse, lse)
    assert module.ACCEPTS_OUT is True


@pytest.mark.parametrize(
    "make_out, message",
    [
        (lambda q: torch.empty(2, 4, 9, 8), "expected shape"),
        (lambda q: torch.empty(2, 4, 9, 16, dtype=torch.float16), "expected shape"),
        (lambda q: torch.empty(1, 1, 1, 16).expand(2, 4, 9, 16), "share memory"),
        (lambda q: q, "shares memory with q"),
        (lambda q: [0.0], "expected a torch.Tensor"),
    ],
)
def test_prefill_refuses_an_out_it_cannot_write(make_out, message):
    module = load_kernel(SPEC, kind="prefill")
    q, k, v = make_inputs(SPEC, 2, 9, 9, seed=4)[:3]
    with pytest.raises(ValueError, match=f"out: .*{message}"):
        module.attention(q, k, v, out=make_out(q))


def test_varlen_zeroes_the_rows_no_sequence_covers_in_out():
    module = load_kernel(SPEC, kind="varlen")
    q, k, v = (
        make_inputs(SPEC, 1, 12, 12, seed=5)[i][0].transpose(0, 1).contiguous() for i in range(3)
    )
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)  # rows 10 and 11: no sequence
    expected = module.attention_varlen(q, k, v, cu, cu, 6, 6)
    out = torch.full((12, 16, 4), float("nan")).transpose(1, 2)
    got = module.attention_varlen(q, k, v, cu, cu, 6, 6, out=out)
    assert got is out and torch.equal(out, expected) and not out[10:].any()
    with pytest.raises(ValueError, match="out: expected shape"):
        module.attention_varlen(q, k, v, cu, cu, 6, 6, out=torch.empty(11, 4, 16))


def test_decode_writes_out_in_place_and_refuses_one_sharing_the_cache():
    module = load_decode(DECODE)
    cache = make_cache(DECODE, [3, 7], seed=6, room=2)
    q, k_new, v_new, _ = make_queries(DECODE, 2, 2, seed=7, num_new=2)
    expected, lse = module.decode(
        q, cache.k, cache.v, cache.lengths, k_new=k_new, v_new=v_new, return_lse=True
    )
    out = heads_last_out(2, 2, 4, 16)
    got, got_lse = module.decode(
        q, cache.k, cache.v, cache.lengths, k_new=k_new, v_new=v_new, return_lse=True, out=out
    )
    assert got is out and torch.equal(out, expected) and torch.equal(got_lse, lse)
    with pytest.raises(ValueError, match="out: shares memory with k_cache"):
        module.decode(
            q, cache.k, cache.v, cache.lengths, out=cache.k.view(-1)[:256].view(2, 4, 2, 16)
        )
