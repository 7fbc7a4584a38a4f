"""Warp-specialized sm90 dK/dV backward attention written in Gluon (Triton 3.6), FA3's design.

One CTA owns BLOCK_N keys of one (batch, KV head); its NUM_CONSUMERS consumer warpgroups own
BLOCK_N / NUM_CONSUMERS key rows apiece (wgmma's M is 64 per warpgroup):
- a one-warp producer partition loads K and V once, then streams (Q, LSE) and (dO, delta)
  blocks of BLOCK_M query rows of every query head of the KV group through a STAGES-deep
  shared-memory ring with TMA, each slot guarded by ready (bytes arrived) and empty (every
  consumer done) mbarriers;
- each consumer, per query block: S^T = K_c Q^T and dP^T = V_c dO^T (wgmma, both operands in
  shared memory, issued together), P^T = exp2(S^T * scale log2 e - LSE log2 e) and
  dS^T = P^T (dP^T - delta) in registers, then dV_c += P^T dO and dK_c += dS^T Q with P^T
  and dS^T as register operands; the fp32 dK_c and dV_c accumulators stay in the
  consumer's registers for the whole loop (GQA: the group's query heads summed there);
- dQ (five products, not seven): both consumers store dS^T to a two-slot shared buffer; the
  consumer whose index is the block's parity computes dQ_j = dS_j K (one wgmma over the whole
  key block, A read transposed from shared memory) and adds dQ_j * scale into an fp32 dQ
  accumulator with relaxed atomics; the slots alternate, so the two consumers take turns
  (ds_ready: both stored; ds_empty: the dQ GEMM read it);
- masks: under causal (either alignment) only the query blocks that straddle the diagonal
  apply it, blocks above it are never loaded; rows past Nq read LSE +inf and delta 0 from
  the padded row statistics (P = 0, dS = 0), keys past Nk are zero-filled by TMA (their dK,
  dV rows are not stored; their dS meets K = 0 in dQ).

Inputs are flash-attn's layout: q, dO, out [B, Nq, HQ, D], k, v [B, Nk, HKV, D], lse
[B, HQ, Nq] (natural log, -inf for a row that sees no key). The host prepares the padded
row statistics (LSE log2 e with +inf past Nq and for rows without keys, delta = rowsum(dO O))
and a zeroed fp32 dQ accumulator [B, HQ, Nq_pad, D]; dQ is that sum cast to the input dtype.

Modes: `--compile` cross-compiles every proposed config for sm90 without a GPU and checks
it against the model (gluon_backward_tiling.py); `--gpu`/`--check`/`--bench --out DIR` run
gluon_backward_check.py (float64 golden, benchmark vs the tile-level backward and SDPA).
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


# ---------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------


@gluon.jit
def _bwd_producer(worker):
    """One warp: K and V once, then (Q, LSE) and (dO, delta) of each step through the ring;
    a step is (query head g of the group, query block m), g outer."""
    descs, smem, bars, coords, sched = worker
    q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc = descs
    k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_smem = smem
    kv_bar, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty = bars
    batch, kv_head, n0, n_heads = coords
    group, m_first, n_m, n_pad = sched
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, n0, kv_head, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [batch, n0, kv_head, 0], kv_bar, v_smem)
    for it in range(group * n_m):
        g = it // n_m
        m = (m_first + it - g * n_m) * BLOCK_M
        q_head = kv_head * group + g
        row = (batch * n_heads + q_head) * n_pad + m
        s = it % STAGES
        ph = (it // STAGES) & 1
        mbarrier.wait(q_empty.index(s), ph ^ 1)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [batch, m, q_head, 0], q_ready.index(s), q_bufs.index(s)
        )
        tma.async_copy_global_to_shared(lse_desc, [row], q_ready.index(s), lse_bufs.index(s))
        mbarrier.wait(do_empty.index(s), ph ^ 1)
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            do_desc, [batch, m, q_head, 0], do_ready.index(s), do_bufs.index(s)
        )
        tma.async_copy_global_to_shared(delta_desc, [row], do_ready.index(s), delta_bufs.index(s))


@gluon.jit
def _bwd_scores(it, m, ring, consts, MASK: gl.constexpr):
    """S_c = Q K_c^T and dP_c = dO V_c^T [BLOCK_M, ROWS] issued together; returns P and
    dS = P (dP - delta) in fp32 (the query rows are the tile's rows: one LSE and one delta
    per row, two registers a thread)."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_smem, k_c, v_c, k2, bars = ring
    kv_bar, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty = bars
    key0, diag, qk_scale, sm_scale, dq_ptr, dq_row0 = consts
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    HEAD_D: gl.constexpr = q_bufs.type.shape[4]
    ROWS: gl.constexpr = k_c.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, ROWS, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s = it % STAGES
    ph = (it // STAGES) & 1
    zero = gl.zeros([BLOCK_M, ROWS], gl.float32, s_layout)
    mbarrier.wait(q_ready.index(s), ph)
    q = q_bufs.index(s).reshape([BLOCK_M, HEAD_D])
    s_tok = warpgroup_mma(q, k_c.permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ph)
    do = do_bufs.index(s).reshape([BLOCK_M, HEAD_D])
    dp_tok = warpgroup_mma(do, v_c.permute((1, 0)), zero, use_acc=False, is_async=True)
    lse2 = lse_bufs.index(s).load(row_layout)
    sc = warpgroup_mma_wait(1, deps=(s_tok,))
    p = gl.exp2(sc * qk_scale - lse2[:, None])
    if MASK:  # causal: key j is seen by row i iff j <= i + diag
        # every block of a causal launch (a branch on the straddling ones costs more
        # registers: 132 B of spills against 72 at D 128): the last key offset each row
        # sees, against the key offsets of the tile
        last = m + diag - key0 + gl.arange(0, BLOCK_M, layout=row_layout)
        offs = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(offs[None, :] <= last[:, None], p, 0.0)
    delta = delta_bufs.index(s).load(row_layout)
    dp = warpgroup_mma_wait(0, deps=(dp_tok,))
    return p, p * (dp - delta[:, None])


@gluon.jit
def _bwd_dq(it, dq_row, ring, consts, CID: gl.constexpr, DQ_SPLIT: gl.constexpr):
    """dQ_j = dS_j K over the whole key block, added (times the scale) into the fp32 dQ
    accumulator with relaxed atomics. DQ_SPLIT: this consumer's half of dQ's columns (K's
    columns sliced in shared memory), every step; else the whole of dQ on this consumer's
    turn (steps of its parity)."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_smem, k_c, v_c, k2, bars = ring
    kv_bar, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty = bars
    key0, diag, qk_scale, sm_scale, dq_ptr, dq_row0 = consts
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    HEAD_D: gl.constexpr = q_bufs.type.shape[4]
    COLS: gl.constexpr = HEAD_D // 2 if DQ_SPLIT else HEAD_D
    COL0: gl.constexpr = CID * COLS if DQ_SPLIT else 0
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, COLS, 16])
    slot = it % 2
    mbarrier.wait(ds_ready.index(slot), (it // 2) & 1)
    zero = gl.zeros([BLOCK_M, COLS], gl.float32, acc_layout)
    dq = warpgroup_mma(ds_bufs.index(slot), k2.slice(COL0, COLS, dim=1), zero, use_acc=False)
    mbarrier.arrive(ds_empty.index(slot), count=1)
    # [B, HQ, n_pad, D] fp32: this step's rows start dq_row0 + dq_row rows on.
    red_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // COLS, COLS // 4], [4, 1], [1, 0])
    dq = gl.convert_layout(dq * sm_scale, red_layout)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, red_layout))
    cols = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, red_layout))
    base = dq_ptr + (dq_row0 + dq_row) * HEAD_D
    gl.atomic_add(base + rows[:, None] * HEAD_D + cols[None, :], dq, sem="relaxed")


@gluon.jit
def _bwd_step(
    it,
    dq_row,
    m,
    dk,
    dv,
    ring,
    consts,
    CID: gl.constexpr,
    MASK: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
):
    """One query block: P and dS to shared memory (this consumer's key columns), then
    dV_c += P^T dO and dK_c += dS^T Q (A read transposed from shared memory), dQ."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_smem, k_c, v_c, k2, bars = ring
    kv_bar, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty = bars
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    HEAD_D: gl.constexpr = q_bufs.type.shape[4]
    ROWS: gl.constexpr = k_c.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    p, ds = _bwd_scores(it, m, ring, consts, MASK)
    s = it % STAGES
    slot = it % 2
    p_c = p_smem.slice(CID * ROWS, ROWS, dim=1)
    p_c.store(p.to(dtype))
    mbarrier.wait(ds_empty.index(slot), ((it // 2) & 1) ^ 1)
    ds_c = ds_bufs.index(slot).slice(CID * ROWS, ROWS, dim=1)
    ds_c.store(ds.to(dtype))
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(slot), count=1)  # after a barrier of the warpgroup
    do = do_bufs.index(s).reshape([BLOCK_M, HEAD_D])
    dv_tok = warpgroup_mma(p_c.permute((1, 0)), do, dv, is_async=True)
    q = q_bufs.index(s).reshape([BLOCK_M, HEAD_D])
    dk_tok = warpgroup_mma(ds_c.permute((1, 0)), q, dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
    if DQ_SPLIT:
        _bwd_dq(it, dq_row, ring, consts, CID, DQ_SPLIT)
    elif slot == CID:
        _bwd_dq(it, dq_row, ring, consts, CID, DQ_SPLIT)
    mbarrier.arrive(q_empty.index(s), count=1)
    mbarrier.arrive(do_empty.index(s), count=1)
    return dk, dv


@gluon.jit
def _bwd_consumer(CID: gl.constexpr, args, CAUSAL: gl.constexpr, DQ_SPLIT: gl.constexpr):
    """One warpgroup: key rows [n0 + CID * ROWS, + ROWS) of the CTA's key block."""
    smem, bars, coords, sched, scalars, out = args
    k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_smem = smem
    batch, kv_head, n0, n_heads = coords
    group, m_first, n_m, n_pad = sched
    n_keys, diag, qk_scale, sm_scale = scalars
    dq_ptr, dk_ptr, dv_ptr, stride_kn, stride_kh = out
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    HEAD_D: gl.constexpr = k_smem.type.shape[3]
    NC: gl.constexpr = ds_ready_count(BLOCK_N)
    ROWS: gl.constexpr = BLOCK_N // NC
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, HEAD_D, 16])
    k2 = k_smem.reshape([BLOCK_N, HEAD_D])
    v2 = v_smem.reshape([BLOCK_N, HEAD_D])
    ring = (
        q_bufs,
        do_bufs,
        lse_bufs,
        delta_bufs,
        ds_bufs,
        p_smem,
        k2.slice(CID * ROWS, ROWS),
        v2.slice(CID * ROWS, ROWS),
        k2,
        bars,
    )
    dq_row0 = (batch * n_heads + kv_head * group).to(gl.int64) * n_pad
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(bars[0], 0)
    consts = (n0 + CID * ROWS, diag, qk_scale, sm_scale, dq_ptr, dq_row0)
    for it in range(group * n_m):
        g = it // n_m
        m = (m_first + it - g * n_m) * BLOCK_M
        dk, dv = _bwd_step(it, g * n_pad + m, m, dk, dv, ring, consts, CID, CAUSAL, DQ_SPLIT)
    # Epilogue: dK (times the scale) and dV in the input dtype, rows past Nk dropped.
    rows = n0 + CID * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
    offs = (batch.to(gl.int64) * n_keys + rows[:, None]) * stride_kn + kv_head * stride_kh
    offs = offs + cols[None, :]
    ok = (rows < n_keys)[:, None]
    gl.store(dk_ptr + offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=ok)
    gl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=ok)


@gluon.constexpr_function
def ds_ready_count(block_n):
    """Consumer warpgroups of a key block: one per 64 key rows (wgmma's M)."""
    return block_n // 64


@gluon.jit
def _bwd_query_range(n_q, n0, diag, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """Query blocks the key block starting at n0 meets: [m_first, m_first + n_m). Under
    causal, rows i >= n0 - diag see some key of it; the blocks above are never loaded."""
    n_blocks_q = gl.cdiv(n_q, BLOCK_M)
    m_first = n_q * 0
    if CAUSAL:
        m_first = gl.minimum(gl.maximum(n0 - diag, 0) // BLOCK_M, n_blocks_q)
    return m_first, n_blocks_q - m_first


@gluon.jit
def _bwd_barriers(STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, DQ_SPLIT: gl.constexpr):
    """kv_bar: K and V landed; q/do ready[s]: slot s landed; q/do empty[s]: every consumer
    is done with slot s; ds_ready[t]: every consumer stored its dS^T in dQ slot t;
    ds_empty[t]: the dQ GEMMs (both consumers' with DQ_SPLIT, else one) read slot t."""
    layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=NUM_CONSUMERS)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(do_empty.index(s), count=NUM_CONSUMERS)
    for t in gl.static_range(2):
        mbarrier.init(ds_ready.index(t), count=NUM_CONSUMERS)
        mbarrier.init(ds_empty.index(t), count=NUM_CONSUMERS if DQ_SPLIT else 1)
    return kv_bar, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty


@gluon.jit
def _bwd_smem(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, STAGES: gl.constexpr):
    """K, V (resident); STAGES slots of Q, dO, LSE, delta; two dS slots and P [BM, BN]."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_shape: gl.constexpr = [STAGES] + q_desc.block_type.shape
    row_shape: gl.constexpr = [STAGES] + lse_desc.block_type.shape
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, q_shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, q_shape, do_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, row_shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, row_shape, delta_desc.layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], ds_layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], ds_layout)
    return k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_smem


@gluon.jit
def attn_bwd_dkdv_kernel(
    q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, dq_ptr, dk_ptr, dv_ptr, n_q, n_keys,
    n_heads, group, n_pad, diag, num_n_blocks, stride_kn, stride_kh, qk_scale, sm_scale,
    CAUSAL: gl.constexpr, STAGES: gl.constexpr, DQ_SPLIT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    NUM_CONSUMERS: gl.constexpr = ds_ready_count(BLOCK_N)
    gl.static_assert(NUM_CONSUMERS == 2, "BLOCK_N must be 128: two consumers of 64 key rows")
    # A 1-D grid, a KV head's key blocks adjacent (they share Q and dO in L2); under causal
    # the first key block (the one most queries see) first.
    pid = gl.program_id(0)
    n_block = pid % num_n_blocks
    bh = pid // num_n_blocks
    n_kv_heads = n_heads // group
    batch = bh // n_kv_heads
    kv_head = bh % n_kv_heads
    n0 = n_block * BLOCK_N
    m_first, n_m = _bwd_query_range(n_q, n0, diag, BLOCK_M, CAUSAL)
    smem = _bwd_smem(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, STAGES)
    bars = _bwd_barriers(STAGES, NUM_CONSUMERS, DQ_SPLIT)
    coords = (batch, kv_head, n0, n_heads)
    sched = (group, m_first, n_m, n_pad)
    args = (
        smem,
        bars,
        coords,
        sched,
        (n_keys, diag, qk_scale, sm_scale),
        (dq_ptr, dk_ptr, dv_ptr, stride_kn, stride_kh),
    )
    worker = ((q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc), smem, bars, coords, sched)
    gl.warp_specialize(
        [
            (_bwd_consumer, (0, args, CAUSAL, DQ_SPLIT)),
            (_bwd_consumer, (1, args, CAUSAL, DQ_SPLIT)),
            (_bwd_producer, (worker,)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------


def config_for(d, stages=None):
    """The derived config for head dim d (gluon_backward_tiling.derive); `stages` overrides
    the ring depth (a benchmark variant; it must still fit)."""
    import gluon_backward_tiling as tiling

    cfg = tiling.derive(d)
    if stages is not None:
        cfg = tiling.candidate(d, cfg.block_m, stages)
        if cfg.rejected:
            raise ValueError(f"stages={stages} at D {d}: {'; '.join(cfg.rejected)}")
    return cfg


def _check_args(q, k, v, out, lse, dout, scale):
    """Raises ValueError naming what is wrong; returns the scale (default 1/sqrt(D))."""
    import gluon_backward_tiling as tiling
    import torch

    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, N, H, D], got {t.dim()} dims")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous ([B, N, H, D], flash-attn's layout)")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype={t.dtype} must equal q.dtype={q.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q.dtype={q.dtype}: expected torch.bfloat16 or torch.float16")
    b, n_q, hq, d = q.shape
    if d not in tiling.HEAD_DIMS or k.shape[-1] != d or v.shape != k.shape or k.shape[0] != b:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected equal batch, "
            f"k.shape == v.shape and head dim one of {tiling.HEAD_DIMS}"
        )
    if out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must be q's shape")
    if tuple(lse.shape) != (b, hq, n_q) or lse.dtype != torch.float32:
        raise ValueError(f"lse {tuple(lse.shape)} {lse.dtype}: expected ({b}, {hq}, {n_q}) fp32")
    if k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(f"HQ={hq} is not a multiple of HKV={k.shape[2]}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale}: expected finite and > 0")
    return scale


def _row_stats(out, lse, dout, n_pad):
    """LSE log2 e (+inf for rows without keys and past Nq) and delta = rowsum(dO O) (0 past
    Nq), [B * HQ * n_pad] fp32: what the producer streams with each query block."""
    import torch

    b, n_q, hq, _ = out.shape
    lse2 = torch.full((b, hq, n_pad), math.inf, device=out.device, dtype=torch.float32)
    lse2[..., :n_q] = torch.where(lse == -math.inf, math.inf, lse * LOG2E)
    delta = torch.zeros((b, hq, n_pad), device=out.device, dtype=torch.float32)
    delta[..., :n_q] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return lse2.view(-1), delta.view(-1)


def _descriptors(q, k, v, dout, lse2, delta, cfg):
    """The TMA descriptors: Q and dO [1, BM, 1, D] boxes over [B, N, H, D], K and V
    [1, BN, 1, D], the padded row statistics [BM] boxes over their flat arrays."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = q.shape[-1]
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    qb, kb = [1, cfg.block_m, 1, d], [1, cfg.block_n, 1, d]
    q_layout = gl.NVMMASharedLayout.get_default_for(qb, gdt)
    k_layout = gl.NVMMASharedLayout.get_default_for(kb, gdt)
    row_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)

    def desc(t, block, layout):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    return (
        desc(q, qb, q_layout),
        desc(dout, qb, q_layout),
        desc(lse2, [cfg.block_m], row_layout),
        desc(delta, [cfg.block_m], row_layout),
        desc(k, kb, k_layout),
        desc(v, kb, k_layout),
    )


def prepare_backward(
    q, k, v, out, lse, dout, causal=False, scale=None, top_left=False, stages=None
):
    """Checks, row statistics, a zeroed fp32 dQ accumulator (launch(rezero=True) zeroes it
    again), dK, dV, descriptors -> (launch, finish, dk, dv); finish() returns dQ."""
    import torch

    scale = _check_args(q, k, v, out, lse, dout, scale)
    b, n_q, hq, d = q.shape
    n_k, hkv = k.shape[1], k.shape[2]
    cfg = config_for(d, stages)
    n_pad = triton.cdiv(max(n_q, 1), cfg.block_m) * cfg.block_m
    dq_acc = torch.zeros((b, hq, n_pad, d), device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)

    def finish():
        return dq_acc[:, :, :n_q].transpose(1, 2).to(q.dtype)

    if b * hq * n_k == 0 or n_q == 0:
        dk.zero_()
        dv.zero_()
        return (lambda rezero=False: None), finish, dk, dv
    lse2, delta = _row_stats(out, lse, dout, n_pad)
    descs = _descriptors(q, k, v, dout, lse2, delta, cfg)
    num_n_blocks = triton.cdiv(n_k, cfg.block_n)
    diag = 0 if top_left else n_k - n_q
    args = (
        *descs,
        dq_acc,
        dk,
        dv,
        n_q,
        n_k,
        hq,
        hq // hkv,
        n_pad,
        diag,
        num_n_blocks,
        k.stride(1),
        k.stride(2),
        scale * LOG2E,
        scale,
    )
    kwargs = dict(
        CAUSAL=bool(causal),
        STAGES=cfg.stages,
        DQ_SPLIT=cfg.dq_split,
        CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs,
        num_warps=4,
        maxnreg=cfg.maxnreg,
    )
    grid = (num_n_blocks * b * hkv,)

    def launch(rezero=False):
        if rezero:
            dq_acc.zero_()
        attn_bwd_dkdv_kernel[grid](*args, **kwargs)

    return launch, finish, dk, dv


def gluon_backward(q, k, v, out, lse, dout, causal=False, scale=None, top_left=False, stages=None):
    """Gradients of attention from the forward's out and lse: q, out, dout [B, Nq, HQ, D],
    k, v [B, Nk, HKV, D] (bf16/fp16, contiguous), lse [B, HQ, Nq] fp32 natural log ->
    (dq, dk, dv) in the inputs' layouts and dtype. Causal is bottom-right aligned
    (flash-attn) unless top_left (SDPA's is_causal)."""
    launch, finish, dk, dv = prepare_backward(
        q, k, v, out, lse, dout, causal, scale, top_left, stages
    )
    launch()
    return finish(), dk, dv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--compile",
        action="store_true",
        help="cross-compile every proposed config for sm90, check the model",
    )
    ap.add_argument("--gpu", action="store_true", help="correctness and benchmark on the GPU")
    ap.add_argument("--check", action="store_true", help="GPU correctness only")
    ap.add_argument("--bench", action="store_true", help="GPU benchmark only")
    ap.add_argument("--out", default=None, help="folder for the JSON results")
    args = ap.parse_args(argv)
    status = 0
    if args.compile:
        import gluon_backward_tiling as tiling

        rows = tiling.verify(tiling.proposed(), dtypes=("bf16", "fp16"), out_dir=args.out)
        print(tiling.table(rows))
        status = int(any(r["problems"] for r in rows))
    if args.gpu or args.check or args.bench:
        import gluon_backward_check

        status |= gluon_backward_check.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
