"""The warp-specialized (Gluon) dK/dV backward of the sm90 prefill modules on the H200:
`pytest -m gpu tests/test_gluon_backward_gpu.py`.

Each case builds its module into a folder of its own and runs the public functions with grad
and deterministic=False (flash_attn_func: bottom-right causal, none, sliding windows, ALiBi
slopes [HQ] or [B, HQ], softcap; the SDPA drop-in: top-left is_causal), dQ, dK, dV against the
float64 reference (RELIABILITY.md's rule, attngen.reference.backward.compare_gradients), and
the module's backward_path() must name the Gluon kernel (last_backward(): the atomic path).
The modules send causal calls with fewer than GLUON_BWD_SHORT_CAUSAL_KEYS keys to their
tile-level kernels (faster there); the cases turn that rule off so that short shapes test the
Gluon kernel, and one case keeps it.
dK and dV are summed in registers in a fixed order: bitwise repeatable (dQ by atomics is not).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attngen
from attngen.build import plan_build, write_build
from attngen.reference.backward import compare_gradients
from attngen.runtime import last_backward
from attngen.runtime.ops import ATOMIC, DETERMINISTIC
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from tests.kernel_harness import make_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

# (B, Nq, Nk, HQ, HKV, D, mask, align, dtype)
CASES = [
    (1, 1, 1, 2, 2, 64, "none", None, "bf16"),
    (1, 1, 1, 2, 2, 128, "causal", "bottom_right", "fp16"),
    (2, 63, 65, 4, 2, 64, "none", None, "bf16"),
    (2, 129, 129, 3, 3, 64, "causal", "bottom_right", "fp16"),
    (2, 127, 127, 4, 2, 128, "causal", "bottom_right", "bf16"),
    (1, 100, 300, 2, 2, 128, "causal", "bottom_right", "bf16"),
    (1, 100, 300, 2, 2, 128, "causal", "top_left", "fp16"),
    (1, 300, 100, 2, 2, 64, "causal", "bottom_right", "bf16"),
    (1, 300, 100, 2, 2, 64, "causal", "top_left", "fp16"),
    (1, 1000, 1000, 14, 2, 128, "causal", "bottom_right", "bf16"),
    (1, 1000, 1000, 7, 1, 128, "none", None, "fp16"),
    (2, 1024, 1024, 8, 8, 64, "causal", "bottom_right", "bf16"),
    (1, 2048, 2048, 4, 1, 64, "none", None, "bf16"),
    (1, 777, 2049, 4, 2, 128, "causal", "top_left", "bf16"),
    # sliding windows (flash_attn_func's window_size, -1 a side without bound): left or right
    # edges inside one query block, across several, both sides, Nq != Nk, rows that see no key
    (2, 1000, 1000, 4, 2, 128, "window:100:0", "bottom_right", "bf16"),
    (1, 1100, 1100, 4, 4, 64, "window:300:0", "bottom_right", "fp16"),
    (1, 700, 900, 6, 2, 128, "window:64:64", "bottom_right", "bf16"),
    (1, 900, 300, 2, 2, 64, "window:30:5", "bottom_right", "bf16"),
    (1, 513, 1500, 2, 1, 128, "window:-1:3", "bottom_right", "fp16"),
    (2, 2048, 2048, 4, 2, 128, "window:1024:0", "bottom_right", "bf16"),
    # ALiBi (per-head slopes: [HQ], or [B, HQ] with two batches), with a mask and without
    (2, 1000, 1000, 8, 2, 128, "causal+alibi", "bottom_right", "bf16"),
    (1, 700, 900, 4, 4, 64, "none+alibi", None, "fp16"),
    (1, 1100, 1100, 4, 2, 128, "window:300:0+alibi", "bottom_right", "bf16"),
    # softcap (SOFTCAP: tanh far from linear at these scores), the top-left one through SDPA
    (2, 1000, 1000, 8, 2, 128, "causal+softcap", "bottom_right", "bf16"),
    (1, 700, 900, 4, 4, 64, "none+softcap", None, "fp16"),
    (1, 777, 2049, 4, 2, 128, "causal+softcap", "top_left", "bf16"),
    (1, 1100, 1100, 4, 2, 128, "window:300:0+softcap", "bottom_right", "bf16"),
    # D 64 causal with LONG_CAUSAL_KEYS keys or more: the long form (BLOCK_M 128, dQ by rows)
    (1, 4000, 4100, 2, 1, 64, "causal", "bottom_right", "bf16"),
    (1, 4100, 4100, 2, 2, 64, "causal", "top_left", "fp16"),
]
SOFTCAP = 5.0


def _ids(case):
    b, nq, nk, hq, hkv, d, mask, align, dtype = case
    return f"{dtype}-d{d}-{mask}{'-' + align if align else ''}-{hq}:{hkv}-b{b}-{nq}x{nk}"


def _window(mask):
    """(left, right) of a "window:L:R" case (-1: no bound, the spec's 2**31 - 1), else None."""
    mask = mask.split("+")[0]
    return tuple(int(x) for x in mask.split(":")[1:]) if mask.startswith("window") else None


def _slopes(case, device="cuda"):
    """ALiBi slopes of a "+alibi" case ([B, HQ] with two batches, else [HQ]), else None."""
    b, hq, mask = case[0], case[3], case[6]
    if "+alibi" not in mask:
        return None
    slopes = torch.exp2(-8.0 * torch.arange(1, hq + 1, device=device) / hq)
    return torch.stack([slopes, slopes * 0.5]) if b == 2 else slopes


def _compare(spec, case, grads, inputs):
    """compare_gradients' problems; [B, HQ] slopes one batch at a time (the reference takes
    [HQ] ones)."""
    slopes = _slopes(case, "cpu")
    if slopes is None or slopes.dim() == 1:
        return compare_gradients(spec, grads, *inputs, alibi_slopes=slopes)
    return [f"batch {b}: {problem}" for b in range(slopes.shape[0])
            for problem in compare_gradients(spec, [g[b : b + 1] for g in grads],
                                             *[t[b : b + 1] for t in inputs],
                                             alibi_slopes=slopes[b])]  # fmt: skip


def spec_for(case):
    _, _, _, hq, hkv, d, mask, align, dtype = case
    window = _window(mask)
    fields = dict(name="gluon_bwd", dtype=dtype, head_dim=d, num_q_heads=hq, num_kv_heads=hkv,
                  mask=mask.split("+")[0], backward=True, alibi="+alibi" in mask,
                  softcap=SOFTCAP if "+softcap" in mask else 0.0)  # fmt: skip
    if window:
        left, right = (2**31 - 1 if x < 0 else x for x in window)
        fields.update(mask="sliding_window", window_left=left, window_right=right)
    return make_spec(**fields, **({"causal_align": align} if align else {}))


@pytest.fixture
def built(tmp_path, monkeypatch):
    """Builds a case's module into a folder the registry alone serves; short_rule=False turns
    its short causal rule off (every call fits the Gluon kernel)."""
    saved = current_registry()

    def build(spec, short_rule=False):
        folder = tmp_path / spec.spec_hash()
        write_build(plan_build([spec]), folder)
        registry = load_kernels(folder, replace=True)
        if not short_rule:
            for entry in registry.entries:
                if not Path(entry.key).is_relative_to(folder.resolve()):
                    continue  # the on-demand cache's
                module = registry.module(entry.key)
                monkeypatch.setattr(module, "GLUON_BWD_SHORT_CAUSAL_KEYS", 0, raising=False)

    yield build
    use_registry(saved)


def run_backward(case, seed=7, apart=0.0, deterministic=False):
    """(grads, inputs, module): the public function's backward (deterministic=False);
    inputs and gradients heads first ([B, H, N, D]). apart moves q by -apart and k by +apart
    in every element: every score falls by about apart**2 * D * scale."""
    b, nq, nk, hq, hkv, d, mask, align, dtype = case
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (
        torch.randn(b, n, h, d, device="cuda", dtype=dt, generator=gen)
        for n, h in ((nq, hq), (nk, hkv), (nk, hkv), (nq, hq))
    )
    q, k = q - apart, k + apart
    softcap = SOFTCAP if "+softcap" in mask else 0.0
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if align == "top_left":  # the SDPA drop-in: is_causal top-left, [B, H, N, D] memory
        heads = [t.transpose(1, 2).contiguous() for t in leaves]  # (dQ's sum in that order too)
        out = attngen.scaled_dot_product_attention(*heads, is_causal=True, enable_gqa=hq != hkv,
                                                   softcap=softcap or None)  # fmt: skip
        out.backward(dout.transpose(1, 2))
    else:
        causal, window = mask.startswith("causal"), _window(mask) or (-1, -1)
        out = attngen.flash_attn_func(*leaves, causal=causal, window_size=window,
                                      softcap=softcap, alibi_slopes=_slopes(case),
                                      deterministic=deterministic)  # fmt: skip
        out.backward(dout)
    torch.cuda.synchronize()
    module = current_registry().module(last_backward().key)
    inputs = [t.transpose(1, 2).cpu() for t in (q, k, v, dout)]
    grads = [t.grad.transpose(1, 2).cpu() for t in leaves]
    return grads, inputs, module


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradients_match_the_float64_reference(case, built):
    spec = spec_for(case)
    built(spec)
    grads, inputs, module = run_backward(case)
    assert module.backward_path() == module.GLUON_BACKWARD_PATH
    assert last_backward().path == ATOMIC
    problems = _compare(spec, case, grads, inputs)
    assert not problems, "; ".join(problems)
    again, _, _ = run_backward(case)
    assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2])


def test_causal_key_blocks_in_any_head_order_give_the_same_gradients(built, monkeypatch):
    """The causal CTA order with 1, 2 and 4 (the module's) KV heads' key blocks interleaved
    (HEAVY_FIRST; six (batch, KV head)s, so 4 leaves a group of 2 last): dK and dV bitwise the
    module's order's (each CTA sums its own in a fixed order), dQ against the float64
    reference (its atomics' order moves). tools/ab_alt/bwd_heads_in_l2.patch chooses 1 or 2
    per call where the heads' rows pass L2."""
    case = (2, 1000, 1000, 6, 3, 128, "causal", "bottom_right", "bf16")
    spec = spec_for(case)
    built(spec)
    grads, inputs, module = run_backward(case)
    assert module.backward_path() == module.GLUON_BACKWARD_PATH
    assert module._GLUON_BWD_CONSTEXPRS["HEAVY_FIRST"] == 4
    for heads in (2, 1):
        monkeypatch.setitem(module._GLUON_BWD_CONSTEXPRS, "HEAVY_FIRST", heads)
        again, _, _ = run_backward(case)
        assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]), heads
        problems = _compare(spec, case, again, inputs)
        assert not problems, "; ".join(problems)


@pytest.mark.parametrize("case", [CASES[i] for i in (2, 5, 9, 11, 16, 20, 23)], ids=_ids)
def test_deterministic_calls_run_it_without_dq_and_repeat_bitwise(case, built):
    """deterministic=True: the Gluon kernel without dQ, dQ from the deterministic dQ kernel;
    every gradient bitwise the same on a second run."""
    spec = spec_for(case)
    built(spec)
    grads, inputs, module = run_backward(case, deterministic=True)
    assert module.backward_path() == module.GLUON_BACKWARD_PATH + module.GLUON_DETERMINISTIC
    assert last_backward().path == DETERMINISTIC
    problems = _compare(spec, case, grads, inputs)
    assert not problems, "; ".join(problems)
    again, _, _ = run_backward(case, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


# D 256's form (BLOCK_N 64, a P and a dS warpgroup; served since these cases passed): none and
# causal (either alignment; top-left through SDPA, dQ's sum in [B, H, N, D] order), GQA,
# Nq != Nk, partial blocks.
D256_CASES = [
    (1, 1, 1, 2, 2, 256, "none", None, "bf16"),
    (2, 63, 65, 4, 2, 256, "none", None, "bf16"),
    (2, 127, 127, 4, 2, 256, "causal", "bottom_right", "fp16"),
    (1, 100, 300, 2, 2, 256, "causal", "bottom_right", "bf16"),
    (1, 777, 2049, 4, 2, 256, "causal", "top_left", "bf16"),
    (1, 1000, 1000, 8, 2, 256, "causal", "bottom_right", "bf16"),
    (1, 1000, 1000, 7, 1, 256, "none", None, "fp16"),
]


@pytest.mark.parametrize("case", D256_CASES, ids=_ids)
def test_d256_gradients_match_the_float64_reference(case, built):
    test_gradients_match_the_float64_reference(case, built)


@pytest.mark.parametrize("case", [D256_CASES[i] for i in (1, 5)], ids=_ids)
def test_d256_deterministic_calls_run_it_without_dq(case, built):
    test_deterministic_calls_run_it_without_dq_and_repeat_bitwise(case, built)


# More (key block, batch, KV head) tiles than an H100 or H200 has SMs (132): several a CTA where
# the kernel runs tiles in turn (tools/ab_alt/bwd_persistent*.patch); query blocks a tile not a
# multiple of the ring's stages, a partial last key block; causal tiles of unequal work.
MANY_TILES = [
    (4, 300, 300, 48, 48, 128, "none", None, "bf16"),
    (4, 300, 300, 64, 32, 64, "none", None, "fp16"),
    (4, 300, 300, 24, 24, 256, "none", None, "bf16"),
    (4, 300, 300, 48, 24, 128, "causal", "bottom_right", "bf16"),
]


@pytest.mark.parametrize("case", MANY_TILES, ids=_ids)
def test_more_tiles_than_sms_match_the_float64_reference(case, built):
    test_gradients_match_the_float64_reference(case, built)
    test_deterministic_calls_run_it_without_dq_and_repeat_bitwise(case, built)


def test_short_causal_calls_run_the_tile_level_kernels_and_say_so(built):
    case = (2, 1000, 1000, 4, 2, 128, "causal", "bottom_right", "bf16")
    spec = spec_for(case)
    built(spec, short_rule=True)
    grads, inputs, module = run_backward(case)
    assert module.GLUON_BWD_SHORT_CAUSAL_KEYS == 1024
    assert module.backward_path() == "tile-level: " + module._GLUON_BWD_SHORT
    problems = compare_gradients(spec, grads, *inputs)
    assert not problems, "; ".join(problems)
    again, _, _ = run_backward(case)  # the deterministic kernels: bitwise, dQ too
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


def test_dq_of_rows_that_see_no_key_is_zero(built):
    case = (1, 300, 100, 2, 2, 128, "causal", "bottom_right", "bf16")  # rows < 200 see none
    built(spec_for(case))
    grads, _, module = run_backward(case, seed=3)
    assert module.backward_path() == module.GLUON_BACKWARD_PATH
    assert torch.all(grads[0][:, :, :200] == 0)
    assert torch.isfinite(grads[1]).all() and torch.isfinite(grads[2]).all()


def test_keys_past_the_end_leave_dq_finite_where_every_score_is_far_below_zero(built):
    """fp16, 200 keys (the last block's 56 keys past Nk zeroed by TMA, scoring 0): every real
    score near -26, so LSE is near -17 and an unclamped P of the zeroed keys, exp(17), would pass
    fp16's 65504 and make dQ's dS K 0 * inf = NaN. Against the float64 reference."""
    case = (1, 150, 200, 2, 2, 64, "none", None, "fp16")
    spec = spec_for(case)
    built(spec)
    grads, inputs, module = run_backward(case, seed=5, apart=1.8)
    assert module.backward_path() == module.GLUON_BACKWARD_PATH
    assert torch.isfinite(grads[0]).all()
    problems = compare_gradients(spec, grads, *inputs)
    assert not problems, "; ".join(problems)


def test_a_layout_tma_cannot_read_runs_the_tile_level_kernels_and_says_why(built):
    """k with an odd row stride (a slice of a wider tensor): the tile-level atomic kernels."""
    case = (1, 200, 200, 4, 2, 64, "causal", "bottom_right", "bf16")
    spec = spec_for(case)
    built(spec)
    q = torch.randn(1, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wide = torch.randn(1, 200, 2, 65, device="cuda", dtype=torch.bfloat16)
    k = wide[..., :64].detach().requires_grad_()
    v = torch.randn(1, 200, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    attngen.flash_attn_func(q, k, v, causal=True).sum().backward()
    module = current_registry().module(last_backward().key)
    assert module.backward_path().startswith("tile-level: k strides")
    assert torch.isfinite(k.grad).all()
