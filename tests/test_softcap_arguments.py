"""softcap at every public entry point: as in flash-attn, only softcap > 0 caps the scores
(None, 0 and negative values are off); NaN, inf and non-numbers are a ValueError naming
softcap, never a NoKernelError that asks for a spec with that value."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attngen
from attngen.runtime.arguments import softcap_value
from attngen.runtime.hf import attngen_attention
from tests.test_runtime import _cache_case, qkv
from tests.test_runtime_refusals import dense_expected


def _calls():
    """One call per public entry point, by softcap, each served by the toy causal fp32 kernels
    (no softcap) when softcap is off."""
    q, k, v = qkv(2, 6, 6)
    flash_qkv = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    kv = torch.stack(flash_qkv[1:], dim=2)
    layer = torch.nn.Module()
    layer.is_causal, layer.layer_idx = True, 0

    def kvcache(cap):
        cq, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
        return attngen.flash_attn_with_kvcache(
            cq, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True, softcap=cap
        )

    return {
        "sdpa": lambda cap: attngen.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, causal_align="bottom_right", softcap=cap
        ),
        "flash": lambda cap: attngen.flash_attn_func(*flash_qkv, causal=True, softcap=cap),
        "kvpacked": lambda cap: attngen.flash_attn_kvpacked_func(
            flash_qkv[0], kv, causal=True, softcap=cap
        ),
        "varlen": lambda cap: attngen.flash_attn_varlen_func(
            *packed, cu, cu, 4, 4, causal=True, softcap=cap
        ),
        "kvcache": kvcache,
        "transformers": lambda cap: attngen_attention(layer, q, k, v, None, softcap=cap)[0],
    }


NAMES = ["sdpa", "flash", "kvpacked", "varlen", "kvcache", "transformers"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cap", [-1.0, -30, -1e-9])
def test_a_negative_softcap_is_off_as_in_flash_attn(toy_kernels, name, cap):
    """flash-attn activates softcapping only for softcap > 0: a negative value runs the module
    without softcap, byte for byte the softcap=0.0 call (it used to ask for a module built
    with that negative softcap)."""
    call = _calls()[name]
    off = call(0.0 if name != "sdpa" else None)
    module = attngen.last_dispatch().module
    got = call(cap)
    assert attngen.last_dispatch().module == module and "softcap" not in module
    assert torch.equal(got, off)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cap", [math.nan, math.inf, -math.inf, np.float32("nan"), True, "5"])
def test_nan_inf_and_non_numbers_are_a_value_error_naming_softcap(toy_kernels, name, cap):
    call = _calls()[name]
    with pytest.raises(ValueError, match=r"softcap: expected a finite float or None, got "):
        call(cap)


def test_the_torch_fallback_treats_a_negative_softcap_as_off():
    """The fallback once formed -c * tanh(s / -c), which is softcap c: a negative value capped
    the scores at |c| instead of leaving them alone."""
    q, k, v = qkv(1, 5, 7)
    mask = torch.rand(1, 4, 5, 7, generator=torch.Generator().manual_seed(2)) > 0.3
    with pytest.warns(UserWarning, match="attn_mask"):
        out = attngen.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True, softcap=-0.5, fallback="sdpa"
        )
    # Note: fp32 attention over 7 keys against float64, as in test_runtime_refusals; a cap at
    # 0.5 flattens the scores and moves the outputs by O(0.1).
    torch.testing.assert_close(out.double(), dense_expected(q, k, v, mask), rtol=0, atol=1e-5)


def test_softcap_value_takes_numbers_and_names_the_rest():
    assert softcap_value(None) == 0.0 and softcap_value(0) == 0.0
    assert softcap_value(-2.5) == 0.0 and softcap_value(np.int64(-3)) == 0.0
    for given, taken in ((30, 30.0), (5.0, 5.0), (np.float32(2.0), 2.0), (np.float64(7), 7.0)):
        value = softcap_value(given)
        assert value == taken and type(value) is float
    for bad in (math.nan, math.inf, True, "5", torch.tensor(5.0), [5.0]):
        with pytest.raises(ValueError, match=r"softcap: .*got .*None, 0 or a negative value"):
            softcap_value(bad)
