"""The Gluon forward of varlen modules on the H200: `pytest -m gpu tests/test_gluon_varlen_gpu.py`.

Every sm90 varlen module whose prefill twin has the Gluon forward holds it. Packed sequences
through the module's attention_varlen() and through flash_attn_varlen_func, against the float64
reference per sequence (RELIABILITY.md's criterion): ragged lengths, empty sequences, sequences
shorter than a CTA's 128 rows, Nq != Nk in both causal alignments, GQA, D 64/128/256; NaN and
inf in the packed rows no sequence reads (seqused_k's gaps, the rows past the last sequence)
and an output poisoned with NaN, so a read or write outside a sequence shows; a sequence that
does not fit gets NaN as the tile-level kernel gives it; forward_path() and last_dispatch()
name the Gluon kernel.
"""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.build import plan_build, write_build
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import KernelKind
from attngen.tiling.gluon import gluon_gap
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

# (id, spec fields, query lengths, key lengths)
CASES = [
    ("ragged-causal-d128", dict(dtype="bf16", head_dim=128, mask="causal"),
     [1000, 129, 0, 300, 5], [1000, 129, 0, 300, 5]),
    ("ragged-none-d64-gqa", dict(dtype="fp16", head_dim=64, mask="none", num_q_heads=8,
                                 num_kv_heads=2), [77, 0, 513, 1], [300, 40, 0, 1]),
    ("prefix-bottom-right", dict(dtype="bf16", head_dim=128, mask="causal"),
     [100, 3, 700], [900, 300, 700]),
    ("top-left", dict(dtype="bf16", head_dim=64, mask="causal", causal_align="top_left"),
     [900, 300, 5], [100, 3, 64]),
    ("d256", dict(dtype="bf16", head_dim=256, mask="causal"), [257, 0, 64], [257, 10, 64]),
    ("window-sinks", dict(dtype="bf16", head_dim=64, mask="sliding_window", window_left=127,
                          window_right=0, sinks=True, num_q_heads=8, num_kv_heads=1),
     [1000, 17, 400], [1000, 17, 900]),
    ("alibi-softcap", dict(dtype="fp16", head_dim=128, mask="none", alibi=True, softcap=30.0),
     [300, 129], [200, 400]),
    ("chunked", dict(dtype="bf16", head_dim=128, mask="chunked", chunk_size=256),
     [1000, 129, 0, 300], [1000, 200, 0, 300]),
    ("sink-tokens", dict(dtype="bf16", head_dim=128, mask="sliding_window", window_left=127,
                         window_right=0, sink_tokens=4), [1000, 5, 300], [1000, 300, 900]),
]  # fmt: skip


def varlen_module(spec):
    """The spec's varlen module with the Gluon kernel on every launch (small launches and short
    sequences at D 64 otherwise take the tile-level kernel, which is faster there)."""
    assert gluon_gap(spec, "sm90", KernelKind.varlen) == ""
    module = load_kernel.__wrapped__(spec, kind=KernelKind.varlen)
    module.POINTER_LOADS_UP_TO = module.GLUON_VARLEN_D64_MEAN_QUERIES = 0
    return module


def _cu(lengths, gaps=None):
    """cu_seqlens of `lengths` with gaps[b] rows after sequence b (seqused_k's room)."""
    gaps = gaps or [0] * len(lengths)
    cu = [0]
    for n, gap in zip(lengths, gaps, strict=True):
        cu.append(cu[-1] + n + gap)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def _packed(spec, lens_q, lens_k, seed, gaps=(), tail=0):
    """Per-sequence inputs ([1, H, n, D] each) and their packing [total, H, D]; gaps: rows
    after each sequence's keys, tail: rows after the last query, both NaN (K, Q) and inf (V)."""
    gaps = list(gaps) or [0] * len(lens_k)
    seqs = [make_inputs(spec, 1, max(nq, 1), max(nk, 1), seed=seed + b, device="cuda")
            for b, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True))]  # fmt: skip
    qs, ks, vs = [], [], []
    for (q, k, v, _), nq, nk, gap in zip(seqs, lens_q, lens_k, gaps, strict=True):
        qs.append(q[0, :, :nq].transpose(0, 1))
        ks.append(k[0, :, :nk].transpose(0, 1))
        vs.append(v[0, :, :nk].transpose(0, 1))
        ks.append(k.new_full((gap, *k.shape[1:2], k.shape[3]), float("nan")))
        vs.append(v.new_full((gap, *v.shape[1:2], v.shape[3]), float("inf")))
    qs.append(qs[0].new_full((tail, *qs[0].shape[1:]), float("nan")))
    packed = [torch.cat(t).contiguous() for t in (qs, ks, vs)]
    return seqs, packed, seqs[0][3]


def _sinks(spec):
    if not spec.sinks:
        return {}
    gen = torch.Generator().manual_seed(5)
    return {"sinks": (torch.randn(spec.num_q_heads, generator=gen) * 2.0).cuda()}


def _check_sequences(spec, out, lse, seqs, lens_q, lens_k, cu_q, slopes=None, sinks=None):
    for b, ((q, k, v, _), nq, nk) in enumerate(zip(seqs, lens_q, lens_k, strict=True)):
        if nq == 0:  # nothing of its own to check (its neighbours' rows are)
            continue
        first = int(cu_q[b])
        rows = slice(first, first + nq)
        assert_matches_reference(
            spec,
            out[rows].transpose(0, 1)[None].cpu(),
            lse[:, rows][None].cpu(),
            q[:, :, :nq].cpu(),
            k[:, :, :nk].cpu(),
            v[:, :, :nk].cpu(),
            slopes=None if slopes is None else slopes.cpu(),
            sinks=None if sinks is None else sinks.cpu(),
        )


@pytest.mark.parametrize("name, fields, lens_q, lens_k", CASES, ids=[c[0] for c in CASES])
def test_varlen_matches_the_float64_reference(name, fields, lens_q, lens_k):
    spec = make_spec(kernels=["prefill", "varlen"], **fields)
    module = varlen_module(spec)
    seqs, (q, k, v), slopes = _packed(spec, lens_q, lens_k, seed=61)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    extra = _sinks(spec)
    out, lse = module.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                       alibi_slopes=slopes, return_lse=True, **extra)  # fmt: skip
    assert module.forward_path() == module.GLUON_PATH
    _check_sequences(spec, out, lse, seqs, lens_q, lens_k, cu_q, slopes, extra.get("sinks"))
    again = module.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                    alibi_slopes=slopes, return_lse=True, **extra)  # fmt: skip
    assert torch.equal(again[0], out) and torch.equal(again[1], lse), "not bitwise repeatable"


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_nan_outside_every_sequence_is_never_read_or_written(mask):
    """K NaN and V inf in seqused_k's gaps after each sequence's keys, Q NaN in the rows past
    the last sequence, out poisoned with NaN: each sequence as without the poison (bitwise),
    the rows no sequence covers 0 with LSE -inf."""
    spec = make_spec(kernels=["prefill", "varlen"], dtype="bf16", head_dim=128, mask=mask)
    module = varlen_module(spec)
    lens_q, lens_k, gaps = [300, 5, 0, 129], [200, 70, 0, 129], [64, 1, 130, 7]
    seqs, (q, k, v), _ = _packed(spec, lens_q, lens_k, seed=62, gaps=gaps, tail=100)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k, gaps)
    used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    out = torch.full((q.shape[0], q.shape[1], 128), float("nan"), dtype=q.dtype, device="cuda")
    _, lse = module.attention_varlen(q, k, v, cu_q, cu_k, 300, 330, seqused_k=used, out=out,
                                     return_lse=True)  # fmt: skip
    assert module.forward_path() == module.GLUON_PATH
    _check_sequences(spec, out, lse, seqs, lens_q, lens_k, cu_q)
    end = int(cu_q[-1])
    assert torch.equal(out[end:], torch.zeros_like(out[end:]))
    assert torch.isneginf(lse[:, end:]).all()
    _, (q2, k2, v2), _ = _packed(spec, lens_q, lens_k, seed=62)  # the same sequences, no poison
    clean = module.attention_varlen(q2, k2, v2, cu_q, _cu(lens_k), 300, 330, return_lse=True)
    assert torch.equal(clean[0][:end], out[:end]) and torch.equal(clean[1][:, :end], lse[:, :end])


def test_a_sequence_longer_than_max_seqlen_q_gets_nan_as_the_tile_level_kernel():
    spec = make_spec(kernels=["prefill", "varlen"], dtype="bf16", head_dim=64, mask="causal")
    module = varlen_module(spec)
    lens = [100, 400, 50]
    _, (q, k, v), _ = _packed(spec, lens, lens, seed=63)
    cu = _cu(lens)
    out, lse = module.attention_varlen(q, k, v, cu, cu, 200, 400, return_lse=True)
    assert module.forward_path() == module.GLUON_PATH
    assert torch.isnan(out[100:500]).all() and torch.isnan(lse[:, 100:500]).all()
    assert torch.isfinite(out[:100]).all() and torch.isfinite(out[500:]).all()


def test_flash_attn_varlen_func_runs_the_gluon_forward_and_says_so(tmp_path):
    """Through a registry of the spec's modules alone."""
    spec = make_spec(kernels=["prefill", "varlen"], dtype="bf16", head_dim=128, mask="causal",
                     num_q_heads=16, num_kv_heads=4)  # fmt: skip
    write_build(plan_build([spec]), tmp_path)
    saved = current_registry()
    load_kernels(tmp_path, replace=True)
    try:
        _through_flash_attn_varlen_func(spec)
    finally:
        use_registry(saved)


def _through_flash_attn_varlen_func(spec):
    lens = [1000, 0, 129, 3, 700]
    cu = _cu(lens)
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(64)
    q = torch.randn(total, 16, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
    k = torch.randn(total, 4, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
    v = torch.randn_like(k)
    out, lse, _ = attngen.flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=True,
                                                 return_attn_probs=True)  # fmt: skip
    chosen = attngen.last_dispatch()
    assert chosen.module.startswith("sm90/") and chosen.forward == "gluon warp-specialized"
    for b, n in enumerate(lens):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b]) + n)
        assert_matches_reference(
            spec, out[rows].transpose(0, 1)[None].cpu(), lse[:, rows][None].cpu(),
            *(t[rows].transpose(0, 1)[None].cpu() for t in (q, k, v)),
        )  # fmt: skip
