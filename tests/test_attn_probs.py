"""return_attn_probs=True: flash-attn 2's S_dmask from flash_attn_func, flash_attn_varlen_func
and the packed forms. With dropout: [B, HQ, round128(Nq), round128(Nk)] in q's dtype, the
probabilities relative to flash-attn's running block maximum (normalized here as flash-attn's
tests normalize them), dropped entries negated; the pattern is the one the kernels used: the
backward's dV (a one-hot dO makes dV the dropped probabilities) and the forward's output and
gradients judged against the float64 golden under S_dmask's mask. Without dropout: flash-attn's
empty tensor, on the full and the planned path."""

from __future__ import annotations

import math

import pytest
import torch

import attngen
from attngen.build import plan_build, write_build
from attngen.reference import attention_scores
from attngen.reference.backward import (
    compare_gradients,
    golden_backward,
    gradient_problems,
    lowp_backward,
)
from attngen.runtime.attn_probs import flash_block_n
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import specs_from_data
from tests.backward_harness import DROP_STEPS, cu_seqlens, padded_inputs

COMMON = dict(archs=["sm90"], backward=True, dropout=True, head_dim=32)
CAUSAL32 = dict(
    name="probs_causal",
    dtype="fp32",
    num_q_heads=4,
    num_kv_heads=2,
    mask="causal",
    causal_align="bottom_right",
    kernels=["prefill", "varlen"],
    **COMMON,
)
PLAIN16 = dict(
    name="probs_plain",
    dtype="fp16",
    num_q_heads=4,
    num_kv_heads=2,
    mask="none",
    kernels=["prefill"],
    **COMMON,
)
WINDOW32 = dict(
    name="probs_window",
    dtype="fp32",
    num_q_heads=2,
    num_kv_heads=1,
    mask="sliding_window",
    causal_align="bottom_right",
    window_left=40,
    window_right=3,
    softcap=5.0,
    alibi=True,
    kernels=["prefill"],
    **COMMON,
)
SPECS = {fields["name"]: specs_from_data(fields)[0] for fields in (CAUSAL32, PLAIN16, WINDOW32)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    built = tmp_path_factory.mktemp("attn_probs")
    write_build(plan_build(list(SPECS.values())), built)
    return built


@pytest.fixture
def kernels(folder):
    saved = current_registry()
    load_kernels(folder, replace=True)
    yield SPECS
    use_registry(saved)


# -- flash-attn's reading of S_dmask, in this file's words ----------------------------------------


def running_max(scores, block_n):
    """Per key: the row's maximum over the key's block of block_n keys and every later one
    (flash-attn's forward visits key blocks from the last one back)."""
    out = torch.empty_like(scores)
    later = torch.full(scores.shape[:-1], -math.inf, dtype=scores.dtype)
    for start in reversed(range(0, scores.shape[-1], block_n)):
        block = slice(start, start + block_n)
        later = torch.maximum(later, scores[..., block].amax(-1))
        out[..., block] = later[..., None]
    return out


def normalized(dmask, scores, head_dim):
    """(|S_dmask| rescaled to probabilities, the golden probabilities), float64 [B, H, Nq, Nk]:
    flash-attn's normalize_flash_attn_S, given the float64 scores."""
    seqlen_q, seqlen_k = scores.shape[-2:]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    finite = torch.isfinite(lse)
    golden = torch.where(finite, torch.exp(scores - torch.where(finite, lse, 0.0)), 0.0)
    running = running_max(scores, flash_block_n(head_dim))
    factor = torch.where(torch.isfinite(running) & finite, torch.exp(running - lse), 0.0)
    return dmask[:, :, :seqlen_q, :seqlen_k].abs().double() * factor, golden


def kept(dmask, seqlen_q, seqlen_k):
    """The keep mask S_dmask encodes: its sign bit is clear."""
    return ~torch.signbit(dmask[:, :, :seqlen_q, :seqlen_k])


def keep_scale(dropout_p):
    return DROP_STEPS / (DROP_STEPS - round(dropout_p * DROP_STEPS))


def within_binomial(count, n, p, sigmas=5.0):
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def one_hot_dout(batch, seqlen_q, hq, hkv, dim_v):
    """dO [B, Nq, HQ, DV] whose row i of query head h (member g of its KV group) is the unit
    vector g * Nq + i: then dV[b, j, kv head, g * Nq + i] is the dropped, scaled probability
    P[b, h, i, j] * keep / (1 - p), the backward's mask made visible."""
    group = hq // hkv
    assert group * seqlen_q <= dim_v
    dout = torch.zeros(batch, seqlen_q, hq, dim_v)
    for h in range(hq):
        for i in range(seqlen_q):
            dout[:, i, h, (h % group) * seqlen_q + i] = 1.0
    return dout


def dv_as_probs(dv, hq, seqlen_q):
    """[B, HQ, Nq, Nk] read back from dV [B, Nk, HKV, DV] of one_hot_dout."""
    group = hq // dv.shape[2]
    rows = dv[..., : group * seqlen_q].unflatten(-1, (group, seqlen_q))  # [B, Nk, HKV, g, Nq]
    return rows.flatten(2, 3).permute(0, 2, 3, 1)


# -- with dropout ---------------------------------------------------------------------------------


def test_block_widths_are_flash_attns():
    """flash-attn 2's forward with dropout steps its running maximum over these key blocks."""
    assert [flash_block_n(d) for d in (16, 32, 40, 64, 96, 112, 128, 160, 256)] == [
        128,
        128,
        64,
        64,
        64,
        32,
        32,
        64,
        64,
    ]


def test_flash_attn_func_s_dmask_reads_as_flash_attns_tests_read_it(kernels):
    """fp16, no mask, GQA 2: the shape and zero margin, the probabilities after flash-attn's
    normalization, the dropped fraction, and out by the rule under S_dmask's mask (out from
    S_dmask's own values too); the same bytes with and without return_attn_probs, and from
    the kv-packed form."""
    spec, p = kernels["probs_plain"], 0.17
    q, k, v, dout, _ = padded_inputs(spec, 2, 4, 2, 24, 150, seed=1)
    flash = [t.transpose(1, 2) for t in (q, k, v)]
    torch.manual_seed(3)
    out, lse, dmask = attngen.flash_attn_func(*flash, dropout_p=p, return_attn_probs=True)
    assert attngen.last_dispatch().module.endswith("_bwd_drop")
    assert dmask.shape == (2, 4, 128, 256) and dmask.dtype == torch.float16
    assert lse.shape == (2, 4, 24) and not dmask.requires_grad
    assert not dmask[:, :, 24:].any() and not dmask[:, :, :, 150:].any()
    probs, golden = normalized(dmask, attention_scores(spec, q, k), 32)
    # Note: S_dmask is stored in fp16: each exp(s - m) is rounded to half an fp16 ulp
    # (2**-11 relative) after fp32 scores a few fp32 ulps off float64's, so one fp16 ulp
    # (2**-10) bounds it; entries in fp16's subnormal range round to its step, 2**-24 (the
    # rescale factor exp(m - lse) <= 1 only shrinks that).
    assert torch.allclose(probs, golden, rtol=2**-10, atol=2**-24)
    keep = kept(dmask, 24, 150)
    assert within_binomial((~keep).sum().item(), keep.numel(), p)
    dropout = (keep, keep_scale(p))
    gold = golden_backward(spec, q, k, v, dout, dropout=dropout)[0]
    lowp = lowp_backward(spec, q, k, v, dout, dropout=dropout)[0]
    assert not gradient_problems("out", out.transpose(1, 2), gold, lowp, factor=2.0)
    from_dmask = (probs * keep * keep_scale(p)) @ v.double().repeat_interleave(2, dim=1)
    from_dmask = from_dmask.to(q.dtype)  # as a kernel writes it
    assert not gradient_problems("out from S_dmask", from_dmask, gold, lowp, factor=2.0)
    torch.manual_seed(3)  # the same draw: return_attn_probs changes nothing the kernels do
    assert torch.equal(attngen.flash_attn_func(*flash, dropout_p=p), out)
    torch.manual_seed(3)
    kv = torch.stack(flash[1:], dim=2)
    packed = attngen.flash_attn_kvpacked_func(flash[0], kv, p, return_attn_probs=True)
    assert torch.equal(packed[0], out) and torch.equal(packed[2], dmask)


def test_dropout_pattern_is_the_one_the_backward_regenerates(kernels):
    """fp32, causal with Nq < Nk: a one-hot dO makes dV the dropped probabilities, so dV's
    zeros are the backward's own mask; they are S_dmask's negated entries wherever a key is
    visible, its values S_dmask's normalized and scaled, and dQ, dK, dV hold by the rule."""
    spec, p = kernels["probs_causal"], 0.3
    q, k, v, _, _ = padded_inputs(spec, 2, 4, 2, 16, 150, seed=2)
    dout = one_hot_dout(2, 16, 4, 2, 32)
    inputs = leaves(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.manual_seed(4)
    out, _, dmask = attngen.flash_attn_func(
        *inputs, dropout_p=p, causal=True, return_attn_probs=True
    )
    out.backward(dout)
    assert dmask.shape == (2, 4, 128, 256) and dmask.dtype == torch.float32
    scores = attention_scores(spec, q, k)
    seen = torch.isfinite(scores)
    probs, _ = normalized(dmask, scores, 32)
    dropped_by_backward = dv_as_probs(inputs[2].grad, 4, 16) == 0
    keep = kept(dmask, 16, 150)
    assert torch.equal(dropped_by_backward[seen], ~keep[seen])
    assert 0.2 < (~keep[seen]).float().mean().item() < 0.4
    revealed = dv_as_probs(inputs[2].grad.double(), 4, 16)
    # fp32 kernels: dV's entries and S_dmask's are fp32 values of O(1) from fp32 scores over
    # D 32 (a few fp32 ulps, ~1e-6 relative at most); 1e-5 leaves room, while a wrong keep
    # bit or block maximum moves an entry by O(1).
    assert torch.allclose(revealed, probs * keep * keep_scale(p), rtol=1e-5, atol=1e-7)
    grads = [t.grad.transpose(1, 2) for t in inputs]
    problems = compare_gradients(
        spec, grads, q, k, v, dout.transpose(1, 2), dropout=(keep, keep_scale(p))
    )
    assert not problems, "; ".join(problems)


def test_varlen_s_dmask_per_sequence(kernels):
    """Sequence b at [b, :, :len_q, :len_k], drawn as batch b; an empty sequence and the
    margins are 0; the mask is the backward's (one-hot dO per sequence)."""
    spec, p = kernels["probs_causal"], 0.25
    lengths_q, lengths_k = [9, 0, 16], [12, 3, 140]
    q, k, v, _, _ = padded_inputs(spec, 1, 4, 2, sum(lengths_q), sum(lengths_k), seed=5)
    packed = leaves(*(t[0].transpose(0, 1) for t in (q, k, v)))
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    dout = torch.cat([one_hot_dout(1, n, 4, 2, 32)[0] for n in lengths_q])
    torch.manual_seed(6)
    out, lse, dmask = attngen.flash_attn_varlen_func(
        *packed, cu_q, cu_k, 16, 140, dropout_p=p, causal=True, return_attn_probs=True
    )
    out.backward(dout)
    assert attngen.last_dispatch().module.endswith("_varlen_fp32_d32_causal_br_bwd_drop")
    assert dmask.shape == (3, 4, 128, 256) and lse.shape == (4, 25)
    assert not dmask[1].any()
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in (0, 2):
        rows_q = slice(starts_q[b], starts_q[b + 1])
        rows_k = slice(starts_k[b], starts_k[b + 1])
        n_q, n_k = lengths_q[b], lengths_k[b]
        assert not dmask[b, :, n_q:].any() and not dmask[b, :, :, n_k:].any()
        seq = dmask[b : b + 1]
        scores = attention_scores(spec, *(t[:, :, r] for t, r in ((q, rows_q), (k, rows_k))))
        probs, golden = normalized(seq, scores, 32)
        # fp32 S_dmask against float64: a few fp32 ulps of O(1) probabilities (as above)
        assert torch.allclose(probs, golden, rtol=1e-5, atol=1e-7)
        keep, seen = kept(seq, n_q, n_k), torch.isfinite(scores)
        revealed = dv_as_probs(packed[2].grad[None, rows_k], 4, n_q)
        assert torch.equal((revealed == 0)[seen], ~keep[seen]), f"sequence {b}"
        # fp32 dV entries of O(1): 1e-6 is about 8 fp32 ulps at 1
        assert torch.allclose(revealed.double(), probs * keep * keep_scale(p), atol=1e-6)
    # sequence 2's keys past the packed k: the kernel gives it NaN, and so does S_dmask
    torch.manual_seed(6)
    outside = torch.tensor([*starts_k[:3], starts_k[3] + 1], dtype=torch.int32)
    with torch.no_grad():
        bad = attngen.flash_attn_varlen_func(
            *packed, cu_q, outside, 16, 141, dropout_p=p, causal=True, return_attn_probs=True
        )
    assert bad[0][starts_q[2] :].isnan().all() and bad[2][2].isnan().all()
    assert torch.equal(bad[2][:2], dmask[:2])


def test_window_softcap_alibi_scores(kernels):
    """S_dmask's scores are the kernels' (window, softcap, per-batch ALiBi slopes): its
    normalized probabilities are the golden's and out holds by the rule under its mask."""
    spec, p = kernels["probs_window"], 0.4
    q, k, v, dout, slopes = padded_inputs(spec, 2, 2, 1, 20, 70, seed=7)
    per_batch = torch.stack([slopes, slopes * 0.5])
    torch.manual_seed(8)
    out, _, dmask = attngen.flash_attn_func(
        *(t.transpose(1, 2) for t in (q, k, v)),
        dropout_p=p,
        window_size=(40, 3),
        softcap=5.0,
        alibi_slopes=per_batch,
        return_attn_probs=True,
    )
    assert dmask.shape == (2, 2, 128, 128)
    keep = kept(dmask, 20, 70)
    for b in range(2):
        one = [t[b : b + 1] for t in (q, k, v, dout)]
        scores = attention_scores(spec, *one[:2], alibi_slopes=per_batch[b])
        probs, golden = normalized(dmask[b : b + 1], scores, 32)
        assert torch.allclose(probs, golden, rtol=1e-5, atol=1e-7)
        dropout = (keep[b : b + 1], keep_scale(p))
        options = dict(alibi_slopes=per_batch[b], dropout=dropout)
        gold = golden_backward(spec, *one, **options)[0]
        lowp = lowp_backward(spec, *one, **options)[0]
        got = out[b : b + 1].transpose(1, 2)
        assert not gradient_problems("out", got, gold, lowp, factor=3.0), f"batch {b}"


# -- without dropout ------------------------------------------------------------------------------


def test_without_dropout_s_dmask_is_flash_attns_empty_tensor(kernels):
    """flash-attn 2 forms the probabilities only with dropout: an empty tensor of q's dtype
    on q's device otherwise, whether the call takes the full path or its plan."""
    spec = kernels["probs_causal"]
    q, k, v, _, _ = padded_inputs(spec, 1, 4, 2, 12, 12, seed=9)
    flash = [t.transpose(1, 2) for t in (q, k, v)]
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = cu_seqlens([5, 7])
    calls = {
        "flash": lambda: attngen.flash_attn_func(*flash, causal=True, return_attn_probs=True),
        "varlen": lambda: attngen.flash_attn_varlen_func(
            *packed, cu, cu, 7, 7, causal=True, return_attn_probs=True
        ),
        "kvpacked": lambda: attngen.flash_attn_kvpacked_func(
            flash[0], torch.stack(flash[1:], dim=2), causal=True, return_attn_probs=True
        ),
    }
    with torch.no_grad():
        for name, call in calls.items():
            for _ in range(2):  # the second call of a signature runs its plan
                out, lse, dmask = call()
                assert isinstance(dmask, torch.Tensor), name
                assert dmask.shape == (0,) and dmask.dtype == q.dtype, name
                assert dmask.device == q.device, name


def test_under_torch_compile_s_dmask_runs_in_a_graph_break(kernels):
    """S_dmask is formed eagerly: torch.compile breaks the graph there and gives the eager
    bytes under one seed; fullgraph=True refuses the call, naming return_attn_probs."""
    spec = kernels["probs_causal"]
    q, k, v, _, _ = padded_inputs(spec, 1, 4, 2, 16, 20, seed=10)
    flash = [t.transpose(1, 2) for t in (q, k, v)]

    def call(q, k, v):
        return attngen.flash_attn_func(q, k, v, 0.2, causal=True, return_attn_probs=True)

    results = []
    for step in (call, torch.compile(call, backend="aot_eager")):
        torch.manual_seed(11)
        results.append(step(*flash))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)

    def whole(q, k, v):  # a function of its own: dynamo caches compiled code per function
        return attngen.flash_attn_func(q, k, v, 0.2, causal=True, return_attn_probs=True)

    with pytest.raises(Exception, match="return_attn_probs: True with dropout_p > 0"):
        torch.compile(whole, backend="aot_eager", fullgraph=True)(*flash)


def test_the_torch_fallback_refuses_s_dmask_naming_why(toy_kernels):
    """With fallback "sdpa" and no dropout module, a dropout call with return_attn_probs is
    refused (torch's mask cannot be read back), naming dropout_p and return_attn_probs."""
    mode = attngen.runtime.get_fallback()
    flash = [torch.randn(1, 8, heads, 16) for heads in (4, 2, 2)]
    try:
        attngen.runtime.set_fallback("sdpa")
        with pytest.warns(UserWarning), pytest.raises(ValueError, match="return_attn_probs"):
            attngen.flash_attn_func(*flash, 0.2, causal=True, return_attn_probs=True)
    finally:
        attngen.runtime.set_fallback(mode)


# -- on the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_s_dmask_on_the_gpu(tmp_path, dtype):
    """flash-attn's test_flash_attn_output and test_flash_attn_varlen_output with dropout, at
    their sizes (d 64, p 0.17, GQA 3): S_dmask read as they read it gives the golden
    probabilities, a dropped fraction within 0.01 of p, and out and dQ, dK, dV by the rule
    under its mask, for the compiled kernels."""
    fields = dict(CAUSAL32, name="probs_gpu", dtype=dtype, head_dim=64, num_q_heads=6)
    spec = specs_from_data(fields)[0]
    write_build(plan_build([spec]), tmp_path)
    saved = current_registry()
    try:
        load_kernels(tmp_path, replace=True)
        _check_gpu_dense(spec, 0.17)
        _check_gpu_varlen(spec, 0.17)
    finally:
        use_registry(saved)


def _check_gpu_dense(spec, p):
    """The kernels on the GPU, judged on the CPU."""
    q, k, v, dout, _ = padded_inputs(spec, 4, 6, 2, 239, 300, seed=13)
    inputs = leaves(*(t.transpose(1, 2).cuda() for t in (q, k, v)))
    out, _, dmask = attngen.flash_attn_func(
        *inputs, dropout_p=p, causal=True, return_attn_probs=True
    )
    out.backward(dout.transpose(1, 2).cuda())
    assert dmask.shape == (4, 6, 256, 384) and dmask.dtype == q.dtype
    dmask, scores = dmask.cpu(), attention_scores(spec, q, k)
    probs, golden = normalized(dmask, scores, 64)
    # Note: bf16 (and fp16) S_dmask from the GPU's fp32-accumulated dots: rounding to q's dtype
    # is half a bf16 ulp (2**-8 relative) and the scores' fp32 error carries through exp as
    # ~1e-6 relative; one bf16 ulp (2**-7) bounds both. 2**-20 absolute: 16 of fp16's
    # subnormal steps, for entries the rescale factor exp(m - lse) <= 1 makes tiny.
    assert torch.allclose(probs, golden, rtol=2**-7, atol=2**-20)
    seen, keep = torch.isfinite(scores), kept(dmask, 239, 300)
    assert abs((~keep[seen]).float().mean().item() - p) <= 0.01
    dropout = (keep, keep_scale(p))
    gold = golden_backward(spec, q, k, v, dout, dropout=dropout)[0]
    lowp = lowp_backward(spec, q, k, v, dout, dropout=dropout)[0]
    got = out.detach().transpose(1, 2).cpu()
    assert not gradient_problems("out", got, gold, lowp, factor=2.0)
    grads = [t.grad.transpose(1, 2).cpu() for t in inputs]
    problems = compare_gradients(spec, grads, q, k, v, dout, dropout=dropout)
    assert not problems, "; ".join(problems)


def _check_gpu_varlen(spec, p):
    lengths_q, lengths_k = [200, 17, 0, 128], [300, 17, 5, 128]
    q, k, v, dout, _ = padded_inputs(spec, 1, 6, 2, sum(lengths_q), sum(lengths_k), seed=14)
    packed = leaves(*(t[0].transpose(0, 1).cuda() for t in (q, k, v)))
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    out, _, dmask = attngen.flash_attn_varlen_func(
        *packed,
        cu_q.cuda(),
        cu_k.cuda(),
        200,
        300,
        dropout_p=p,
        causal=True,
        return_attn_probs=True,
    )
    out.backward(dout[0].transpose(0, 1).cuda())
    dmask = dmask.cpu()
    assert dmask.shape == (4, 6, 256, 384) and not dmask[2].any()
    grads = [t.grad.cpu() for t in packed]
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in (0, 1, 3):
        rows_q, rows_k = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        seq = [t[:, :, r] for t, r in ((q, rows_q), (k, rows_k), (v, rows_k), (dout, rows_q))]
        scores = attention_scores(spec, *seq[:2])
        probs, golden = normalized(dmask[b : b + 1], scores, 64)
        # the dense GPU case's bound: one bf16 ulp relative, fp16 subnormals absolute
        assert torch.allclose(probs, golden, rtol=2**-7, atol=2**-20), f"sequence {b}"
        dropout = (kept(dmask[b : b + 1], lengths_q[b], lengths_k[b]), keep_scale(p))
        rows = (rows_q, rows_k, rows_k)
        seq_grads = [t[r].transpose(0, 1)[None] for t, r in zip(grads, rows, strict=True)]
        problems = compare_gradients(spec, seq_grads, *seq, dropout=dropout)
        assert not problems, f"sequence {b}: " + "; ".join(problems)


def test_paged_varlen_s_dmask_is_the_unpaged_ones(kernels):
    """flash_attn_varlen_func over paged K/V (block_table) draws each sequence's mask as the
    packed call does: the same out and S_dmask under one seed, its shape from max_seqlen_k."""
    spec, p = kernels["probs_causal"], 0.3
    lengths_q, lengths_k = [5, 8], [21, 9]
    q, k, v, _, _ = padded_inputs(spec, 1, 4, 2, sum(lengths_q), sum(lengths_k), seed=15)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    pages = torch.zeros(6, 8, 2, 32), torch.zeros(6, 8, 2, 32)
    block_table = torch.tensor([[4, 0, 2], [5, 1, 3]], dtype=torch.int32)
    for b, (start, length) in enumerate(zip(cu_k[:-1].tolist(), lengths_k, strict=True)):
        for i in range(length):
            page = block_table[b, i // 8]
            pages[0][page, i % 8], pages[1][page, i % 8] = (
                packed[1][start + i],
                packed[2][start + i],
            )
    results = []
    with torch.no_grad():
        for keys, table in ((packed[1:], None), (pages, block_table)):
            torch.manual_seed(16)
            results.append(
                attngen.flash_attn_varlen_func(
                    packed[0],
                    *keys,
                    cu_q,
                    cu_k,
                    8,
                    21,
                    p,
                    causal=True,
                    return_attn_probs=True,
                    block_table=table,
                )
            )
    assert results[1][2].shape == (2, 4, 128, 128)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][2], results[1][2])
    assert torch.signbit(results[1][2]).any()
