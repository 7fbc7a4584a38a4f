"""The warp-specialized (Gluon) forward of sm90 prefill modules on the H200: `pytest -m gpu`.

Against the float64 reference (RELIABILITY.md's criterion, attngen.reference): lengths at
and around the CTA's 128 rows, Nq != Nk in both alignments (rows that see no key: O 0, LSE
-inf), GQA 7:1, D 64/128/256, bf16 and fp16; bitwise repeatable; the flash-attn layout
entry points; the backward after a Gluon forward (gradients vs float64); the path in
forward_path() and last_dispatch(); outputs poisoned before and guard regions around them.
"""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.reference import visible_mask
from attngen.reference.backward import compare_gradients
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec
from tests.safety_harness import GUARD, guarded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

# (dtype, D, mask, align, HQ, HKV, B, Nq, Nk)
CASES = [
    ("bf16", 64, "none", None, 2, 2, 1, 1, 1),
    ("bf16", 128, "causal", "bottom_right", 2, 2, 1, 1, 1),
    ("bf16", 128, "causal", "bottom_right", 4, 2, 2, 127, 127),
    ("fp16", 64, "causal", "bottom_right", 3, 3, 2, 129, 129),
    ("fp16", 64, "none", None, 3, 3, 2, 129, 129),
    ("bf16", 128, "causal", "bottom_right", 14, 2, 1, 1000, 1000),
    ("bf16", 128, "none", None, 14, 2, 1, 1000, 1000),
    ("fp16", 256, "causal", "bottom_right", 2, 1, 2, 300, 300),
    ("bf16", 256, "none", None, 2, 1, 2, 300, 300),
    ("bf16", 128, "causal", "bottom_right", 2, 2, 1, 100, 300),
    ("bf16", 128, "causal", "top_left", 2, 2, 1, 100, 300),
    ("bf16", 64, "causal", "bottom_right", 2, 2, 1, 300, 100),
    ("fp16", 64, "causal", "top_left", 2, 2, 1, 300, 100),
    ("bf16", 256, "causal", "bottom_right", 4, 4, 1, 257, 1000),
    ("bf16", 256, "causal", "top_left", 4, 4, 1, 1000, 257),
]


def _spec(dtype, d, mask, align, hq, hkv, backward=False):
    fields = dict(dtype=dtype, head_dim=d, num_q_heads=hq, num_kv_heads=hkv, mask=mask)
    if align is not None:
        fields["causal_align"] = align
    return make_spec(**fields, backward=backward)


def _gluon_module(spec):
    """The spec's module with the Gluon kernel on every launch: small launches (at most
    POINTER_LOADS_UP_TO pairs) otherwise take the tile-level kernel for host time."""
    module = load_kernel(spec)
    module.POINTER_LOADS_UP_TO = 0
    return module


def _ids(case):
    dtype, d, mask, align, hq, hkv, b, nq, nk = case
    return f"{dtype}-d{d}-{mask}{'-' + align if align else ''}-{hq}:{hkv}-b{b}-{nq}x{nk}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_gluon_forward_matches_the_float64_reference(case):
    dtype, d, mask, align, hq, hkv, b, nq, nk = case
    spec = _spec(dtype, d, mask, align, hq, hkv)
    module = _gluon_module(spec)
    q, k, v, _ = make_inputs(spec, b, nq, nk, seed=31, device="cuda")
    out, lse = module.attention(q, k, v, return_lse=True)
    assert module.forward_path() == module.GLUON_PATH
    assert_matches_reference(spec, out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())
    again, lse_again = module.attention(q, k, v, return_lse=True)  # from the call plan
    assert torch.equal(again, out) and torch.equal(lse_again, lse), "not bitwise repeatable"
    flash = module.attention_flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert module.forward_path() == module.GLUON_PATH
    assert torch.equal(flash.transpose(1, 2), out)


def test_a_misaligned_base_takes_the_tile_level_kernel_and_says_why():
    spec = _spec("bf16", 128, "causal", "bottom_right", 4, 2)
    module = _gluon_module(spec)
    q, k, v, _ = make_inputs(spec, 1, 300, 300, seed=32, device="cuda")
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    shifted.copy_(q)
    out, lse = module.attention(shifted, k, v, return_lse=True)
    assert module.forward_path() == "tile-level: a base address is not 16-byte aligned"
    assert_matches_reference(spec, out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())
    module.attention(q, k, v)
    assert module.forward_path() == module.GLUON_PATH


def test_a_small_launch_takes_the_tile_level_kernel_and_says_why():
    spec = _spec("fp16", 64, "causal", "bottom_right", 4, 2)
    module = load_kernel(spec)
    q, k, v, _ = make_inputs(spec, 1, 64, 64, seed=36, device="cuda")
    out, lse = module.attention(q, k, v, return_lse=True)
    assert module.forward_path().startswith("tile-level: a launch of at most 512 ")
    assert_matches_reference(spec, out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())


@pytest.mark.parametrize("nq, nk", [(1000, 1100), (300, 1000)])
@pytest.mark.parametrize("d", [64, 256])
def test_nan_and_inf_in_keys_no_row_sees_leave_the_output_bitwise(nq, nk, d):
    """Top-left causal with more keys than queries: the last CTA's last key block holds keys
    no query sees; K NaN and V inf there must not reach the output (V's rows are zeroed)."""
    spec = _spec("bf16", d, "causal", "top_left", 4, 1)
    module = _gluon_module(spec)
    q, k, v, _ = make_inputs(spec, 2, nq, nk, seed=37, device="cuda")
    clean = module.attention(q, k, v, return_lse=True)
    unseen = ~visible_mask(spec, nq, nk, "cuda").any(dim=0)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, unseen], v_bad[:, :, unseen] = float("nan"), float("inf")
    padded = module.attention(q, k_bad, v_bad, return_lse=True)
    assert module.forward_path() == module.GLUON_PATH
    assert torch.equal(clean[0], padded[0]) and torch.equal(clean[1], padded[1])


@pytest.mark.parametrize("d", [64, 128])
def test_the_backward_after_a_gluon_forward(d):
    spec = _spec("bf16", d, "causal", "bottom_right", 4, 2, backward=True)
    module = _gluon_module(spec)
    q, k, v, _ = make_inputs(spec, 1, 129, 129, seed=33, device="cuda")
    dout = torch.randn(q.shape[:3] + (d,), generator=torch.Generator().manual_seed(34))
    dout = dout.to(q.dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = module.attention(*leaves)
    assert module.forward_path() == module.GLUON_PATH
    out.backward(dout.cuda())
    grads = [t.grad.cpu() for t in leaves]
    problems = compare_gradients(spec, grads, q.cpu(), k.cpu(), v.cpu(), dout)
    assert not problems, "; ".join(problems)


def test_last_dispatch_names_the_gluon_path():
    q = torch.randn(2, 1024, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 1024, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    attngen.flash_attn_func(q, k, v, causal=True)
    chosen = attngen.last_dispatch()
    assert chosen.module.startswith("sm90/") and chosen.forward == "gluon warp-specialized"
    shifted = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")[1:-7].view(q.shape)
    shifted.copy_(q)
    attngen.flash_attn_func(shifted, k, v, causal=True)
    assert attngen.last_dispatch().forward == "tile-level: a base address is not 16-byte aligned"
    attngen.flash_attn_func(q, k, v, causal=True)
    assert attngen.last_dispatch().forward == "gluon warp-specialized"  # from the plan


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("nq", [129, 1000])
def test_outputs_are_written_inside_their_guard_regions(flash, nq):
    """out= and the LSE poisoned with NaN, inside buffers of GUARD: every element written,
    not one guard element touched (the TMA store clips the last CTA's rows)."""
    spec = _spec("bf16", 128, "causal", "bottom_right", 4, 2)
    module = _gluon_module(spec)
    q, k, v, _ = make_inputs(spec, 2, nq, nq, seed=35, device="cuda")
    tile = 128 * 4 * 128  # a whole CTA tile of rows past the end, either layout
    shape = (2, nq, 4, 128) if flash else (2, 4, nq, 128)
    out, out_buffer = guarded(torch.full(shape, float("nan"), dtype=q.dtype, device="cuda"), tile)
    if flash:
        flash_in = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        result, lse = module.attention_flash(*flash_in, out=out, return_lse=True)
        result = result.transpose(1, 2)
    else:
        result, lse = module.attention(q, k, v, out=out, return_lse=True)
    assert module.forward_path() == module.GLUON_PATH
    torch.cuda.synchronize()
    assert not torch.isnan(result).any()
    assert (out_buffer[:tile] == GUARD).all() and (out_buffer[-tile:] == GUARD).all()
    assert_matches_reference(spec, result.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())
