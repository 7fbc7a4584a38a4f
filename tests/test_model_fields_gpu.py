"""The newer models' fields compiled for a real GPU (the H200), against the float64 reference:
tests/test_model_fields.py's cases, at the forced 16-key tiles (boundaries where the cases put
them) and at the derived tiles, in bf16 too (the interpreter's bf16 dot is not usable, so the
CPU suite runs fp16 and fp32 only). The examples' modules at real sizes are
tests/test_prefill_gpu.py's and tests/test_decode_gpu.py's.

    ATTNGEN_HYPOTHESIS_PROFILE=gpu python -m pytest -m gpu tests/test_model_fields_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.decode_harness import make_decode_spec
from tests.kernel_harness import make_spec
from tests.test_model_fields import TILE, _decode, _prefill, _varlen, model_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

TILES = [TILE, None]  # None: the derived tiles


@settings(max_examples=60, deadline=None)  # each new spec compiles a kernel
@given(model_case(), st.sampled_from(TILES), st.sampled_from(["fp16", "bf16", "fp32"]))
def test_new_fields_match_the_reference_on_the_gpu(params, tile, dtype):
    fields, seqlen_q, seqlen_k, seed = params
    _prefill(
        make_spec(**{**fields, "dtype": dtype}),
        seqlen_q,
        seqlen_k,
        seed=seed,
        tile=tile,
        device="cuda",
    )


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    ("mask", "fields"),
    [
        ("causal", dict(sinks=True)),
        ("sliding_window", dict(window_left=5, sinks=True)),
        ("chunked", dict(chunk_size=TILE + 1, sinks=True)),
        ("sliding_window", dict(window_left=5, sink_tokens=TILE)),
    ],
)
def test_prefill_and_varlen_with_the_new_fields(mask, fields, dtype, tile):
    spec = make_spec(head_dim=64, dtype=dtype, mask=mask, **fields)
    for seqlen_q, seqlen_k in ((40, 17), (200, 200), (129, 300)):
        _prefill(spec, seqlen_q, seqlen_k, seed=seqlen_k, tile=tile, device="cuda")
    _varlen(
        make_spec(kernels=["varlen"], head_dim=64, dtype=dtype, mask=mask, **fields),
        tile=tile,
        device="cuda",
    )


@pytest.mark.parametrize("block_n", [TILE, None])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize(
    ("mask", "fields"),
    [
        ("causal", dict(sinks=True)),
        ("chunked", dict(chunk_size=TILE + 1)),
        ("sliding_window", dict(window_left=7, sink_tokens=4, sinks=True)),
    ],
)
def test_decode_with_the_new_fields(mask, fields, splits, block_n):
    spec = make_decode_spec(
        "paged", 16, dtype="bf16", head_dim=64, mask=mask, max_query_tokens=2, **fields
    )
    _decode(
        spec, [0, 1, 37, 300], seed=3, num_q_tokens=2, splits=splits, block_n=block_n, device="cuda"
    )


@pytest.mark.parametrize("splits", [None, 4])
def test_decode_latent_attention_dims_on_the_gpu(splits):
    """MLA's absorbed decode at DeepSeek-V3's shape: 576 / 512, one KV head, 128 query heads,
    64-token pages, the values a view of the keys' first 512 dims."""
    spec = make_decode_spec(
        "paged",
        64,
        dtype="bf16",
        head_dim=576,
        head_dim_v=512,
        num_q_heads=128,
        num_kv_heads=1,
        kernels=["decode"],
    )
    _decode(
        spec, [70, 1, 2049], seed=6, latent_values=True, splits=splits, block_n=None, device="cuda"
    )
