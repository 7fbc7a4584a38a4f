"""Warp-specialized sm90 forward attention written in Gluon (Triton 3.6).

One CTA takes NUM_CONSUMERS query tiles of BLOCK_M rows of one (batch, query head):
- a one-warp producer partition loads each consumer's Q tile once and then streams the
  (K, V) blocks of the CTA's key range through a STAGES-deep shared-memory ring with TMA,
  each slot guarded by ready (TMA bytes arrived) and empty (every consumer done) mbarriers;
- each consumer is one warpgroup (4 warps) owning its own BLOCK_M-row Q tile: wgmma
  S = Q K^T (both operands in shared memory), online softmax in registers (exp2, the
  scale times log2(e) folded into one FMA), wgmma O += P V with P in registers.
  Intra-warpgroup overlap: block j's QK^T and block j-1's PV are issued together, the
  softmax of block j runs while PV(j-1) is in flight. Ping-pong: turn mbarriers hand the
  tensor cores round the consumers, so one's softmax runs under the others' GEMMs.
- Masks: key blocks past the causal diagonal are never loaded; only the blocks that
  straddle the diagonal or the end of the keys apply a mask. Loads past N are zero-filled
  by TMA (4-D descriptors over [B, N, H, D], so a tile never reads the next sequence),
  and the O store through TMA drops rows past N.
- Outputs: O [B, Nq, HQ, D] (flash-attn layout) and LSE [B, HQ, Nq] in float32, natural
  log (flash-attn's softmax_lse); a row with no key gets O = 0 and LSE = -inf.

Modes: `--compile` cross-compiles for sm90 without a GPU (gluon_forward_compile.py);
`--gpu --out DIR` runs gluon_forward_check.py (float64 golden, benchmark vs cuDNN).
"""

from __future__ import annotations

import argparse
import math
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ---------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------


@gluon.jit
def _producer(worker, NUM_CONSUMERS: gl.constexpr):
    """One warp: each consumer's Q tile, then K_j and V_j for j in [0, n_blocks) through the
    ring (a slot is refilled once every consumer released it)."""
    descs, smem, bars, coords, n_blocks = worker
    q_desc, k_desc, v_desc = descs
    q_smem, k_bufs, v_bufs = smem
    q_bars, k_ready, k_empty, v_ready, v_empty, turn = bars
    batch, q_head, kv_head, m0 = coords
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [batch, m0 + c * BLOCK_M, q_head, 0], q_bars.index(c), q_smem.index(c)
        )
    for j in range(n_blocks):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [batch, j * BLOCK_N, kv_head, 0], k_ready.index(s), k_bufs.index(s)
        )
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [batch, j * BLOCK_N, kv_head, 0], v_ready.index(s), v_bufs.index(s)
        )


@gluon.jit
def _softmax(
    s, m_i, l_i, cols, rows, n_keys, diag, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr
):
    # s: raw scores; m_i: running max of raw scores (scale > 0 so the max commutes).
    if MASK:
        valid = cols[None, :] < n_keys
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + diag)
        s = gl.where(valid, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new) * qk_scale
    alpha = gl.exp2(m_i * qk_scale - m_use)
    p = gl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _qk_issue(j, q, ring, CID: gl.constexpr, PINGPONG: gl.constexpr, s_layout: gl.constexpr):
    """Waits for K_j and this consumer's turn, issues S = Q K_j^T (async)."""
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn = ring
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
    HEAD_D: gl.constexpr = k_bufs.type.shape[4]
    BLOCK_M: gl.constexpr = q.type.shape[0]
    FIRST: gl.constexpr = 1 if CID == 0 else 0
    s = j % STAGES
    mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(CID), (j & 1) ^ FIRST)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    k_t = k_bufs.index(s).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
    return warpgroup_mma(q, k_t, zero, use_acc=False, is_async=True)


@gluon.jit
def _pv_issue(j, p, o, ring):
    """Waits for V_j, issues O += P V_j (async)."""
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn = ring
    STAGES: gl.constexpr = v_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = v_bufs.type.shape[2]
    HEAD_D: gl.constexpr = v_bufs.type.shape[4]
    s = j % STAGES
    mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
    return warpgroup_mma(p, v_bufs.index(s).reshape([BLOCK_N, HEAD_D]), o, is_async=True)


@gluon.jit
def _consumer_block(
    j, state, q, ring, mask, CID: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
    PINGPONG: gl.constexpr,
):  # fmt: skip
    """Block j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together, the softmax of S_j
    while the PV runs, then O rescaled."""
    o, p, m_i, l_i = state
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn = ring
    rows, n_keys, diag, qk_scale = mask
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
    NC: gl.constexpr = turn.type.shape[0]
    s_layout: gl.constexpr = m_i.type.layout.parent
    s_tok = _qk_issue(j, q, ring, CID, PINGPONG, s_layout)
    o_tok = _pv_issue(j - 1, p, o, ring)
    if PINGPONG:
        mbarrier.arrive(turn.index((CID + 1) % NC), count=1)
    sc = warpgroup_mma_wait(1, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(j % STAGES), count=1)
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    pf, alpha, m_i, l_i = _softmax(sc, m_i, l_i, cols, rows, n_keys, diag, qk_scale, MASK, CAUSAL)
    o = warpgroup_mma_wait(0, deps=(o_tok,))
    mbarrier.arrive(v_empty.index((j - 1) % STAGES), count=1)
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o.type.layout))[:, None]
    p = gl.convert_layout(pf.to(q.dtype), p.type.layout)
    return o, p, m_i, l_i


@gluon.jit
def _mainloop(q, ring, mask, n_blocks, mask_from, state, CID: gl.constexpr, CAUSAL: gl.constexpr,
              PINGPONG: gl.constexpr):  # fmt: skip
    """All key blocks of the CTA; returns (o, m_i, l_i) with O not yet normalised."""
    o, p, m_i, l_i = state
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn = ring
    rows, n_keys, diag, qk_scale = mask
    BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
    NC: gl.constexpr = turn.type.shape[0]
    s_layout: gl.constexpr = m_i.type.layout.parent
    # Block 0: QK^T alone (nothing to overlap with yet); always masked.
    s_tok = _qk_issue(0, q, ring, CID, PINGPONG, s_layout)
    if PINGPONG:
        mbarrier.arrive(turn.index((CID + 1) % NC), count=1)
    sc = warpgroup_mma_wait(0, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(0), count=1)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    pf, alpha, m_i, l_i = _softmax(sc, m_i, l_i, cols, rows, n_keys, diag, qk_scale, True, CAUSAL)
    state = (o, gl.convert_layout(pf.to(q.dtype), p.type.layout), m_i, l_i)
    for j in range(1, mask_from):
        state = _consumer_block(j, state, q, ring, mask, CID, False, CAUSAL, PINGPONG)
    for j in range(gl.maximum(mask_from, 1), n_blocks):
        state = _consumer_block(j, state, q, ring, mask, CID, True, CAUSAL, PINGPONG)
    o, p, m_i, l_i = state
    o = warpgroup_mma_wait(0, deps=(_pv_issue(n_blocks - 1, p, o, ring),))
    mbarrier.arrive(v_empty.index((n_blocks - 1) % k_bufs.type.shape[0]), count=1)
    return o, m_i, l_i


@gluon.jit
def _consumer(CID: gl.constexpr, args, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup: rows [m0 + CID * BLOCK_M, + BLOCK_M) of the CTA's query tile."""
    o_desc, lse_ptr, smem, bars, coords, scalars = args
    q_smem, k_bufs, v_bufs = smem
    q_bars, k_ready, k_empty, v_ready, v_empty, turn = bars
    batch, q_head, kv_head, m0 = coords
    n_q, n_keys, diag, n_blocks, mask_from, qk_scale, lse_off = scalars
    BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
    HEAD_D: gl.constexpr = k_bufs.type.shape[4]
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    dtype: gl.constexpr = k_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q4 = q_smem.index(CID)
    q = q4.reshape([BLOCK_M, HEAD_D])
    row0 = m0 + CID * BLOCK_M
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(q_bars.index(CID), 0)
    if n_blocks > 0:
        ring = (k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn)
        state = (o, gl.zeros([BLOCK_M, BLOCK_N], dtype, p_layout), m_i, l_i)
        mask = (rows, n_keys, diag, qk_scale)
        o, m_i, l_i = _mainloop(q, ring, mask, n_blocks, mask_from, state, CID, CAUSAL, PINGPONG)

    # Epilogue: normalise, O through shared memory (the Q tile's slot) and TMA; a row with
    # no key (l = 0) keeps O = 0 and gets LSE = -inf.
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = o / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    q.store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [batch, row0, q_head, 0], q4)
    lse = (m_i * qk_scale + gl.log2(l_i)) * 0.6931471805599453
    lse = gl.where(l_i == 0.0, -float("inf"), lse)
    gl.store(lse_ptr + lse_off + rows, lse, mask=rows < n_q)
    tma.store_wait(0)


@gluon.jit
def _key_range(n_keys, m0, diag, CTA_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key blocks the CTA reads ([0, n_blocks)) and the first one that needs a mask (the
    end of the keys, or the first block some row of the CTA may not see)."""
    n_blocks = gl.cdiv(n_keys, BLOCK_N)
    mask_from = n_keys // BLOCK_N
    if CAUSAL:
        last_key = m0 + CTA_M - 1 + diag  # the largest key any row of the CTA may see
        n_blocks = gl.minimum(n_blocks, gl.maximum(last_key + BLOCK_N, 0) // BLOCK_N)
        mask_from = gl.minimum(mask_from, gl.maximum(m0 + diag + 1, 0) // BLOCK_N)
    return n_blocks, gl.minimum(mask_from, n_blocks)


@gluon.jit
def _barriers(NUM_CONSUMERS: gl.constexpr, STAGES: gl.constexpr):
    """q_bars[c]: Q tile c landed; k/v ready[s]: slot s landed; k/v empty[s]: every consumer
    is done with slot s; turn[c]: consumer c may issue its GEMMs (ping-pong, handed round)."""
    layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], layout)
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bars.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=NUM_CONSUMERS)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(v_empty.index(s), count=NUM_CONSUMERS)
    return q_bars, k_ready, k_empty, v_ready, v_empty, turn


@gluon.jit
def attn_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, lse_ptr, n_q, n_keys, n_heads, group, qk_scale, diag,
    CAUSAL: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    CTA_M: gl.constexpr = BLOCK_M * NUM_CONSUMERS
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.cdiv(n_q, CTA_M) - 1 - pid_m  # longest rows first
    bh = gl.program_id(1)
    q_head = bh % n_heads
    m0 = pid_m * CTA_M
    coords = (bh // n_heads, q_head, q_head // group, m0)
    n_blocks, mask_from = _key_range(n_keys, m0, diag, CTA_M, k_desc.block_type.shape[1], CAUSAL)
    scalars = (n_q, n_keys, diag, n_blocks, mask_from, qk_scale, bh.to(gl.int64) * n_q)
    q_shape: gl.constexpr = [NUM_CONSUMERS] + q_desc.block_type.shape
    kv_shape: gl.constexpr = [STAGES] + k_desc.block_type.shape
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(q_desc.dtype, kv_shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(q_desc.dtype, kv_shape, v_desc.layout)
    smem = (q_smem, k_bufs, v_bufs)
    bars = _barriers(NUM_CONSUMERS, STAGES)
    descs = (q_desc, k_desc, v_desc)
    args = (o_desc, lse_ptr, smem, bars, coords, scalars)
    worker = (descs, smem, bars, coords, n_blocks)
    if NUM_CONSUMERS == 3:
        gl.warp_specialize(
            [(_consumer, (0, args, CAUSAL, PINGPONG)), (_consumer, (1, args, CAUSAL, PINGPONG)),
             (_consumer, (2, args, CAUSAL, PINGPONG)), (_producer, (worker, NUM_CONSUMERS))],
            [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.static_assert(NUM_CONSUMERS == 2, "NUM_CONSUMERS must be 2 or 3")
        gl.warp_specialize(
            [(_consumer, (0, args, CAUSAL, PINGPONG)), (_consumer, (1, args, CAUSAL, PINGPONG)),
             (_producer, (worker, NUM_CONSUMERS))],
            [4, 1], [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------

# Per head dim: rows per consumer warpgroup, key block, ring depth, consumers, registers.
_WG2 = dict(NUM_CONSUMERS=2, CONSUMER_REGS=240, PRODUCER_REGS=24)
CONFIGS = {
    64: dict(BLOCK_M=64, BLOCK_N=128, STAGES=3, **_WG2),
    128: dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, **_WG2),
    256: dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, **_WG2),
}


def maxnreg(cfg):
    """The register cap at entry: 65536 registers over (consumers + producer) warpgroups of
    128 threads, rounded down to 8; setmaxnreg then moves them to the consumers."""
    return 65536 // ((cfg["NUM_CONSUMERS"] + 1) * 128) // 8 * 8


def _gl_dtype(torch_dtype):
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]


def _blocks(cfg, d):
    return [1, cfg["BLOCK_M"], 1, d], [1, cfg["BLOCK_N"], 1, d]


def _check_args(q, k, v, scale):
    """Raises ValueError naming what is wrong; returns the scale (default 1/sqrt(D))."""
    import torch

    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q/k/v must be 4-D [B, N, H, D], got {q.dim()}/{k.dim()}/{v.dim()} dims")
    b, n_q, hq, d = q.shape
    bk, n_k, hkv, dk = k.shape
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q.dtype={q.dtype}: expected torch.bfloat16 or torch.float16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} must equal q.dtype {q.dtype}")
    if d not in CONFIGS or dk != d or v.shape != k.shape or bk != b:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected equal batch, "
            f"k.shape == v.shape and head dim one of {sorted(CONFIGS)}"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(f"HQ={hq} is not a multiple of HKV={hkv}")
    if b * hq > 65535:
        raise ValueError(f"B * HQ = {b * hq}: at most 65535 (the grid's second dimension)")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale}: expected finite and > 0")
    return scale


def prepare(q, k, v, causal=False, scale=None, top_left=False, cfg=None, pingpong=True):
    """Checks the arguments, allocates out/lse, builds the TMA descriptors; returns
    (launch, out, lse) where launch() runs the kernel (so a benchmark times the kernel, not
    the descriptor set-up)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    scale = _check_args(q, k, v, scale)
    b, n_q, hq, d = q.shape
    n_k, hkv = k.shape[1], k.shape[2]
    cfg = dict(CONFIGS[d] if cfg is None else cfg)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b, hq, n_q), device=q.device, dtype=torch.float32)
    if b * n_q * hq == 0:
        return (lambda: None), out, lse
    if n_k == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return (lambda: None), out, lse
    qb, kb = _blocks(cfg, d)
    gdt = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for(qb, gdt)
    k_layout = gl.NVMMASharedLayout.get_default_for(kb, gdt)
    q_desc = TensorDescriptor(q, list(q.shape), list(q.stride()), qb, q_layout)
    k_desc = TensorDescriptor(k, list(k.shape), list(k.stride()), kb, k_layout)
    v_desc = TensorDescriptor(v, list(v.shape), list(v.stride()), kb, k_layout)
    o_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), qb, q_layout)
    cta_m = cfg["BLOCK_M"] * cfg["NUM_CONSUMERS"]
    grid = (triton.cdiv(n_q, cta_m), b * hq)
    diag = 0 if top_left else n_k - n_q
    args = (q_desc, k_desc, v_desc, o_desc, lse, n_q, n_k, hq, hq // hkv, scale * LOG2E, diag)
    kwargs = dict(
        CAUSAL=bool(causal),
        STAGES=cfg["STAGES"],
        NUM_CONSUMERS=cfg["NUM_CONSUMERS"],
        PINGPONG=bool(pingpong) and cfg["NUM_CONSUMERS"] > 1,
        CONSUMER_REGS=cfg["CONSUMER_REGS"],
        PRODUCER_REGS=cfg["PRODUCER_REGS"],
        num_warps=4,
        maxnreg=maxnreg(cfg),
    )

    def launch():
        attn_fwd_kernel[grid](*args, **kwargs)

    return launch, out, lse


def gluon_attention(q, k, v, causal=False, scale=None, top_left=False, cfg=None, pingpong=True):
    """q [B, Nq, HQ, D], k/v [B, Nk, HKV, D] (bf16/fp16, last dim contiguous, 16-byte
    aligned strides) -> (out [B, Nq, HQ, D], lse [B, HQ, Nq] float32, natural log). Causal
    is bottom-right aligned (flash-attn) unless top_left (SDPA's is_causal)."""
    launch, out, lse = prepare(q, k, v, causal, scale, top_left, cfg, pingpong)
    launch()
    return out, lse


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--compile", action="store_true", help="cross-compile for sm90 and report resources"
    )
    ap.add_argument("--gpu", action="store_true", help="correctness and benchmark on the GPU")
    ap.add_argument("--check", action="store_true", help="GPU correctness only")
    ap.add_argument("--bench", action="store_true", help="GPU benchmark only")
    ap.add_argument("--nc3", action="store_true", help="GPU: three-consumer variants, D 64/128")
    ap.add_argument("--out", default=None, help="folder for the JSON results")
    args = ap.parse_args(argv)
    if args.compile:
        import gluon_forward_compile

        gluon_forward_compile.run_compile()
    if args.gpu or args.check or args.bench or args.nc3:
        import gluon_forward_check

        gluon_forward_check.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
