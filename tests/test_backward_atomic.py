"""The atomic-dQ backward (deterministic=False): the dQ kernel forms delta alone (DELTA_ONLY)
and the dK/dV kernel adds each key block's dS @ K into an fp32 dQ by atomics (ATOMIC_DQ).
Its gradients against the float64 reference by the rule (RELIABILITY.md, 3x for gradients)
across masks, GQA, dropout, softcap, ALiBi, sinks, sink tokens, chunks, head dims that are
not powers of two and packed sequences; dK, dV and d sinks bitwise those of the
deterministic path (the same kernels' arithmetic; on the CPU the atomics run in order); the
module's launches per flag; a packed sequence that does not fit still gets NaN in dQ."""

from __future__ import annotations

import pytest
import torch

from attngen.tiling.backward import atomic_dkdv_config, derive_backward_tiles
from tests.backward_harness import (
    Blocks,
    backward_spec,
    check_padded,
    check_per_sequence,
    module_for,
    packed_inputs,
    padded_inputs,
    run_padded,
)

CAUSAL = dict(mask="causal", causal_align="bottom_right")
WINDOW = dict(mask="sliding_window", window_left=9, window_right=2, causal_align="bottom_right")


@pytest.mark.parametrize(
    "fields, blocks, shape",
    [
        (dict(dtype="fp16", **CAUSAL), Blocks((16, 16), (16, 16), (16, 32)), (2, 4, 2, 40, 33)),
        (dict(dtype="bf16", mask="none"), Blocks((32, 16), (16, 32), (32, 16)), (1, 3, 1, 37, 50)),
        (dict(dtype="fp32", **WINDOW, softcap=5.0, alibi=True), Blocks(), (1, 4, 4, 45, 45)),
        (dict(dtype="fp16", head_dim=40, head_dim_v=24, **CAUSAL), Blocks(), (1, 2, 1, 30, 30)),
        (
            dict(dtype="fp16", mask="chunked", chunk_size=16, sinks=True),
            Blocks(),
            (1, 4, 2, 41, 41),
        ),
        (dict(dtype="fp32", **WINDOW, sink_tokens=4), Blocks(), (1, 2, 2, 38, 38)),
        # ALiBi top-left, rows far past the keys: a key block's zeroed keys past seqlen_k
        # are nearer those rows than its real keys, so their P, unmasked, passes fp16's range
        # (up to 2**(0.65 x 44) at head 0) and dS @ K gave 0 * inf = NaN in dQ
        (
            dict(
                dtype="fp16",
                head_dim=96,
                head_dim_v=64,
                alibi=True,
                mask="causal",
                causal_align="top_left",
            ),
            Blocks(dkdv=(16, 64)),
            (1, 7, 1, 150, 20),
        ),  # fmt: skip
    ],
    ids=[
        "causal-gqa",
        "none-mqa",
        "window-softcap-alibi",
        "d40-dv24",
        "chunked-sinks",
        "sinktok",
        "alibi-past-the-keys",
    ],
)
def test_atomic_gradients_match_the_reference(fields, blocks, shape):
    spec = backward_spec(**fields)
    batch, hq, hkv, seqlen_q, seqlen_k = shape
    q, k, v, dout, slopes = padded_inputs(spec, batch, hq, hkv, seqlen_q, seqlen_k, seed=5)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(9)) if spec.sinks else None
    problems = check_padded(spec, blocks, q, k, v, dout, slopes, sinks=sinks, deterministic=False)
    assert not problems, "; ".join(problems)


def test_the_delta_pass_zeroes_the_dq_sum(monkeypatch):
    """The atomic path's fp32 dQ sum is allocated uninitialized and its rows zeroed by the dQ
    kernel's DELTA_ONLY pass (no memset launch): with every fp32 allocation NaN-filled, the
    gradients still match the reference."""
    empty_like = torch.empty_like

    def nan_filled(t, *args, **kwargs):
        out = empty_like(t, *args, **kwargs)
        return out.fill_(float("nan")) if out.dtype == torch.float32 else out

    monkeypatch.setattr(torch, "empty_like", nan_filled)
    spec = backward_spec(dtype="fp16", **CAUSAL)
    q, k, v, dout, slopes = padded_inputs(spec, 1, 4, 2, 37, 37, seed=13)
    blocks = Blocks((16, 16), (16, 16), (16, 32))
    problems = check_padded(spec, blocks, q, k, v, dout, slopes, deterministic=False)
    assert not problems, "; ".join(problems)


def test_atomic_gradients_with_dropout_and_the_lse_gradient():
    spec = backward_spec(dtype="fp16", dropout=True, **CAUSAL)
    q, k, v, dout, slopes = padded_inputs(spec, 1, 4, 2, 35, 40, seed=11)
    dlse = torch.randn(1, 4, 35, generator=torch.Generator().manual_seed(12))
    rng_state = torch.tensor([1234, 7], dtype=torch.int64)
    problems = check_padded(
        spec,
        Blocks((16, 32), (32, 16), (16, 16)),
        q,
        k,
        v,
        dout,
        slopes,
        dropout_p=0.3,
        rng_state=rng_state,
        dlse=dlse,
        deterministic=False,
    )
    assert not problems, "; ".join(problems)


def test_only_dq_differs_from_the_deterministic_path():
    """dK, dV and d sinks come from the same arithmetic on both paths (delta and d sinks from
    the dQ kernel's own code, DELTA_ONLY; dK and dV from the one dK/dV kernel): bitwise equal.
    dQ is the atomic sum, close to the deterministic kernel's."""
    spec = backward_spec(dtype="fp16", sinks=True, **WINDOW)
    q, k, v, dout, slopes = padded_inputs(spec, 2, 4, 2, 36, 36, seed=3)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(4))
    module = module_for(spec, Blocks((16, 16), (16, 16), (16, 32)))
    runs = [
        run_padded(module, q, k, v, dout, slopes, sinks=sinks, deterministic=det)
        for det in (True, False)
    ]
    (out_a, lse_a, dq_a, dk_a, dv_a, ds_a), (out_b, lse_b, dq_b, dk_b, dv_b, ds_b) = runs
    for name, a, b in (("dk", dk_a, dk_b), ("dv", dv_a, dv_b), ("dsinks", ds_a, ds_b)):
        assert torch.equal(a, b), name
    assert dq_b.dtype == dq_a.dtype and dq_b.shape == dq_a.shape
    # Note: both dQs sum the same fp32 products, in another order and grouping (per key block
    # then atomically, against one chain per query block), and round once to fp16: they differ
    # by at most about one fp16 ulp of the largest entry (2**-10 ~ 1e-3 relative) plus fp32
    # reordering; 4e-3 of the largest is four such ulps, while a missing or doubled block's
    # term moves dQ by O(its size). Each path alone passes the float64 rule (tests above).
    assert torch.allclose(dq_a.float(), dq_b.float(), rtol=0, atol=4e-3 * dq_a.abs().max())


@pytest.mark.parametrize(
    "fields, lengths_q, lengths_k, dropout_p",
    [
        (dict(dtype="fp16", **CAUSAL), [33, 0, 1, 17], [17, 0, 1, 40], 0.0),
        (dict(dtype="fp32", mask="none", alibi=True), [15, 16], [16, 15], 0.0),
        (dict(dtype="bf16", dropout=True, **WINDOW), [20, 9], [20, 9], 0.25),
    ],
    ids=["causal-empty", "none-alibi", "window-dropout"],
)
def test_atomic_varlen_gradients_match_the_reference(fields, lengths_q, lengths_k, dropout_p):
    spec = backward_spec(**fields)
    q, k, v, dout, slopes = packed_inputs(spec, lengths_q, lengths_k, 4, 2, seed=21)
    options = {}
    if dropout_p:
        options = dict(dropout_p=dropout_p, rng_state=torch.tensor([99, 3], dtype=torch.int64))
    problems = check_per_sequence(
        spec, Blocks(), q, k, v, dout, slopes, lengths_q, lengths_k, deterministic=False, **options
    )
    assert not problems, "; ".join(problems)


class _Spy:
    """Wraps a module's JIT kernel: records each launch's constexpr flags."""

    def __init__(self, kernel, names, launches):
        self.kernel, self.names, self.launches = kernel, names, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({n: kwargs[n] for n in self.names if n in kwargs})
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_flag_picks_the_launches(monkeypatch, deterministic):
    spec = backward_spec(dtype="fp16", **CAUSAL)
    module = module_for(spec, Blocks())
    launches: list[dict] = []
    monkeypatch.setattr(
        module, "_attn_bwd_dq_kernel", _Spy(module._attn_bwd_dq_kernel, ["DELTA_ONLY"], launches)
    )
    monkeypatch.setattr(
        module,
        "_attn_bwd_dkdv_kernel",
        _Spy(module._attn_bwd_dkdv_kernel, ["GRADS", "ATOMIC_DQ"], launches),
    )
    q, k, v, dout, slopes = padded_inputs(spec, 1, 4, 2, 20, 20, seed=1)
    run_padded(module, q, k, v, dout, slopes, deterministic=deterministic)
    atomic = not deterministic
    assert launches == [{"DELTA_ONLY": atomic}, {"GRADS": 3, "ATOMIC_DQ": atomic}]


def test_split_dkdv_adds_dq_in_the_dk_launch(monkeypatch):
    """With dK and dV as two launches (BWD_DKDV_SPLIT), the dK launch (GRADS 2), which has
    dS, adds dQ, at the atomic config; the gradients still match the reference."""
    spec = backward_spec(dtype="fp16", **CAUSAL)
    module = module_for(spec, Blocks())
    split = ({"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},) * 2
    monkeypatch.setattr(module, "BWD_DKDV_SPLIT", split)
    launches: list[dict] = []
    monkeypatch.setattr(
        module,
        "_attn_bwd_dkdv_kernel",
        _Spy(module._attn_bwd_dkdv_kernel, ["GRADS", "ATOMIC_DQ", "BLOCK_N"], launches),
    )
    q, k, v, dout, slopes = padded_inputs(spec, 1, 4, 2, 33, 33, seed=2)
    problems = check_padded(spec, Blocks(), q, k, v, dout, slopes, deterministic=False)
    assert not problems, "; ".join(problems)
    assert launches == [
        {"GRADS": 1, "ATOMIC_DQ": False, "BLOCK_N": 32},
        {"GRADS": 2, "ATOMIC_DQ": True, "BLOCK_N": 16},  # BWD_DKDV_ATOMIC_CONFIG's
    ]


@pytest.mark.parametrize("bad", [1, None, "no"])
def test_the_module_refuses_a_flag_that_is_not_a_bool(bad):
    spec = backward_spec(dtype="fp16", **CAUSAL)
    module = module_for(spec, Blocks())
    q, k, v, _, _ = padded_inputs(spec, 1, 2, 2, 8, 8, seed=1)
    with pytest.raises(ValueError, match="deterministic: expected True or False"):
        module.attention(q, k, v, deterministic=bad)


def test_without_an_atomic_config_the_flag_runs_the_deterministic_kernels(monkeypatch):
    """BWD_DKDV_ATOMIC_CONFIG None (no atomic config fits the shared memory): deterministic=False
    launches the deterministic kernels (the runtime records why: test_backward_atomic_runtime)."""
    spec = backward_spec(dtype="fp16", **CAUSAL)
    module = module_for(spec, Blocks())
    monkeypatch.setattr(module, "BWD_DKDV_ATOMIC_CONFIG", None)
    launches: list[dict] = []
    monkeypatch.setattr(
        module, "_attn_bwd_dq_kernel", _Spy(module._attn_bwd_dq_kernel, ["DELTA_ONLY"], launches)
    )
    q, k, v, dout, slopes = padded_inputs(spec, 1, 2, 2, 16, 16, seed=1)
    run_padded(module, q, k, v, dout, slopes, deterministic=False)
    assert launches == [{"DELTA_ONLY": False}]


@pytest.mark.parametrize(
    "head_dim, arch, fits",
    [(64, "sm90", True), (128, "sm90", True), (256, "sm90", False), (128, "sm80", True)],
)
def test_the_atomic_config_is_the_launch_config_where_it_fits(head_dim, arch, fits):
    """The atomic launch runs at the deterministic launch's config (dK's with the split) when
    that config's shared memory plus dS and K's operand tiles fit; at D 256 on sm90 (the
    split's dK launch, 229888 B of 232448 already) it does not."""
    spec = backward_spec(dtype="bf16", head_dim=head_dim, num_q_heads=8, num_kv_heads=2, **CAUSAL)
    derivation = derive_backward_tiles(spec, arch)
    launch = derivation.dk if derivation.split else derivation.dkdv
    expected = launch.chosen if fits else None
    assert atomic_dkdv_config(spec, arch, derivation) == expected
    assert derivation.split == (head_dim == 256 and arch == "sm90")
