"""Helpers for the backward tests: a backward module with the block sizes a test wants (forward,
dQ and dK/dV independently), padded and packed runs through autograd, the dropout mask read
back through the module's own RNG helper, and the judgement of attngen.reference.backward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attngen.reference import random_inputs
from attngen.reference.backward import (
    compare_gradients,
    golden_backward,
    gradient_problems,
    lowp_backward,
)
from attngen.spec import AttnSpec, KernelKind
from tests.kernel_harness import load_kernel, make_spec

DROP_STEPS = 2**16


@dataclass(frozen=True)
class Blocks:
    """(BLOCK_M, BLOCK_N) of the forward, dQ and dK/dV kernels."""

    fwd: tuple[int, int] = (16, 16)
    dq: tuple[int, int] = (16, 16)
    dkdv: tuple[int, int] = (16, 16)


def backward_spec(**fields) -> AttnSpec:
    return make_spec(backward=True, kernels=["prefill", "varlen"], **fields)


def module_for(spec: AttnSpec, blocks: Blocks = Blocks(), kind: str = "prefill"):
    """The spec's module of `kind` with these blocks (modules are cached per spec and kind,
    so the blocks are set on every call)."""
    module = load_kernel(spec, kind=KernelKind(kind))
    for config, (block_m, block_n) in (
        (module.CONFIG, blocks.fwd),
        (module.BWD_DQ_CONFIG, blocks.dq),
        (module.BWD_DKDV_CONFIG, blocks.dkdv),
        (module.BWD_DKDV_ATOMIC_CONFIG, blocks.dkdv),
    ):
        if config is not None:  # no atomic config fits some shared memories (None)
            config.update(BLOCK_M=block_m, BLOCK_N=block_n, num_stages=1)
    return module


def padded_inputs(spec: AttnSpec, batch, hq, hkv, seqlen_q, seqlen_k, seed, scale=1.0):
    q, k, v, slopes = random_inputs(
        spec, batch, seqlen_q, seqlen_k, seed=seed, num_q_heads=hq, num_kv_heads=hkv, scale=scale
    )
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(batch, hq, seqlen_q, spec.value_head_dim, generator=gen).to(q.dtype)
    return q, k, v, dout, slopes


def run_padded(module, q, k, v, dout, slopes, *, dlse=None, sinks=None, **options):
    """out, lse, dq, dk, dv (and dsinks, given sinks) from the kernels (autograd through
    attention())."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
        options["sinks"] = leaves[3]
    out, lse = module.attention(*leaves[:3], alibi_slopes=slopes, return_lse=True, **options)
    outputs, grads = ([out], [dout]) if dlse is None else ([out, lse], [dout, dlse])
    torch.autograd.backward(outputs, grads)
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def dropout_of(rng_state, dropout_p, batch, hq, seqlen_q, seqlen_k, batch_head0=0):
    """(keep [B, HQ, M, N], keep scale) as the kernels draw it, or None without dropout."""
    threshold = round(dropout_p * DROP_STEPS)
    if not threshold:
        return None
    keep = keep_mask(rng_state, batch * hq, seqlen_q, seqlen_k, threshold, batch_head0)
    return keep.view(batch, hq, seqlen_q, seqlen_k), DROP_STEPS / (DROP_STEPS - threshold)


def check_padded(
    spec,
    blocks,
    q,
    k,
    v,
    dout,
    slopes,
    *,
    dropout_p=0.0,
    rng_state=None,
    dlse=None,
    sinks=None,
    deterministic=True,
):
    """Run and judge out and every gradient (d sinks too, given sinks) by the rule; the list
    of problems. deterministic=False: the atomic-dQ backward."""
    module = module_for(spec, blocks)
    options = {"dropout_p": dropout_p, "rng_state": rng_state} if dropout_p else {}
    options["deterministic"] = deterministic
    out, lse, *grads = run_padded(module, q, k, v, dout, slopes, dlse=dlse, sinks=sinks, **options)
    dropout = dropout_of(rng_state, dropout_p, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    problems = compare_gradients(
        spec, grads, q, k, v, dout, alibi_slopes=slopes, dropout=dropout, dlse=dlse, sinks=sinks
    )
    if not torch.equal(torch.isinf(lse), torch.isinf(_golden_lse(spec, q, k, slopes, sinks))):
        problems.append("lse: the -inf pattern differs from the golden's")
    if any(torch.isnan(g).any() for g in grads):
        problems.append("a gradient has NaN")
    return problems


def _golden_lse(spec, q, k, slopes, sinks=None):
    from attngen.reference import attention_scores

    lse = torch.logsumexp(attention_scores(spec, q, k, alibi_slopes=slopes), dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double()[None, :, None].expand_as(lse))
    return lse


# -- packed sequences ---------------------------------------------------------------------------


def cu_seqlens(lengths):
    return torch.tensor(
        [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )


def packed_inputs(spec, lengths_q, lengths_k, hq, hkv, seed, pad=3, fill=float("nan")):
    """q, k, v, dout packed with `pad` rows of `fill` after the sequences, and slopes."""
    gen = torch.Generator().manual_seed(seed)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[spec.dtype.value]

    def randn(rows, heads, dim):
        t = torch.randn(rows + pad, heads, dim, generator=gen).to(dtype)
        t[rows:] = fill
        return t

    q = randn(sum(lengths_q), hq, spec.head_dim)
    k = randn(sum(lengths_k), hkv, spec.head_dim)
    v = randn(sum(lengths_k), hkv, spec.value_head_dim)
    dout = randn(sum(lengths_q), hq, spec.value_head_dim)
    slopes = None
    if spec.alibi:
        slopes = 2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)
    return q, k, v, dout, slopes


def run_varlen(module, q, k, v, dout, slopes, lengths_q, lengths_k, *, sinks=None, **options):
    """out, dq, dk, dv (and dsinks, given sinks) through attention_varlen()."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
        options["sinks"] = leaves[3]
    out = module.attention_varlen(
        *leaves[:3],
        cu_seqlens(lengths_q),
        cu_seqlens(lengths_k),
        max(lengths_q),
        max(lengths_k),
        alibi_slopes=slopes,
        **options,
    )
    out.backward(dout)
    return (out.detach(), *(t.grad for t in leaves))


def check_per_sequence(
    spec,
    blocks,
    q,
    k,
    v,
    dout,
    slopes,
    lengths_q,
    lengths_k,
    *,
    dropout_p=0.0,
    rng_state=None,
    sinks=None,
    deterministic=True,
):
    """Each packed sequence's gradients by the rule, and d sinks (a sum over every sequence)
    against the sums of the sequences' golden and yardstick; rows no sequence covers
    exactly 0. deterministic=False: the atomic-dQ backward."""
    module = module_for(spec, blocks, "varlen")
    options = {"dropout_p": dropout_p, "rng_state": rng_state} if dropout_p else {}
    options["deterministic"] = deterministic
    out, dq, dk, dv, *dsinks = run_varlen(
        module, q, k, v, dout, slopes, lengths_q, lengths_k, sinks=sinks, **options
    )
    golden_dsinks = lowp_dsinks = 0
    cu_q, cu_k = cu_seqlens(lengths_q).tolist(), cu_seqlens(lengths_k).tolist()
    hq = q.shape[1]
    problems = []

    def heads_first(t):
        return t.transpose(0, 1)[None]

    for b in range(len(lengths_q)):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        args = [
            heads_first(t[r]) for t, r in ((q, rows_q), (k, rows_k), (v, rows_k), (dout, rows_q))
        ]
        dropout = dropout_of(rng_state, dropout_p, 1, hq, lengths_q[b], lengths_k[b], b * hq)
        grads = [heads_first(t[r]) for t, r in ((dq, rows_q), (dk, rows_k), (dv, rows_k))]
        problems += [
            f"sequence {b}: {p}"
            for p in compare_gradients(
                spec, grads, *args, alibi_slopes=slopes, dropout=dropout, sinks=sinks
            )
        ]
        if sinks is not None:
            judged = dict(alibi_slopes=slopes, dropout=dropout, sinks=sinks)
            golden_dsinks = golden_dsinks + golden_backward(spec, *args, **judged)[5]
            lowp_dsinks = lowp_dsinks + lowp_backward(spec, *args, **judged)[4]
    if sinks is not None:
        if not isinstance(golden_dsinks, torch.Tensor):  # no sequence: the sum is 0
            golden_dsinks = lowp_dsinks = torch.zeros(q.shape[1], dtype=torch.float64)
        problems += gradient_problems("dsinks", dsinks[0], golden_dsinks, lowp_dsinks)
    for name, t, covered in (
        ("out", out, cu_q[-1]),
        ("dq", dq, cu_q[-1]),
        ("dk", dk, cu_k[-1]),
        ("dv", dv, cu_k[-1]),
    ):
        if not torch.all(t[covered:] == 0):
            problems.append(f"{name}: rows no sequence covers are not 0")
    return problems


# -- the dropout mask, through a module's own RNG helper ------------------------------------------

_rng_module = load_kernel(make_spec(dtype="fp32", backward=True, dropout=True))


@triton.jit
def _keep_mask_kernel(
    Out, RngState, batch_head0, seqlen_q, seqlen_k, drop_threshold, BLOCK: tl.constexpr
):
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key_start = tl.program_id(2) * BLOCK
    keys = key_start + tl.arange(0, BLOCK)
    seed = tl.load(RngState)
    offset = tl.load(RngState + 1)
    keep = _rng_module._dropout_keep(
        seed, offset, batch_head0 + bh, rows, key_start, drop_threshold, BLOCK
    )
    ptrs = Out + (bh * seqlen_q + rows[:, None]).to(tl.int64) * seqlen_k + keys[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < seqlen_q) & (keys[None, :] < seqlen_k))


def keep_mask(rng_state, batch_heads, seqlen_q, seqlen_k, threshold, batch_head0=0):
    """[batch_heads, M, N] bool: the kernels' keep mask for batch * HQ + head in
    batch_head0 + [0, batch_heads)."""
    out = torch.zeros(batch_heads, seqlen_q, seqlen_k, dtype=torch.int8)
    if out.numel():
        grid = (batch_heads, triton.cdiv(seqlen_q, 16), triton.cdiv(seqlen_k, 16))
        _keep_mask_kernel[grid](
            out, rng_state, batch_head0, seqlen_q, seqlen_k, threshold, BLOCK=16
        )
    return out.bool()
