"""The warp-specialized (Gluon) dK/dV backward on the CPU: its config model, the modules that
hold it (under the interpreter their deterministic tile-level kernels serve the call, as
backward_path() says, and so do short causal calls on a GPU), the specs it does not serve,
explain, and the kernel cross-compiled for sm90 against the model.
tests/test_gluon_backward_gpu.py runs it on the H200."""

from __future__ import annotations

import inspect
import math
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

import attngen
from attngen.build import plan_build, write_build
from attngen.cli.explain import explain_lines
from attngen.reference.backward import compare_gradients, golden_backward
from attngen.render import render_module
from attngen.runtime import last_backward, reset_backward_runs
from attngen.runtime.ops import ATOMIC, ATOMIC_DQ_OFF, DETERMINISTIC, GLUON_DQ
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import KernelKind
from attngen.spec.files import VARIANTS_ENV
from attngen.tiling.gluon import GLUON_UNVERIFIED
from attngen.tiling.gluon_backward import (
    BACKWARD,
    LONG_CAUSAL_KEYS,
    SHORT_CAUSAL_KEYS,
    derive_gluon_backward,
    gluon_backward_gap,
)
from attngen.tiling.prefill import derive_tiles
from attngen.verify.gluon import _compile_job, verify_gluon
from tests.backward_harness import padded_inputs
from tests.kernel_harness import load_kernel, make_inputs, make_spec
from tests.test_block_sparse import exact_block_mask, mask_mod_values
from tests.test_expression_kernels import CASES, case_tensors

KERNEL = "def _gluon_attn_bwd_kernel("
INTERPRETED = "tile-level: Triton's interpreter runs no Gluon kernel"
GLUON_PATH = "gluon warp-specialized dK/dV"


def _spec(**fields):
    base = dict(dtype="bf16", head_dim=128, mask="causal", backward=True)
    return make_spec(**{**base, **fields})


def _render(spec, kind=KernelKind.prefill, arch="sm90"):
    return render_module(spec, kind, derive_tiles(spec, arch))


def test_the_derived_configs_fit_and_match_the_compiler():
    """D 64: BLOCK_M 64, 2 stages, dQ by turns, 132592 B; D 128: 64, 2, dQ split by columns,
    198128 B (the compiler's, docs/results/gluon_backward_compile_one_empty_2026-12-06.json);
    the wider and deeper candidates rejected by shared memory or registers; but a plain D 64
    spec (no mask or variant) takes BLOCK_M 128, dQ split by rows, 199152 B (FASTER_SPILLING:
    above the model's registers, measured faster)."""
    expected = {(64, False): (64, 132592, False, 2), (128, False): (64, 198128, True, 1),
                (64, True): (128, 199152, True, 3), (128, True): (64, 198128, True, 1)}  # fmt: skip
    long = derive_gluon_backward(_spec(head_dim=64), "sm90").long_causal  # causal, plain
    assert (long.config.block_m, long.smem_bytes) == (128, 199152)
    for (d, plain), (block_m, smem, split, feasible) in expected.items():
        more = dict(mask="none") if plain else dict(mask="causal")
        derivation = derive_gluon_backward(_spec(head_dim=d, **more), "sm90")
        config = (chosen := derivation.chosen).config
        assert (config.block_m, config.block_n, config.stages, config.dq_split) == (
            block_m, 128, 2, split)  # fmt: skip
        assert (config.consumer_regs, config.producer_regs, config.maxnreg) == (240, 24, 168)
        assert chosen.smem_bytes == smem
        assert sum(c.feasible for c in derivation.candidates) == feasible
        wide = [c for c in derivation.candidates if c.config.block_m == 128]
        rejected = [any("consumer regs" in r for r in c.rejected) for c in wide]
        assert wide and all(rejected) == (block_m == 64), (d, plain)


def test_served_by_default_with_the_short_causal_rule():
    """Its GPU tests passed, so no switch builds it; causal modules carry the short-call rule."""
    assert BACKWARD not in GLUON_UNVERIFIED
    for mask, short in (("causal", SHORT_CAUSAL_KEYS), ("none", 0)):
        spec = _spec(mask=mask)
        assert gluon_backward_gap(spec, "sm90", KernelKind.prefill) == ""
        assert derive_gluon_backward(spec, "sm90") is not None
        source = _render(spec)
        assert KERNEL in source and "GLUON_BACKWARD = True" in source
        assert f"\nGLUON_BWD_SHORT_CAUSAL_KEYS = {short}\n" in source


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask, align", [("none", None), ("causal", "bottom_right"),
                                         ("causal", "top_left"), ("sliding_window", "top_left"),
                                         ("sliding_window", "bottom_right")])  # fmt: skip
def test_the_prefill_modules_hold_it(d, mask, align):
    fields = dict(head_dim=d, mask=mask, num_q_heads=8, num_kv_heads=2, dtype="fp16")
    if mask == "sliding_window":
        fields.update(window_left=2**31 - 1, window_right=5)
    alibi = d == 128  # and ALiBi's slopes, read per query head (flash-attn's bottom-right |i' - j|)
    spec = _spec(**fields, alibi=alibi, **({"causal_align": align} if align else {}))
    assert gluon_backward_gap(spec, "sm90", KernelKind.prefill) == ""
    source = _render(spec)
    assert ("slope_log2 = gl.load(Slopes" in source.split("_gluon_bwd_consumer")[1]) == alibi
    assert KERNEL in source and "GLUON_BACKWARD = True" in source
    assert f'"CAUSAL": {mask == "causal"}' in source
    diag = "seqlen_k - seqlen_q" if align == "bottom_right" or alibi and mask == "none" else "0"
    assert f"lse2.shape[2],\n            {diag}, num_n_blocks," in source  # the kernel's diag
    assert "Gluon dK/dV backward (warp-specialized, sm90" in source  # the header's derivation


NOT_SERVED = {
    "d256 softcap": (dict(head_dim=256, softcap=5.0), "head dim 256 with a window, softcap"),
    "chunked": (dict(mask="chunked", chunk_size=256), "mask chunked"),
    "sink tokens": (
        dict(mask="sliding_window", window_left=127, window_right=0, sink_tokens=4),
        "sink tokens",
    ),
    "sinks": (dict(sinks=True), "sinks"),
    "dropout": (dict(dropout=True), "dropout"),
    "fp32": (dict(dtype="fp32"), "fp32"),
    "d96": (dict(head_dim=96, head_dim_v=96), "head dim 96"),
    "forward only": (dict(backward=False), "backward: false"),
}


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_what_it_does_not_serve_stays_tile_level(name):
    fields, reason = NOT_SERVED[name]
    spec = _spec(**fields)
    assert gluon_backward_gap(spec, "sm90", KernelKind.prefill).startswith(reason)
    assert KERNEL not in _render(spec)


def _listed(num, idx, rows):
    """{(key block, g, q-block)} of _transposed_block_mask's lists (batch 0, KV head 0)."""
    return {(n, int(e) // rows, int(e) % rows) for n in range(num.shape[2])
            for e in idx[0, 0, n, : int(num[0, 0, n])]}  # fmt: skip


@pytest.mark.parametrize("with_block_mask", [False, True])
def test_expression_launches_fill_the_kernels_parameters(with_block_mask, monkeypatch):
    """score_mod / mask_mod in the Gluon backward, its route forced on the
    CPU (Gluon does not run under the interpreter) and its launch caught: tensors, ints, tail
    and constexprs fill the kernel's parameters in order; the lists are a block mask's
    transposed ones, else every (query head, BLOCK_M q-block) a key block meets (causal:
    from its diagonal); the row statistics are padded to the lists' whole q-blocks."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    fields = dict(CASES["document"], mask="causal", causal_align="top_left")
    spec = _spec(head_dim=64, num_q_heads=4, num_kv_heads=2, **fields)
    module, launches = load_kernel(spec), []
    monkeypatch.setattr(module, "_gluon_bwd_route", lambda *args: (None, args[4].contiguous()))
    real = module._launch

    def caught(kernel, grid, device, tensors, ints, tail, constexprs, options):
        if kernel is not module._gluon_attn_bwd_kernel:
            return real(kernel, grid, device, tensors, ints, tail, constexprs, options)
        names = _assert_launch_groups(kernel, tensors, ints, tail, constexprs)
        launches.append(dict(zip(names, [*tensors, *ints, *tail], strict=True)))

    monkeypatch.setattr(module, "_launch", caught)
    q, k, v, _ = make_inputs(spec, 1, 300, 300, seed=3)
    tensors = case_tensors("document", 1, 300, 3)
    block_mask = exact_block_mask(mask_mod_values(spec, tensors, 1, 300, 300), 128, 128)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = module.attention(*leaves, tensors=tensors,
                           block_mask=block_mask if with_block_mask else None)  # fmt: skip
    out.sum().backward()
    (args,) = launches
    assert args["doc_ptr"] is tensors["doc"] and args["dim_N"] == 300
    q_block = 128 if with_block_mask else module.GLUON_BWD_CONFIG["BLOCK_M"]
    rows = -(-300 // q_block)
    padding = (args["sparse_q_block"], args["sparse_rows"], args["n_pad"])
    assert padding == (q_block, rows, rows * q_block)
    listed = _listed(args["QNum"], args["QIdx"], rows)
    if with_block_mask:
        lists = module._transposed_block_mask(block_mask, q, k)[0]
        assert listed == _listed(lists[0], lists[1], rows)
    else:
        assert listed == {(n, g, m) for n in range(3) for g in range(2) for m in range(rows)
                          if m * q_block + q_block - 1 >= n * 128}  # fmt: skip


def test_block_masks_the_expression_kernel_cannot_take_go_tile_level(monkeypatch):
    """Blocks that are not positive multiples of BLOCK_M x BLOCK_N (a zero, a negative or a
    float size too) never reach the Gluon route's buffers: they take the tile-level kernels,
    whose checks name a bad size."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    spec = _spec(head_dim=64, **dict(CASES["document"], mask="causal", causal_align="top_left"))
    module = load_kernel(spec)
    route = (("the Gluon dK/dV kernel", module.GLUON_BWD_CONFIG),)  # its route's rule

    def fits(sizes):
        return module._block_size_problem(*sizes, route) is None

    assert fits((128, 128)) and fits((64, 256))
    assert not any(fits(s) for s in ((32, 128), (128, 64), (0, 128), (128.0, 128), (-64, 128)))


def test_expressions_with_softcap_alibi_or_trainable_tensors_stay_tile_level(monkeypatch):
    """Served without the switch (GPU-verified), but with softcap, ALiBi, D 256 or a tensor
    that trains."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    fields = dict(CASES["document"], mask="causal", causal_align="top_left")
    for more, reason in ((dict(softcap=5.0), "score_mod/mask_mod with softcap"),
                         (dict(alibi=True), "score_mod/mask_mod with softcap"),
                         (dict(head_dim=256), "score_mod/mask_mod with softcap, ALiBi or head"),
                         ):  # fmt: skip
        gap = gluon_backward_gap(_spec(**fields, **more), "sm90", KernelKind.prefill)
        assert gap.startswith(reason), gap
    table = [dict(t, trainable=True) for t in CASES["relative_bias"]["tensors"]]
    spec = _spec(**dict(CASES["relative_bias"], tensors=table))
    assert gluon_backward_gap(spec, "sm90", KernelKind.prefill).startswith("a trainable tensor")
    assert gluon_backward_gap(_spec(**fields), "sm90", KernelKind.prefill) == ""


def test_other_archs_and_varlen_do_not_get_it():
    spec = _spec(kernels=["prefill", "varlen"], archs=["sm80", "sm90"])
    assert gluon_backward_gap(spec, "sm80", KernelKind.prefill).startswith("sm80 has no")
    assert KERNEL not in _render(spec, arch="sm80")
    assert KERNEL not in _render(spec, KernelKind.varlen)


def test_explain_says_which_dkdv_runs():
    text = "\n".join(explain_lines([_spec(head_dim=64, mask="none")], archs=["sm90"]))
    assert "dK/dV (prefill): warp-specialized Gluon" in text
    flat = " ".join(text.split())
    assert "BLOCK_M 128, BLOCK_N 128" in flat and "dQ split by rows" in flat
    assert "= 199152 B of" in flat and "FASTER_SPILLING" in flat
    text = "\n".join(explain_lines([_spec(head_dim=64, alibi=True)], archs=["sm90"]))
    assert "= 132608 B of" in text  # ALiBi's slopes pointer and stride: 16 B more captured
    text = "\n".join(explain_lines([_spec(head_dim=64, softcap=30.0)], archs=["sm90"]))
    assert "dK/dV (prefill): warp-specialized Gluon" in text


def _scores(source):
    return source.split("def _gluon_bwd_scores(")[1].split("@gluon.jit")[0]


def test_softcap_modules_issue_dp_after_p_and_are_given_the_softcap_scale(tmp_path, monkeypatch):
    """Softcap: t = tanh(S^T qk_scale) in the forward's 16-bit form, dS^T times 1 - t^2, and
    dP^T = V dO^T issued once P^T is made (with S^T it spilled at D 128); the kernels without
    softcap issue it with S^T. The host hands _gluon_bwd_run qk_scale = sm_scale / softcap."""
    spec = _spec(dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2, softcap=5.0)
    assert gluon_backward_gap(spec, "sm90", KernelKind.prefill) == ""
    scores = _scores(_render(spec))
    assert "t = gl.fdiv(2.0, 1.0 + gl.exp2(t)) - 1.0" in scores
    assert "x = t * _SOFTCAP_LOG2 - lse2[None, :]" in scores
    assert scores.index("p = p * (1.0 - t * t)") < scores.index("dp = warpgroup_mma(v_c, do")
    assert scores.index("p16 = _gluon_p16(p,") < scores.index("p = p * (1.0 - t * t)")
    assert "dp_tok" not in scores
    plain = _scores(_render(_spec(dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)))
    assert plain.index("dp_tok = warpgroup_mma(v_c") < plain.index("p = gl.minimum(")
    assert "tanh" not in plain and "_SOFTCAP_LOG2" not in plain
    write_build(plan_build([spec]), tmp_path)
    module = load_kernel_file(tmp_path)
    seen = {}

    def kernel(q, k, v, dout, lse2, delta, dq, qk_scale, sm_scale):
        seen.update(qk_scale=qk_scale, sm_scale=sm_scale)
        return torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(module, "_gluon_bwd_route", lambda *args: (None, args[4]))
    monkeypatch.setattr(module, "_gluon_bwd_run", kernel)
    q, k, v, dout, _ = padded_inputs(spec, 1, 4, 2, 70, 90, seed=3)
    out, lse = module.attention(q, k, v, return_lse=True)
    module.attention_backward(dout, q, k, v, out, lse, deterministic=False)
    assert seen == {"qk_scale": 64**-0.5 / 5.0, "sm_scale": 64**-0.5}


def load_kernel_file(folder):
    """The prefill module built into `folder`, imported by a registry of its own (the one in
    use is left as it was)."""
    saved = current_registry()
    registry = load_kernels(folder, replace=True)
    use_registry(saved)
    return registry.module(next(str(p) for p in folder.rglob("*_bwd.py") if "prefill" in p.name))


def _flash_backward(spec, folder, deterministic):
    """flash_attn_func with grad through the module built into `folder` (bottom-right causal
    or none, as the spec); returns the gradients (heads first) and the inputs."""
    write_build(plan_build([spec]), folder)
    saved = current_registry()
    load_kernels(folder, replace=True)
    try:
        q, k, v, dout, _ = padded_inputs(spec, 1, 4, 2, 70, 90, seed=5)
        leaves = [t.transpose(1, 2).detach().clone().requires_grad_() for t in (q, k, v)]
        causal = spec.mask.value == "causal"
        out = attngen.flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
        out.backward(dout.transpose(1, 2))
        module = current_registry().module(last_backward().key)
    finally:
        use_registry(saved)
    return [t.grad.transpose(1, 2) for t in leaves], (q, k, v, dout), module


def test_a_module_without_it_runs_the_two_kernels_and_records_it(tmp_path):
    spec = _spec(dtype="fp16", head_dim=96, head_dim_v=96, num_q_heads=4, num_kv_heads=2)
    reset_backward_runs()
    grads, inputs, module = _flash_backward(spec, tmp_path, False)
    run = last_backward()
    assert (run.path, run.reason) == (DETERMINISTIC, ATOMIC_DQ_OFF)
    assert module.GLUON_BACKWARD is False and not hasattr(module, "backward_path")
    assert not compare_gradients(spec, grads, *inputs)


def test_the_module_holds_the_kernel_and_says_which_backward_ran(tmp_path):
    """Under the interpreter the Gluon kernel cannot run: the module's tile-level atomic-dQ
    kernels serve deterministic=False, backward_path() says why, the gradients hold."""
    spec = _spec(dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)
    reset_backward_runs()
    grads, inputs, module = _flash_backward(spec, tmp_path, False)
    run = last_backward()
    assert (run.path, run.reason) == (ATOMIC, GLUON_DQ)
    assert module.GLUON_BACKWARD and KERNEL in Path(module.__file__).read_text()
    assert module.backward_path() == INTERPRETED
    assert not compare_gradients(spec, grads, *inputs)
    _, _, module = _flash_backward(spec, tmp_path, True)
    assert last_backward().path == DETERMINISTIC
    assert module.backward_path() == INTERPRETED


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_short_causal_calls_take_the_deterministic_kernels(tmp_path, monkeypatch, mask):
    """The route as on a GPU (the interpreter's switch off): a causal call with fewer than
    SHORT_CAUSAL_KEYS keys gets the short rule's reason, which the launch turns into the
    deterministic kernels; a longer one, or one without the mask, fits the Gluon kernel."""
    spec = _spec(dtype="fp16", head_dim=64, mask=mask)
    write_build(plan_build([spec]), tmp_path)
    module = load_kernel_file(tmp_path)
    monkeypatch.setattr(module, "_INTERPRET", False)
    for keys in (SHORT_CAUSAL_KEYS - 1, SHORT_CAUSAL_KEYS):
        q, k, v = (torch.zeros(1, 2, keys, 64, dtype=torch.float16) for _ in range(3))
        for deterministic in (False, True):
            why, _ = module._gluon_bwd_route(deterministic, q, k, v, q.clone(), None)
            short = mask == "causal" and keys < SHORT_CAUSAL_KEYS
            assert why == (module._GLUON_BWD_SHORT if short else None)
            path = GLUON_PATH + (module.GLUON_DETERMINISTIC if deterministic else "")
            assert module.backward_path() == ("tile-level: " + why if short else path)
    launch = Path(module.__file__).read_text()
    assert "deterministic = deterministic or gluon_why == _GLUON_BWD_SHORT  #" in launch


def test_the_host_side_around_the_kernel(tmp_path, monkeypatch):
    """The Gluon path's host code on the CPU, the kernel stood in for by float64 gradients:
    the padded row statistics it is given (LSE log2 e, +inf past Nq; delta from the DELTA_ONLY
    pass), dQ's fp32 sum in q's order of heads and rows, its padding rows dropped and cast into
    q's own layout (here flash_attn_func's [B, N, H, D] memory, so autograd has no layout copy
    left to make); deterministic=True: no dQ sum given, the dQ kernel's dQ, delta the same,
    the gradients bitwise repeatable."""
    spec = _spec(dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)
    write_build(plan_build([spec]), tmp_path)
    module = load_kernel_file(tmp_path)
    q, k, v, dout, _ = padded_inputs(spec, 2, 4, 2, 70, 90, seed=3)
    q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
    seen = {}

    def kernel(q, k, v, dout, lse2, delta, dq, qk_scale, sm_scale):
        _, _, gq, gk, gv = golden_backward(spec, q, k, v, dout, sm_scale=sm_scale)
        seen.update(lse2=lse2.clone(), delta=delta.clone(), dq=dq)
        if dq is not None:
            dq[:, :, : q.shape[2]] += gq.float()
        return tuple(x.transpose(1, 2).contiguous().transpose(1, 2).to(k.dtype) for x in (gk, gv))

    monkeypatch.setattr(module, "_gluon_bwd_route", lambda *args: (None, args[4]))
    monkeypatch.setattr(module, "_gluon_bwd_run", kernel)
    launched, launch = [], module._launch  # the dQ kernel's pass goes through the cached launcher

    def checked_launch(kernel, grid, device, *groups):
        launched.append(kernel.fn.__name__)
        _assert_launch_groups(kernel, *groups[:4])
        return launch(kernel, grid, device, *groups)

    monkeypatch.setattr(module, "_launch", checked_launch)
    out, lse = module.attention(q, k, v, return_lse=True)
    dq, dk, dv = module.attention_backward(dout, q, k, v, out, lse, deterministic=False)
    assert dq.dtype == q.dtype and dq.stride() == q.stride()
    assert not compare_gradients(spec, [dq, dk, dv], q, k, v, dout)
    rows = 64 * 2  # 70 query rows padded to whole 64-row blocks
    assert seen["lse2"].shape == (2, 4, rows) and torch.isinf(seen["lse2"][..., 70:]).all()
    # dQ's fp32 sum: zeroed, [B, N_pad, H, D] memory as q's (the kernel's DQ_HEADS_LAST order)
    assert seen["dq"].shape == (2, 4, rows, 64) and seen["dq"].stride() == (rows * 256, 64, 256, 1)
    # LSE log2 e from the dQ kernel's pass, bitwise as torch's fp32 product; +inf for -inf
    assert torch.equal(seen["lse2"][..., :70], lse * 1.4426950408889634)
    unseen = lse.clone()
    unseen[1, 2, 3:9] = -math.inf
    module.attention_backward(dout, q, k, v, out, unseen, deterministic=False)
    assert torch.equal(
        seen["lse2"][..., :70],
        (unseen * 1.4426950408889634).nan_to_num(posinf=math.inf, neginf=math.inf),
    )
    # delta = rowsum(O dO): the same 64 fp16 products summed in fp32 in another order, a few
    # fp32 ulps apart (|delta| < 100 here); 1e-4 is that with a margin, far below any wrong row.
    want = (out.float() * dout.float()).sum(-1)
    torch.testing.assert_close(seen["delta"][..., :70], want, rtol=1e-4, atol=1e-4)
    # deterministic=True: the kernel without dQ (dq None), dQ the dQ kernel's, bitwise again
    once = module.attention_backward(dout, q, k, v, out, lse, deterministic=True)
    assert seen["dq"] is None and once[0].stride() == q.stride()
    # delta now from the dQ kernel's whole pass: the same sums, so the same tolerance as above
    torch.testing.assert_close(seen["delta"][..., :70], want, rtol=1e-4, atol=1e-4)
    again = module.attention_backward(dout, q, k, v, out, lse, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(once, again, strict=True))
    assert not compare_gradients(spec, list(once), q, k, v, dout)
    assert launched.count("_attn_bwd_dq_kernel") == 4  # the four backward calls' dQ passes


@pytest.mark.parametrize("seqlen_q", [70, 128])  # padded to 128 rows, and not
def test_the_row_statistics_it_is_given(tmp_path, seqlen_q):
    """_gluon_bwd_buffers: LSE log2 e's buffer, +inf past Nq (the dQ kernel writes the rest), LSE,
    dLSE and delta padded alike (delta zeroed only where there are padding rows: the dQ
    kernel writes every row < Nq), dQ's fp32 sum allocated (its DELTA_ONLY pass zeroes it)."""
    spec = _spec(dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)
    write_build(plan_build([spec]), tmp_path)
    module = load_kernel_file(tmp_path)
    q = torch.zeros(2, 4, seqlen_q, 64, dtype=torch.float16)
    lse = torch.randn(2, 4, seqlen_q, generator=torch.Generator().manual_seed(0))
    lse[0, 1, :5] = -math.inf
    dq, lse_p, lse2, delta, dlse = module._gluon_bwd_buffers(q, lse, lse + 1, False, 64)
    assert (lse2[..., seqlen_q:] == math.inf).all()  # rows < Nq: the dQ kernel's (test above)
    assert torch.equal(lse_p[..., :seqlen_q], lse) and torch.equal(dlse[..., :seqlen_q], lse + 1)
    for t in (lse_p, lse2, delta, dlse):
        assert t.shape == (2, 4, 128) and t.is_contiguous()
    assert (delta[..., seqlen_q:] == 0).all()
    assert dq.shape == (2, 4, 128, 64) and dq.dtype == torch.float32


def _assert_launch_groups(kernel, tensors, ints, tail, constexprs) -> list[str]:
    """What _launch's direct path needs of a launch (_first_launch checks the first two on a
    GPU): the kernel's parameters are the groups in order, constexprs last by name; tensors
    are tensors, ints ints, the tail floats, None or TMA descriptors. Returns the names."""
    params = list(inspect.signature(kernel.fn).parameters.values())  # jit or interpreted
    constexpr = ["constexpr" in str(p.annotation) for p in params]
    positional = len(tensors) + len(ints) + len(tail)
    assert constexpr == [False] * positional + [True] * len(constexprs)
    assert [p.name for p in params[positional:]] == list(constexprs)
    assert all(type(t) is torch.Tensor for t in tensors) and all(type(n) is int for n in ints)
    assert all(x is None or type(x) is float or hasattr(x, "block_shape") for x in tail)
    return [p.name for p in params[:positional]]


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_launch_passes_the_kernels_parameters_in_its_groups(
    tmp_path, monkeypatch, deterministic
):
    """_gluon_bwd_run launches through the module's cached launcher (_launch), which calls the
    compiled kernel positionally: tensors, ints, tail (floats, TMA descriptors), then the
    constexprs by name in the kernel's order (what _first_launch checks on a GPU)."""
    spec = _spec(dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)
    write_build(plan_build([spec]), tmp_path)
    module = load_kernel_file(tmp_path)
    seen = {}
    monkeypatch.setattr(
        module, "_launch", lambda kernel, *args: seen.update(kernel=kernel, args=args)
    )
    q, dout = (torch.zeros(2, 128, 4, 64, dtype=torch.float16).transpose(1, 2) for _ in range(2))
    k, v = (torch.zeros(2, 2, 128, 64, dtype=torch.float16) for _ in range(2))
    dq_sum, _, lse2, delta, _ = module._gluon_bwd_buffers(q, torch.zeros(2, 4, 128), None, False,
                                                          64)  # fmt: skip
    module._gluon_bwd_run(q, k, v, dout, lse2, delta, None if deterministic else dq_sum, 1.0, 0.5)
    grid, device, tensors, ints, tail, constexprs, options = seen["args"]
    names = _assert_launch_groups(seen["kernel"], tensors, ints, tail, constexprs)
    assert names[: len(tensors)] == ["dk_ptr", "dv_ptr"]
    assert names[len(tensors) + len(ints) :][:2] == ["qk_scale", "sm_scale"]
    assert all(name.endswith("_desc") for name in names[len(tensors) + len(ints) + 2 :])
    assert type(tail[0]) is float and type(tail[1]) is float
    assert (constexprs["WITH_DQ"], constexprs["DQ_HEADS_LAST"]) == (not deterministic,) * 2
    assert grid == 2 * 2 and options == module._GLUON_BWD_OPTIONS


def test_long_causal_calls_run_the_long_form(monkeypatch):
    """A causal D 64 module carries the tiling model's long causal form (BLOCK_M 128, dQ split
    by rows): a backward call with LONG_CAUSAL_KEYS keys or more launches it (its blocks,
    constexprs, statistics padded to 128 rows), a shorter one the module's BLOCK_M 64."""
    module = load_kernel(_spec(head_dim=64, num_q_heads=2, num_kv_heads=1))
    keys, form = module.GLUON_BWD_LONG_CAUSAL
    assert keys == LONG_CAUSAL_KEYS and (form["BLOCK_M"], form["DQ_SPLIT"]) == (128, True)
    assert load_kernel(_spec(head_dim=128)).GLUON_BWD_LONG_CAUSAL is None  # D 128: one form
    monkeypatch.setattr(module, "_gluon_bwd_route", lambda *args: (None, args[4].contiguous()))
    launches: list = []
    monkeypatch.setattr(module, "_launch", lambda *args: launches.append(args))
    for n, block_m in ((keys - 64, 64), (keys, 128)):
        q, k, v, dout = (torch.zeros(1, n, h, 64, dtype=torch.bfloat16).transpose(1, 2)
                         for h in (2, 1, 1, 2))  # fmt: skip
        module.attention_backward(dout, q, k, v, dout, torch.zeros(1, 2, n), deterministic=False)
        kernel, grid, device, tensors, ints, tail, constexprs, options = launches[-1]  # dK/dV's
        _assert_launch_groups(kernel, tensors, ints, tail, constexprs)  # its constexprs by name
        q_desc = tail[2]  # qk_scale, sm_scale, then q_desc
        assert q_desc.block_shape[1] == block_m and constexprs["DQ_SPLIT"] == (block_m == 128)
        assert ints[4] == -(-n // block_m) * block_m  # the statistics' rows: whole blocks


@pytest.mark.slow
def test_the_kernels_compile_for_sm90_as_the_model_predicts():
    """The Gluon dK/dV kernel of D 64 and 128, causal and not, bf16 and fp16, cross-compiled
    for sm90: shared memory equal to the model's, setmaxnreg 240/24, wgmma and dQ's TMA
    reduce-adds; no spills but D 128's few (the consumer at the 240-register cap, more with dQ
    a step late: DQ_LATE_HEAD_DIMS, measured faster) and D 64's without a mask at BLOCK_M 128
    (FASTER_SPILLING: past the model's registers, measured faster)."""
    specs = [
        _spec(dtype=dtype, head_dim=d, mask=mask, num_q_heads=8, num_kv_heads=2)
        for d in (64, 128)
        for mask in ("none", "causal")
        for dtype in ("bf16", "fp16")
    ]
    rows = [row for row in verify_gluon(specs, processes=1) if "dK/dV" in row.line()]
    assert len(rows) == len(specs)
    for spec, row in zip(specs, rows, strict=True):
        assert row.record["shared"] == row.chosen.smem_bytes, row.line()
        assert row.record["atomics"] == []  # dQ by TMA reduce-adds, not per-thread atomics
        assert row.record["tma_reduces"] == [
            "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group"
        ]
        # (spill stores, stack) B; D 128's with dQ a step late (DQ_LATE_HEAD_DIMS)
        known = {(128, "causal"): (48, 48), (128, "none"): (16, 16), (64, "none"): (60, 40)}
        spills, stack = known.get((spec.head_dim, spec.mask.value), (0, 0))
        assert row.record["spill_stores"] == spills, row.line()
        assert row.problems == ([f"spills {spills} B, stack {stack} B"] if spills else [])
        if (long := derive_gluon_backward(spec, "sm90").long_causal) is not None:  # D 64 causal
            record = _compiled_apart(spec, long)  # the long causal form: BLOCK_M 128
            assert (record["shared"], record["spill_stores"], record["stack"]) == (199152, 68, 48)


def _compiled_apart(spec, candidate) -> dict:
    """compile_gluon's record of `candidate`, in a spawned worker without TRITON_INTERPRET (as
    verify_gluon compiles: a process that imported triton under the interpreter cannot)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            job = (spec.model_dump(mode="json"), candidate, KernelKind.prefill)
            return pool.apply(_compile_job, (job,))
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def test_d256_has_a_form_of_its_own():
    """BLOCK_N 64, a P and a dS warpgroup at 232 registers, the model's 230,912 B (its
    prototype's compile); not with a window, softcap or ALiBi; the module imports."""
    spec = _spec(head_dim=256, num_q_heads=4, num_kv_heads=2)
    assert gluon_backward_gap(spec, "sm90", KernelKind.prefill) == ""
    chosen = derive_gluon_backward(spec, "sm90").chosen
    config = chosen.config
    assert (config.block_m, config.block_n, config.stages, config.consumer_regs) == (64, 64, 2, 232)
    assert chosen.smem_bytes == 230912
    source = _render(spec)
    assert "def _gluon_bwd_p_role(" in source and "def _gluon_bwd_consumer(" not in source
    assert load_kernel(spec).GLUON_BWD_CONFIG["BLOCK_N"] == 64
    for more in (dict(softcap=5.0), dict(alibi=True),
                 dict(mask="sliding_window", window_left=100, window_right=0)):  # fmt: skip
        gap = gluon_backward_gap(_spec(head_dim=256, **more), "sm90", KernelKind.prefill)
        assert gap.startswith("head dim 256 with a window, softcap or ALiBi"), gap


@pytest.mark.slow
def test_the_d256_kernel_compiles_for_sm90_as_the_model_predicts(monkeypatch):
    """None and causal, bf16 and fp16: shared memory equal to the model's, no spills at 232
    registers, dQ by TMA reduce-adds."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    specs = [_spec(head_dim=256, mask=mask, dtype=dtype, num_q_heads=4, num_kv_heads=2)
             for mask in ("none", "causal") for dtype in ("bf16", "fp16")]  # fmt: skip
    rows = [row for row in verify_gluon(specs, processes=1) if "dK/dV" in row.line()]
    assert len(rows) == len(specs)
    for row in rows:
        assert not row.problems and row.record["atomics"] == [], row.line()
        assert row.record["tma_reduces"] and row.record["setmaxnreg"][:3] == [24, 120, 232]


@pytest.mark.slow
def test_the_softcap_kernels_compile_with_their_known_spills():
    """Softcap's kernel (dP^T issued after P^T), bf16, cross-compiled for sm90: shared memory
    as the model's; no spills at D 64, a few at D 128 (the consumer at the 240-register cap;
    issued with S^T, dP^T's accumulator beside t and P^T spilled 132-256 B)."""
    specs = [
        _spec(head_dim=d, mask=mask, alibi=alibi, softcap=5.0, num_q_heads=8, num_kv_heads=2)
        for d in (64, 128)
        for mask, alibi in (("none", False), ("causal", False), ("causal", True))
    ]
    rows = [row for row in verify_gluon(specs) if "dK/dV" in row.line()]
    assert len(rows) == len(specs)
    known = {(128, "none", False): (8, 8), (128, "causal", False): (20, 24),
             (128, "causal", True): (44, 48)}  # (spill stores, stack) B  # fmt: skip
    for spec, row in zip(specs, rows, strict=True):
        assert row.record["shared"] == row.chosen.smem_bytes, row.line()
        spills, stack = known.get((spec.head_dim, spec.mask.value, spec.alibi), (0, 0))
        assert (row.record["spill_stores"], row.record["stack"]) == (spills, stack), row.line()


# Spill stores (B) of the expression kernels at D 128 (none, causal): the plain kernel's
# consumers sit at the 240-register cap, and the expressions' tiles go past it (D 64: none).
EXPRESSION_SPILLS = {"document": (64, 172), "prefix_lm": (60, 100),
                     "relative_bias": (216, 256), "softcap": (28, 60), "alibi": (48, 80),
                     "out_of_range": (120, 100)}  # fmt: skip


@pytest.mark.slow
def test_the_expression_kernels_compile_as_the_model_predicts(monkeypatch):
    """Each case of tests/test_expression_kernels.py, none and causal, D 64 and 128, bf16,
    cross-compiled for sm90: shared memory equal to the model's (the captured
    arguments: expression_capture_bytes), dP^T issued after P^T, the known spills."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    cells = [(case, d, causal) for case in sorted(EXPRESSION_SPILLS) for d in (64, 128)
             for causal in (False, True)]  # fmt: skip
    specs = [_spec(head_dim=d, mask="causal" if causal else "none", causal_align="top_left",
                   num_q_heads=8, num_kv_heads=2, **CASES[case])
             for case, d, causal in cells]  # fmt: skip
    rows = [row for row in verify_gluon(specs) if "dK/dV" in row.line()]
    assert len(rows) == len(specs)
    for (case, d, causal), row in zip(cells, rows, strict=True):
        assert row.record["shared"] == row.chosen.smem_bytes, row.line()
        spills = EXPRESSION_SPILLS[case][causal] if d == 128 else 0
        assert row.record["spill_stores"] == spills, row.line()
