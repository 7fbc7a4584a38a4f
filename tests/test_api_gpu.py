"""The API-level properties of decode and varlen on CUDA (the H200): `pytest -m gpu`.

The same draws and checks as tests/test_api_kvcache.py and tests/test_api_varlen.py, run with
the committed generated/ modules (bf16, Llama-3-8B shapes: 32 query heads over 8 KV heads,
head dim 128; the Llama-3 paged-16 and Qwen2.5 contiguous decode modules, the Mistral
window-4095 paged-64 one, the Llama-3 and Mistral varlen modules) at real lengths. Every
cache, packed and index tensor sits inside a sentinel-filled buffer whose guard is at least one
cache row or page on each side, so a store one row or page too far is seen. Out-of-bounds
behaviour differs between the interpreter and the GPU (a stray store that the CPU run survives
can be an illegal address here, and the reverse), so this run is not optional.

Out-of-bounds accesses cannot be isolated on CUDA (no fork): an illegal address ends the CUDA
context and the tests after it fail too; read the first failure. tools/gpu_api.sh runs this file.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from attngen.runtime.registry import current_registry, load_kernels, use_registry
from tests.api_harness import ApiKernels, empty_registry
from tests.api_kv_cases import KvFlavor, kv_cases
from tests.test_api_kvcache import check_kvcache
from tests.test_api_varlen import Flavor, check_packed, packed_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

# Llama-3's causal attention: paged-16 decode (one query token), Qwen2.5's contiguous decode
# (four), Llama-3's varlen; Mistral's window of 4095 keys: paged-64 decode and varlen.
KV_FLAVORS = (
    KvFlavor(
        "bf16",
        128,
        True,
        (-1, -1),
        0.0,
        False,
        "qwen2_5_7b",
        "llama3_8b",
        "llama3_8b",
        page_size=16,
        max_query_tokens=(4, 1),
    ),
    KvFlavor(
        "bf16",
        128,
        True,
        (4095, -1),
        0.0,
        False,
        None,
        "mistral_7b",
        "mistral_7b",
        page_size=64,
        max_query_tokens=(1, 1),
    ),
    # flash-attn's default causal=False with one query token is the causal decode step
    KvFlavor(
        "bf16",
        128,
        False,
        (-1, -1),
        0.0,
        False,
        "qwen2_5_7b",
        "llama3_8b",
        "llama3_8b",
        page_size=16,
        max_query_tokens=(4, 1),
        one_token_only=True,
    ),
)
KV_LENGTHS = (0, 1, 15, 16, 17, 63, 64, 65, 1000, 4095, 4097, 5000)
PACKED_FLAVORS = (
    Flavor("bf16", 128, True, (-1, -1), 0.0, False, "llama3_8b"),
    Flavor("bf16", 128, True, (4095, -1), 0.0, False, "mistral_7b"),
)
PACKED_LENGTHS = (0, 1, 63, 64, 65, 127, 128, 129, 1000, 4500)
HEADS = ((32, 8), (8, 8), (32, 1), (28, 4))


@pytest.fixture(scope="module")
def gpu_kernels(tmp_path_factory: pytest.TempPathFactory):
    """generated/ as the registry, module_for returning this GPU's modules."""
    saved = current_registry()
    registry = load_kernels()
    major, minor = torch.cuda.get_device_capability()
    kernels = ApiKernels(
        registry, empty_registry(tmp_path_factory.mktemp("empty")), arch=f"sm{major}{minor}"
    )
    use_registry(registry)
    try:
        yield kernels
    finally:
        use_registry(saved)


@settings(max_examples=80, deadline=None)
@given(kv_cases(flavors=KV_FLAVORS, lengths=KV_LENGTHS, heads=HEADS))
def test_kvcache_on_cuda(gpu_kernels, case):
    check_kvcache(gpu_kernels, case, device="cuda")


@settings(max_examples=80, deadline=None)
@given(packed_cases(flavors=PACKED_FLAVORS, lengths=PACKED_LENGTHS, heads=HEADS))
def test_packed_sequences_on_cuda(gpu_kernels, case):
    check_packed(gpu_kernels, case, device="cuda")
