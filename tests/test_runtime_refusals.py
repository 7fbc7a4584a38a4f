"""Calls that used to mislead: the torch fallback's dense masks, devices the kernels cannot run
on (CPU without the interpreter, bf16 under it), backward, and shape errors in the caller's
layout. Each is correct or refused with an error that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attngen
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from tests.runtime_harness import build_fake_decode
from tests.test_runtime import _cache_case, qkv, rand

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------- fallback="sdpa" dense masks


def dense_expected(q, k, v, attn_mask, softcap=0.0):
    """float64 attention with torch SDPA's attn_mask semantics; rows that see no key give 0."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double()
    scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    else:
        scores = scores + attn_mask.double()
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # an all -inf row: NaN -> 0
    return probs @ vd.repeat_interleave(group, 1)


def _masks(batch, heads, seqlen_q, seqlen_k):
    gen = torch.Generator().manual_seed(3)
    full = torch.rand(batch, heads, seqlen_q, seqlen_k, generator=gen) > 0.4
    full[0, -1, 1] = False  # one head's row sees nothing; the same row of other heads does
    full[-1, 0, -1] = False
    bias = torch.randn(batch, heads, seqlen_q, seqlen_k, generator=gen)
    bias = bias.masked_fill(~full, float("-inf"))
    return {
        "4d_bool": full,
        "4d_float": bias,
        "2d_bool": full[0, 0],
        "3d_bool_per_head": full[0],
        "4d_bool_padding": full[:, :1, :1, :],  # [B, 1, 1, Nk], broadcast over heads/queries
        "4d_bool_per_batch": full[:, :1],
    }


@pytest.mark.parametrize("name", list(_masks(2, 4, 5, 7)))
@pytest.mark.parametrize("softcap", [0.0, 5.0])  # plain SDPA, and the explicit fp32 math
def test_fallback_dense_masks_broadcast_as_torch_does(name, softcap):
    q, k, v = qkv(2, 5, 7)
    mask = _masks(2, 4, 5, 7)[name]
    with pytest.warns(UserWarning, match="attn_mask"):
        out = attngen.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True, softcap=softcap or None, fallback="sdpa"
        )
    # Note: fp32 attention over 7 keys against float64 is off by a few fp32 ulps of outputs of
    # magnitude < 4 (about 1e-6); a mask applied on the wrong axis moves whole rows by O(1).
    torch.testing.assert_close(
        out.double(), dense_expected(q, k, v, mask, softcap), rtol=0, atol=1e-5
    )


def test_fallback_4d_mask_when_queries_equal_head_dim():
    """Nq == D == 16 and one head: a mask reduced on the wrong axis lined up with the output's
    last axis and zeroed columns instead of the rows that see no key."""
    q, k, v = (rand(1, 1, n, 16, seed=s) for s, n in ((0, 16), (1, 9), (2, 9)))
    mask = torch.rand(1, 1, 16, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, 0, 3] = False
    with pytest.warns(UserWarning, match="attn_mask"):
        out = attngen.scaled_dot_product_attention(q, k, v, attn_mask=mask, fallback="sdpa")
    # Note: as above, fp32 against float64.
    torch.testing.assert_close(out.double(), dense_expected(q, k, v, mask), rtol=0, atol=1e-5)
    assert torch.all(out[0, 0, 3] == 0)


# ------------------------------------------------------------------------ devices, dtypes


def _run_python(code: str, env_interpret: str | None) -> subprocess.CompletedProcess:
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    if env_interpret is not None:
        env["TRITON_INTERPRET"] = env_interpret
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cpu_tensors_without_the_interpreter_say_how_to_enable_it():
    code = """
        import torch, warnings
        import attngen
        q = torch.randn(1, 12, 4, 64, dtype=torch.float16)
        try:
            attngen.scaled_dot_product_attention(q, q, q)
        except attngen.NoKernelError as exc:
            print("ERROR1", exc)
        import os
        os.environ["TRITON_INTERPRET"] = "1"   # too late: triton is imported below first
        import triton
        try:
            attngen.scaled_dot_product_attention(q, q, q)
        except attngen.NoKernelError as exc:
            print("ERROR2", exc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = attngen.scaled_dot_product_attention(q, q, q, fallback="sdpa")
        expected = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        print("FALLBACK", torch.equal(out, expected), "TRITON_INTERPRET" in str(caught[0].message))
    """
    result = _run_python(code, None)
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result.stdout + result.stderr
    assert lines[0].startswith("ERROR1") and "set TRITON_INTERPRET=1" in lines[0]
    assert "arch cpu" not in lines[0] and "build a spec" not in lines[0].lower()
    assert lines[1].startswith("ERROR2") and "imported before it was set" in lines[1]
    assert lines[2] == "FALLBACK True True"


def test_bf16_under_the_interpreter_is_refused_unless_its_math_is_correct():
    """Without tests/interpreter_bf16.py, Triton 3.6's interpreter returns garbage for bf16:
    the call must refuse. With the shim (or a fixed Triton) the probe passes and it runs."""
    code = """
        import torch
        import attngen
        from attngen.runtime.dispatch import bf16_math_is_correct
        print("PROBE", bf16_math_is_correct())
        q = torch.randn(1, 32, 4, 128, dtype=torch.bfloat16)
        k = torch.randn(1, 8, 4, 128, dtype=torch.bfloat16)
        try:
            attngen.flash_attn_func(q, k, k, causal=True)
            print("RAN")
        except attngen.NoKernelError as exc:
            print("ERROR", exc)
        from tests import interpreter_bf16
        interpreter_bf16.install()
        print("PROBE", bf16_math_is_correct())
    """
    result = _run_python(code, "1")
    lines = result.stdout.splitlines()
    assert lines[0] == "PROBE False", result.stdout + result.stderr
    assert lines[1].startswith("ERROR") and "triton-lang/triton#11584" in lines[1]
    assert lines[2] == "PROBE True"


def test_bf16_runs_under_the_interpreter_with_the_tests_shim(monkeypatch):
    from attngen.runtime import dispatch

    assert dispatch.bf16_interpreter_ok()  # conftest installed the shim
    q, k, v = (t.to(torch.bfloat16) for t in qkv(1, 4, 4, hq=32, hkv=8, dim=128))
    saved = current_registry()
    try:
        load_kernels()  # the repository's generated/: llama3_8b is bf16, d128, causal
        out = attngen.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
        assert "llama3_8b_prefill_bf16_d128_causal_br" in attngen.last_dispatch().module
        assert out.isfinite().all()
        monkeypatch.setattr(dispatch, "_bf16_ok", False)
        monkeypatch.setattr("attngen.runtime.dispatch.bf16_math_is_correct", lambda: False)
        with pytest.raises(attngen.NoKernelError, match="triton-lang/triton#11584"):
            attngen.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    finally:
        use_registry(saved)


# ------------------------------------------------------------------------------- backward


def test_forward_only_modules_refuse_a_call_that_needs_gradients(toy_folder, tmp_path):
    """Inputs that require grad need gradient kernels from the forward on: a forward-only
    module never serves such a call (on-demand builds are off here), and the refusal names
    the field; the same call under no_grad runs."""
    saved = current_registry()
    forward_only = r"toy_prefill.*backward: needs true .*module has false \(forward-only\)"
    try:
        load_kernels(toy_folder, build_fake_decode(tmp_path / "decode"), replace=True)
        q, k, v = (t.requires_grad_() for t in qkv(1, 4, 4))
        with pytest.raises(attngen.NoKernelError, match=forward_only):
            attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with torch.no_grad():
            attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        packed = [t.detach()[0].transpose(0, 1).requires_grad_() for t in (q, k, v)]
        cu = torch.tensor([0, 4], dtype=torch.int32)
        with pytest.raises(attngen.NoKernelError, match=forward_only.replace("prefill", "varlen")):
            attngen.flash_attn_varlen_func(*packed, cu, cu, 4, 4, causal=True)
        q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
        out = attngen.flash_attn_with_kvcache(
            q.requires_grad_(), k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True
        )
        assert attngen.last_dispatch().module == "sm90/toy_decode"
        with pytest.raises(NotImplementedError, match="attngen::decode: .* forward-only"):
            out.sum().backward()
        with torch.no_grad():  # inference is unchanged
            attngen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    finally:
        use_registry(saved)


# ------------------------------------------------------------ kvcache shapes, user layout


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(k_cache=torch.zeros(2, 12, 2, 8)),
            r"k_cache: expected \[2, 12, 2, 16\] \(\[batch, seqlen_cache, nheads_k, headdim\]\), "
            r"got \[2, 12, 2, 8\]",
        ),
        (
            dict(k_cache=torch.zeros(3, 12, 2, 16)),
            r"k_cache: expected \[batch=2, seqlen_cache, nheads_k, headdim=16\]"
            r".*got \[3, 12, 2, 16\]",
        ),
        (
            dict(v_cache=torch.zeros(2, 11, 2, 16)),
            r"v_cache: expected \[2, 12, 2, \*\] \(\[batch, seqlen_cache, nheads_k, headdim_v\]\)",
        ),
        (dict(q=torch.zeros(2, 2, 3, 16)), r"nheads: q has 3 heads \(dim 2\) and k_cache 2"),
        (
            dict(k=torch.zeros(2, 2, 1, 16)),
            r"k: expected \[2, \*, 2, 16\] \(\[batch, seqlen_new, nheads_k, headdim\]\), "
            r"got \[2, 2, 1, 16\]",
        ),
        (dict(q=torch.zeros(2, 4, 16)), r"q: expected a rank-4 tensor \[batch, seqlen_q, nheads"),
        (
            dict(block_table=torch.zeros(2, 3, dtype=torch.int64)),
            r"block_table: expected an int32 tensor \[batch=2, max_num_blocks_per_seq\]",
        ),
        (
            dict(k_cache=torch.zeros(2, 12, 2, 16, dtype=torch.float16)),
            r"k_cache: expected dtype torch.float32 on device cpu \(as q\), "
            r"got dtype torch.float16",
        ),
    ],
)
def test_kvcache_shape_errors_speak_the_callers_layout(toy_kernels, change, message):
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        attngen.flash_attn_with_kvcache(**args, cache_seqlens=seqlens, causal=True)
