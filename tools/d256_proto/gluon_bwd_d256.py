"""Prototype (feasibility study, not wired into the templates): a D 256 Gluon dK/dV backward
for sm90 with the consumer warpgroups split by role, not by key rows.

One CTA owns BLOCK_N = 64 keys of one (batch, KV head), all 256 of D:
- the P warpgroup (CID 0): S^T = K Q^T [64 keys, BLOCK_M] (SS wgmma, K 256), P^T =
  exp2(S^T scale - LSE) by column, P^T (bf16) to the shared P/dS slot, dV += P^T dO from
  registers (N 256), then dQ[:, :128] = dS K[:, :128] once the dS warpgroup stored dS^T;
- the dS warpgroup (CID 1): dP^T = V dO^T (SS, K 256), P^T read back from the slot in dP^T's
  layout, dS^T = P^T (dP^T - delta) written over P^T (each thread rewrites only what it
  read), dK += dS^T Q from registers (N 256), dQ[:, 128:] = dS K[:, 128:];
- a one-warp producer: K and V once, then (Q, LSE) and (dO, delta) through a STAGES ring.
dK and dV [64, 256] fp32 are 128 registers a thread, one of them per warpgroup (not both).
dQ: per-thread fp32 atomics into the [B, N_pad, HQ, D] sum (DQ_ATOMIC), or through an fp32
staging [BLOCK_M, 32] per warpgroup by TMA reduce-adds in four 32-column pieces.
Causal (top-left or bottom-right by diag) or none; no ALiBi, softcap or window: the study's
compile (tools/d256_proto/compile_d256.py), not a served kernel; it has not run on a GPU.
"""

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@tl.core.builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    add = tl.core.ir.DESCRIPTOR_REDUCE_KIND.ADD
    _semantic.builder.create_async_tma_reduce(add, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _p16(pf, p):
    pk = gl.inline_asm_elementwise(
        "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [pf], dtype=gl.bfloat16, is_pure=True, pack=2
    )
    return gl.convert_layout(pk, p.type.layout)


@gluon.jit
def _step(it, n_m, m_first, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Step it's query head g of the group, first query row m, ring slot and its phase."""
    g = it // n_m
    return g, (m_first + it - g * n_m) * BLOCK_M, it % STAGES, (it // STAGES) & 1


@gluon.jit
def _producer(worker):
    descs, smem, bars, coords, sched = worker
    q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc = descs
    k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, pds_bufs, dq_bufs = smem
    kv_bar, q_ready, do_ready, empty, p_ready, ds_ready, pds_empty = bars
    batch, kv_head, n0, n_heads = coords
    group, n_m, n_pad, m_first = sched
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, n0, kv_head, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [batch, n0, kv_head, 0], kv_bar, v_smem)
    for it in range(group * n_m):
        g, m, s, ph = _step(it, n_m, m_first, BLOCK_M, STAGES)
        q_head = kv_head * group + g
        row = (batch * n_heads + q_head) * n_pad + m
        mbarrier.wait(empty.index(s), ph ^ 1)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [batch, m, q_head, 0], q_ready.index(s), q_bufs.index(s)
        )
        tma.async_copy_global_to_shared(lse_desc, [row], q_ready.index(s), lse_bufs.index(s))
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            do_desc, [batch, m, q_head, 0], do_ready.index(s), do_bufs.index(s)
        )
        tma.async_copy_global_to_shared(delta_desc, [row], do_ready.index(s), delta_bufs.index(s))


@gluon.jit
def _dq_piece(piece, dq_desc, dq_smem, row, col):
    tma.store_wait(0)  # the last reduce read the staging
    dq_smem.store(piece)
    fence_async_shared()
    _tma_reduce_add(dq_desc, [row, col], dq_smem)


@gluon.jit
def _dq_out(
    dq,
    dq_ptr,
    dq_row,
    dq_col,
    dq_stride,
    dq_desc,
    dq_smem,
    sm_scale,
    COL0: gl.constexpr,
    DQ_ATOMIC: gl.constexpr,
):
    """dQ's [BLOCK_M, 128] columns COL0.. (times the scale) into the fp32 sum."""
    BLOCK_M: gl.constexpr = dq.shape[0]
    COLS: gl.constexpr = dq.shape[1]
    layout: gl.constexpr = dq.type.layout
    dq = dq * sm_scale
    if DQ_ATOMIC:
        rows = dq_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = dq_col + COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        offs = rows.to(gl.int64)[:, None] * dq_stride + cols[None, :]
        gl.atomic_add(dq_ptr + offs, dq, sem="relaxed")
    else:
        # [BM, 128] -> four [BM, 32] pieces (register-only reshapes), each staged and reduced
        a, b = dq.reshape([BLOCK_M, 2, COLS // 2]).permute((0, 2, 1)).split()
        a0, a1 = a.reshape([BLOCK_M, 2, COLS // 4]).permute((0, 2, 1)).split()
        b0, b1 = b.reshape([BLOCK_M, 2, COLS // 4]).permute((0, 2, 1)).split()
        _dq_piece(a0, dq_desc, dq_smem, dq_row, dq_col + COL0)
        _dq_piece(a1, dq_desc, dq_smem, dq_row, dq_col + COL0 + 32)
        _dq_piece(b0, dq_desc, dq_smem, dq_row, dq_col + COL0 + 64)
        _dq_piece(b1, dq_desc, dq_smem, dq_row, dq_col + COL0 + 96)


@gluon.jit
def _store_keys(acc, ptr, n0, batch, kv_head, n_keys, stride_kn, stride_kh):
    """acc [BLOCK_N, D] (dK or dV of the CTA's keys) into [B, N, HKV, D], rows past Nk dropped."""
    BLOCK_N: gl.constexpr = acc.type.shape[0]
    HEAD_D: gl.constexpr = acc.type.shape[1]
    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc.type.layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc.type.layout))
    offs = (batch.to(gl.int64) * n_keys + rows[:, None]) * stride_kn + kv_head * stride_kh
    offs = offs + cols[None, :]
    gl.store(ptr + offs, acc.to(ptr.dtype.element_ty), mask=(rows < n_keys)[:, None])


@gluon.jit
def _causal_mask(x, m, shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """x (S^T in the log2 domain) with key j of row i masked where j > i + diag; only the
    blocks that meet the diagonal (a uniform branch)."""
    if m + shift < BLOCK_N - 1:
        last = m + shift + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, x.type.layout))
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, x.type.layout))
        x = gl.where(keys[:, None] <= last[None, :], x, -float("inf"))
    return x


@gluon.jit
def _consumer_p(args, DQ_ATOMIC: gl.constexpr, CAUSAL: gl.constexpr):
    """CID 0: S^T, P^T, dV += P^T dO, dQ's first 128 columns."""
    smem, bars, coords, sched, scalars, out = args
    k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, pds_bufs, dq_bufs = smem
    kv_bar, q_ready, do_ready, empty, p_ready, ds_ready, pds_empty = bars
    batch, kv_head, n0, n_heads = coords
    group, n_m, n_pad, m_first = sched
    n_keys, qk_scale, sm_scale, diag = scalars
    dq_ptr, dq_desc, dk_ptr, dv_ptr, stride_kn, stride_kh = out
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_D: gl.constexpr = k_smem.type.shape[3]
    HALF: gl.constexpr = HEAD_D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, BLOCK_M, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, HALF, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    k2 = k_smem.reshape([BLOCK_N, HEAD_D])
    shift = diag - n0
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout)
    dq_stride = n_heads * HEAD_D
    mbarrier.wait(kv_bar, 0)
    for it in range(group * n_m):
        g, m, s, ph = _step(it, n_m, m_first, BLOCK_M, STAGES)
        slot, sph = it % 2, (it // 2) & 1
        mbarrier.wait(q_ready.index(s), ph)
        q = q_bufs.index(s).reshape([BLOCK_M, HEAD_D])
        st = warpgroup_mma(k2, q.permute((1, 0)), zero, use_acc=False)
        lse2 = lse_bufs.index(s).load(col_layout)
        x = st * qk_scale - lse2[None, :]
        if CAUSAL:  # key j seen by row i iff j <= i + diag
            x = _causal_mask(x, m, shift, BLOCK_M, BLOCK_N)
        p = gl.minimum(gl.exp2(x), 1.0)
        p16 = _p16(p, gl.zeros([BLOCK_N, BLOCK_M], gl.bfloat16, a_layout))
        mbarrier.wait(pds_empty.index(slot), sph ^ 1)  # both dQ GEMMs read the slot's old dS
        pds_bufs.index(slot).store(p.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(p_ready.index(slot), count=1)
        mbarrier.wait(do_ready.index(s), ph)
        do = do_bufs.index(s).reshape([BLOCK_M, HEAD_D])
        dv_tok = warpgroup_mma(p16, do, dv, is_async=True)
        mbarrier.wait(ds_ready.index(slot), sph)
        ds = pds_bufs.index(slot).permute((1, 0))  # dS [BLOCK_M, BLOCK_N]
        dq_tok = warpgroup_mma(ds, k2.slice(0, HALF, dim=1), dq_zero, use_acc=False, is_async=True)
        dv, dq = warpgroup_mma_wait(0, deps=(dv_tok, dq_tok))
        mbarrier.arrive(pds_empty.index(slot), count=1)
        mbarrier.arrive(empty.index(s), count=1)
        dq_row = batch * n_pad + m
        dq_col = (kv_head * group + g) * HEAD_D
        _dq_out(
            dq, dq_ptr, dq_row, dq_col, dq_stride, dq_desc, dq_bufs.index(0), sm_scale, 0, DQ_ATOMIC
        )
    tma.store_wait(0)
    _store_keys(dv, dv_ptr, n0, batch, kv_head, n_keys, stride_kn, stride_kh)


@gluon.jit
def _consumer_ds(args, DQ_ATOMIC: gl.constexpr):
    """CID 1: dP^T, dS^T over P^T, dK += dS^T Q, dQ's last 128 columns."""
    smem, bars, coords, sched, scalars, out = args
    k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, pds_bufs, dq_bufs = smem
    kv_bar, q_ready, do_ready, empty, p_ready, ds_ready, pds_empty = bars
    batch, kv_head, n0, n_heads = coords
    group, n_m, n_pad, m_first = sched
    n_keys, qk_scale, sm_scale, diag = scalars
    dq_ptr, dq_desc, dk_ptr, dv_ptr, stride_kn, stride_kh = out
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_D: gl.constexpr = k_smem.type.shape[3]
    HALF: gl.constexpr = HEAD_D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, BLOCK_M, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, HALF, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    k2 = k_smem.reshape([BLOCK_N, HEAD_D])
    v2 = v_smem.reshape([BLOCK_N, HEAD_D])
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout)
    dq_stride = n_heads * HEAD_D
    mbarrier.wait(kv_bar, 0)
    for it in range(group * n_m):
        g, m, s, ph = _step(it, n_m, m_first, BLOCK_M, STAGES)
        slot, sph = it % 2, (it // 2) & 1
        mbarrier.wait(do_ready.index(s), ph)
        do = do_bufs.index(s).reshape([BLOCK_M, HEAD_D])
        dpt = warpgroup_mma(v2, do.permute((1, 0)), zero, use_acc=False)
        delta = delta_bufs.index(s).load(col_layout)
        mbarrier.wait(p_ready.index(slot), sph)
        p = pds_bufs.index(slot).load(s_layout).to(gl.float32)
        ds = p * (dpt - delta[None, :])
        ds16 = _p16(ds, gl.zeros([BLOCK_N, BLOCK_M], gl.bfloat16, a_layout))
        pds_bufs.index(slot).store(ds.to(gl.bfloat16))  # each thread over what it read
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(slot), count=1)
        mbarrier.wait(q_ready.index(s), ph)
        q = q_bufs.index(s).reshape([BLOCK_M, HEAD_D])
        dk_tok = warpgroup_mma(ds16, q, dk, is_async=True)
        dsm = pds_bufs.index(slot).permute((1, 0))
        dq_tok = warpgroup_mma(
            dsm, k2.slice(HALF, HALF, dim=1), dq_zero, use_acc=False, is_async=True
        )
        dk, dq = warpgroup_mma_wait(0, deps=(dk_tok, dq_tok))
        mbarrier.arrive(pds_empty.index(slot), count=1)
        mbarrier.arrive(empty.index(s), count=1)
        dq_row = batch * n_pad + m
        dq_col = (kv_head * group + g) * HEAD_D
        _dq_out(dq, dq_ptr, dq_row, dq_col, dq_stride, dq_desc, dq_bufs.index(1), sm_scale, HALF,
                DQ_ATOMIC)  # fmt: skip
    tma.store_wait(0)
    _store_keys(dk * sm_scale, dk_ptr, n0, batch, kv_head, n_keys, stride_kn, stride_kh)


@gluon.jit
def _barriers(STAGES: gl.constexpr):
    layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    pds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    for t in gl.static_range(2):
        mbarrier.init(p_ready.index(t), count=1)
        mbarrier.init(ds_ready.index(t), count=1)
        mbarrier.init(pds_empty.index(t), count=2)
    return kv_bar, q_ready, do_ready, empty, p_ready, ds_ready, pds_empty


@gluon.jit
def _smem(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, dq_desc, STAGES: gl.constexpr,
          DQ_ATOMIC: gl.constexpr):  # fmt: skip
    """K, V (resident); STAGES slots of Q, dO, LSE, delta; two P^T / dS^T slots [BN, BM]; the
    two warpgroups' dQ staging (none with DQ_ATOMIC)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_shape: gl.constexpr = [STAGES] + q_desc.block_type.shape
    row_shape: gl.constexpr = [STAGES] + lse_desc.block_type.shape
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, q_shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, q_shape, do_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, row_shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, row_shape, delta_desc.layout)
    pds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    if DQ_ATOMIC:
        dq_bufs = lse_bufs  # unused: dQ by atomics
    else:
        dq_shape: gl.constexpr = [2] + dq_desc.block_type.shape
        dq_bufs = gl.allocate_shared_memory(gl.float32, dq_shape, dq_desc.layout)
    return k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, pds_bufs, dq_bufs


@gluon.jit
def gluon_bwd_d256_kernel(
    dq_ptr,
    dk_ptr,
    dv_ptr,
    n_q,
    n_keys,
    n_heads,
    group,
    n_pad,
    diag,
    num_n_blocks,
    stride_kn,
    stride_kh,
    qk_scale,
    sm_scale,
    q_desc,
    do_desc,
    lse_desc,
    delta_desc,
    k_desc,
    v_desc,
    dq_desc,
    STAGES: gl.constexpr,
    DQ_ATOMIC: gl.constexpr,
    CAUSAL: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    pid = gl.program_id(0)
    n_block, bh = pid % num_n_blocks, pid // num_n_blocks
    batch, kv_head = bh // (n_heads // group), bh % (n_heads // group)
    n0 = n_block * BLOCK_N
    n_blocks_q = gl.cdiv(n_q, BLOCK_M)
    m_first = n_q * 0
    if CAUSAL:
        m_first = gl.minimum(gl.maximum(n0 - diag, 0) // BLOCK_M, n_blocks_q)
    n_m = n_blocks_q - m_first
    smem = _smem(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, dq_desc, STAGES, DQ_ATOMIC)
    bars = _barriers(STAGES)
    coords = (batch, kv_head, n0, n_heads)
    sched = (group, n_m, n_pad, m_first)
    scalars = (n_keys, qk_scale, sm_scale, diag)
    args = (smem, bars, coords, sched, scalars, (dq_ptr, dq_desc, dk_ptr, dv_ptr, stride_kn,
                                                stride_kh))  # fmt: skip
    worker = ((q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc), smem, bars, coords, sched)
    gl.warp_specialize(
        [
            (_consumer_p, (args, DQ_ATOMIC, CAUSAL)),
            (_consumer_ds, (args, DQ_ATOMIC)),
            (_producer, (worker,)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
