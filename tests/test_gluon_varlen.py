"""The Gluon forward of varlen modules on the CPU: built by default beside the tile-level
kernel, its config model, explain, the launch's arguments against the kernel's parameters and
the rules that keep a call tile-level, the interpreter's tile-level path, and (slow) the kernel
cross-compiled for sm90. tests/test_gluon_varlen_gpu.py runs it on the H200."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attngen.cli.explain import forward_lines
from attngen.render import render_module
from attngen.spec import KernelKind
from attngen.spec.files import VARIANTS_ENV
from attngen.tiling.gluon import GLUON_UNVERIFIED, derive_gluon_tiles, gluon_gap
from attngen.tiling.prefill import derive_tiles
from attngen.verify.gluon import verify_gluon
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec

VARLEN = KernelKind.varlen


def _spec(**fields):
    return make_spec(**{"dtype": "bf16", "kernels": ["prefill", "varlen"], **fields})


def _render(spec):
    return render_module(spec, VARLEN, derive_tiles(spec, "sm90"))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_the_varlen_module_holds_the_gluon_forward(d, mask, monkeypatch):
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    assert "varlen" not in GLUON_UNVERIFIED
    spec = _spec(head_dim=d, mask=mask)
    assert gluon_gap(spec, "sm90", VARLEN) == ""
    source = _render(spec)
    assert "def _gluon_attn_fwd_kernel(" in source and "def _gluon_varlen_layout(" in source
    assert "USE_SEQUSED_K: gl.constexpr" in source and "_FORWARD.path = plan[5]" in source
    assert "_gluon_attn_bwd_kernel" not in source  # no Gluon varlen backward
    assert "warp-specialized Gluon" in forward_lines(spec, "sm90", VARLEN)[0]


@pytest.mark.parametrize(
    "fields, gap",
    [
        (dict(dropout=True, backward=True), "dropout"),
        (dict(dtype="fp32"), "fp32"),
        (dict(head_dim=192, head_dim_v=128), "head dim 192"),
    ],
)  # fmt: skip
def test_only_what_the_kernel_implements_is_built(fields, gap):
    assert gluon_gap(_spec(**fields), "sm90", VARLEN).startswith(gap + ":")


def test_the_varlen_config_is_the_prefill_one_with_one_more_capture_step():
    """q_first/k_first for the batch, out's row pointer and stride: warp_specialize's buffer
    one 16-byte step larger (VARLEN_WORDS; exact against the compiler in the slow test and
    docs/results/gluon_varlen_compile.json's 38 kernels)."""
    for fields, extra in ((dict(head_dim=128), 16), (dict(head_dim=64, alibi=True), 16),
                          (dict(head_dim=64, mask="sliding_window", window_left=127,
                                window_right=0, sinks=True), 16)):  # fmt: skip
        spec = _spec(**fields)
        prefill, varlen = derive_gluon_tiles(spec, "sm90"), derive_gluon_tiles(spec, "sm90", VARLEN)
        assert varlen.chosen.config == prefill.chosen.config
        assert varlen.chosen.smem_bytes == prefill.chosen.smem_bytes + extra


@pytest.mark.parametrize("seqused", [False, True])
def test_the_launch_matches_the_kernels_parameters(seqused, monkeypatch):
    """_gluon_varlen_layout's plan (as on a GPU: no interpreter, no small-launch rule) and
    _gluon_varlen_run's arguments, group by group, against _gluon_attn_fwd_kernel's."""
    spec = _spec(head_dim=64, alibi=True, sinks=True, num_q_heads=4, num_kv_heads=2)
    module = load_kernel.__wrapped__(spec, kind=VARLEN)
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(module, "POINTER_LOADS_UP_TO", 0)
    monkeypatch.setattr(module, "GLUON_VARLEN_D64_MEAN_QUERIES", 0)
    q = torch.zeros(300, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(500, 2, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    launch, why = module._gluon_varlen_layout(q, k, k, out, True, 200, 400, 3, seqused)
    assert why is None
    grid, ints, constexprs, descs = launch
    assert grid == 2 * 3 * 4  # ceil(200 / 128) query blocks x sequences x heads
    assert ints == (4, 2, 2, 300, 500, out.stride(0), out.stride(1))
    assert descs[0][:2] == ([1, 300, 4, 64], [q.stride(0) * 300, 256, 64, 1])
    assert descs[1][0] == [1, 500, 2, 64]
    assert descs[1][2] == [1, module.GLUON_CONFIG["BLOCK_N"], 1, 64]
    assert constexprs["USE_SEQUSED_K"] is seqused and constexprs["STORE_LSE"]
    for t, meta in zip((q, k, k, out), descs, strict=True):  # the constructor's checks pass
        assert module._gluon_descriptor(t, meta).shape == meta[0]
    kernel = module._gluon_attn_fwd_kernel
    names = kernel.arg_names
    n_tensors, n_ints = 7, len(ints) + 2  # + stride_lse_h, stride_slopes_b
    assert names[:n_tensors] == ["Lse", "Out", "CuSeqlensQ", "CuSeqlensK", "SequsedK",
                                 "Slopes", "Sinks"]  # fmt: skip
    assert names[n_tensors + n_ints : n_tensors + n_ints + 5][0] == "qk_scale"
    assert names[n_tensors + n_ints + 5 :] == list(constexprs)
    bad = torch.zeros(300, 4, 68, dtype=torch.bfloat16)[:, :, :64]
    assert module._gluon_varlen_layout(bad, k, k, out, True, 200, 400, 3, seqused)[1] == (
        f"q strides {tuple(bad.stride())} are not 16-byte multiples"
    )


def test_short_sequences_at_head_dim_64_stay_tile_level_and_say_why(monkeypatch):
    """At D 64, packed sequences averaging under GLUON_VARLEN_D64_MEAN_QUERIES queries take the
    tile-level kernel (measured faster there); a mean of exactly that many take the Gluon one."""
    spec = _spec(head_dim=64, num_q_heads=2, num_kv_heads=2)
    module = load_kernel.__wrapped__(spec, kind=VARLEN)
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(module, "POINTER_LOADS_UP_TO", 0)
    q = torch.zeros(1024, 2, 64, dtype=torch.bfloat16)
    why = module._gluon_varlen_layout(q, q, q, torch.empty_like(q), False, 600, 600, 3, False)[1]
    assert module.GLUON_VARLEN_D64_MEAN_QUERIES == 512
    assert why == "head_dim 64, under 512 queries a sequence on average"
    assert module._gluon_varlen_layout(q, q, q, q, False, 600, 600, 2, False)[1] is None


def test_the_module_serves_varlen_calls_under_the_interpreter():
    spec = _spec(head_dim=64)
    module = load_kernel.__wrapped__(spec, kind=VARLEN)
    assert "def _gluon_attn_fwd_kernel(" in Path(module.__file__).read_text()
    lens = [20, 0, 7]
    seqs = [make_inputs(spec, 1, max(n, 1), max(n, 1), seed=70 + b) for b, n in enumerate(lens)]
    packed = [torch.cat([s[i][0, :, :n].transpose(0, 1) for s, n in zip(seqs, lens, strict=True)])
              for i in range(3)]  # fmt: skip
    cu = torch.tensor([0, 20, 20, 27], dtype=torch.int32)
    out, lse = module.attention_varlen(*packed, cu, cu, 20, 20, return_lse=True)
    assert module.forward_path() == "tile-level: Triton's interpreter runs no Gluon kernel"
    for (q, k, v, _), first, n in zip(seqs, (0, 20, 20), lens, strict=True):
        if n:
            rows = slice(first, first + n)
            assert_matches_reference(spec, out[rows].transpose(0, 1)[None], lse[:, rows][None],
                                     q, k, v)  # fmt: skip


@pytest.mark.slow
def test_the_varlen_kernel_compiles_for_sm90_as_the_model_predicts():
    """Plain causal D 128, window + sinks D 64, chunked D 128 and sink tokens D 128 varlen
    kernels, cross-compiled in a spawned worker (attngen verify-tiling --gluon's judgement):
    shared memory equal to the model, no spills (chunks and sink tokens at D 128 spilled 12 B
    and 4 B before P's packing for the PV wgmma lost its swaps)."""
    specs = [_spec(head_dim=128, kernels=["varlen"]),
             _spec(head_dim=64, mask="sliding_window", window_left=127, window_right=0,
                   sinks=True, kernels=["varlen"]),
             _spec(head_dim=128, mask="chunked", chunk_size=256, kernels=["varlen"]),
             _spec(head_dim=128, mask="sliding_window", window_left=127, window_right=0,
                   sink_tokens=4, kernels=["varlen"])]  # fmt: skip
    rows = [row for row in verify_gluon(specs, processes=1) if row.kind is VARLEN]
    assert len(rows) == 4
    for row in rows:
        assert not row.problems, row.line()
        assert (row.record["spill_stores"], row.record["stack"]) == (0, 0), row.line()
        assert row.record["shared"] == row.chosen.smem_bytes
