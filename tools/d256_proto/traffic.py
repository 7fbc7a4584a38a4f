"""Per-step shared-memory traffic and tensor work of the D 256 candidates (the study's table).

A step: one query block (BM rows) against the CTA's BN keys. wgmma reads A (SS only) and B
from shared memory per m64 tile: an M x N x K GEMM costs M K E (A, SS) + (M / 64) N K E (B).
Roofline per SM (H100 SXM): 4096 dense bf16 flop/clk, 128 B/clk of shared memory."""

E = 2


def gemm(m, n, k, rs=False):
    return (0 if rs else m * k * E) + (m // 64) * n * k * E


def report(name, bm, bn, d, per_step_bytes, issued_flops, extra):
    useful = 10 * bm * bn * d
    total = per_step_bytes + extra
    clk = max(total / 128, issued_flops / 4096)
    print(
        f"{name:34s} BM{bm:4d} BN{bn:4d}  smem/step {total / 1024:6.0f} KB "
        f"({total / 128:6.0f} clk)  mma {issued_flops / 4096:6.0f} clk (useful "
        f"{useful / 4096:5.0f})  bound {useful / 4096 / clk:4.0%} of peak; "
        f"useful flop per L2 byte (Q,dO) {useful / (2 * bm * d * E):4.0f}"
    )


def tma(bm, d):
    return 2 * bm * d * E  # Q and dO written into the ring


def stage(bm, d):
    return 2 * bm * d * 4  # dQ fp32 staging: st.shared + the TMA's read


def reference():
    """Today's D 128 kernel: BN 128, keys as M (64 a warpgroup), RS dV/dK."""
    bm, bn, dd = 64, 128, 128
    wg = gemm(64, bm, dd) * 2 + gemm(64, dd, bm, True) * 2 + gemm(bm, dd // 2, bn)
    extra = tma(bm, dd) + stage(bm, dd)
    report("R  today's D128 (reference)", bm, bn, dd, 2 * wg + 2 * 64 * bm * E,
           10 * bm * bn * dd, extra)  # fmt: skip


def d_split(d, bm=64, bn=64):
    """A1: both warpgroups S^T and dP^T of all 64 keys (redundant), dK/dV D-split, RS; A2:
    D-split accumulators, WG0 S^T, WG1 dP^T, dP^T fp32 to WG0, P^T dS^T bf16 to WG1 (SS)."""
    extra = tma(bm, d) + stage(bm, d)
    wg = gemm(64, bm, d) * 2 + gemm(64, d // 2, bm, True) * 2 + gemm(bm, d // 2, bn)
    report("A1 D-split, redundant S/dP", bm, bn, d, 2 * wg + bn * bm * E, 14 * bm * bn * d, extra)
    wg0 = gemm(64, bm, d) + 2 * gemm(64, d // 2, bm, True) + gemm(bm, d // 2, bn)
    wg1 = gemm(64, bm, d) + 2 * gemm(64, d // 2, bm) + gemm(bm, d // 2, bn)
    xchg = 2 * bn * bm * 4 + 2 * bn * bm * E  # dP^T st+ld fp32; P^T, dS^T st bf16
    report("A2 D-split, S/dP exchanged", bm, bn, d, wg0 + wg1 + xchg, 10 * bm * bn * d, extra)


def role_split(d, bm=64, bn=64):
    """A3 (the prototype): WG0 S^T -> P^T, dV (RS, N 256); WG1 dP^T -> dS^T, dK (RS); dQ
    halves, by atomics or through TMA staging."""
    wg0 = gemm(64, bm, d) + gemm(64, d, bm, True) + gemm(bm, d // 2, bn)
    wg1 = gemm(64, bm, d) + gemm(64, d, bm, True) + gemm(bm, d // 2, bn)
    xchg = 3 * bn * bm * E  # P^T st (WG0), ld (WG1), dS^T st over it (WG1)
    work = 10 * bm * bn * d
    report("A3 role split, dQ by atomics", bm, bn, d, wg0 + wg1 + xchg, work, tma(bm, d))
    report("A3 role split, dQ TMA staging", bm, bn, d, wg0 + wg1 + xchg, work,
           tma(bm, d) + stage(bm, d))  # fmt: skip


def flash_attention(d, bm=64):
    """B (FA4 sm90 hd256): S, dP = Q K_c^T split by keys (N 32), P dS to smem, SS dK/dV
    D-split; F3 (FA3 hd256): BN 80, S, dP N 40 a WG, dV^T = dO^T P (M 128 = D/2, N 80) SS,
    dQ^T = K^T dS^T (M 128, N 64) SS, dQ by fp32 atomics."""
    bn, h = 64, 32
    wg = 2 * gemm(bm, h, d) + 2 * gemm(64, d // 2, bm) + gemm(bm, d // 2, bn)
    report("B  FA4-sm90 (keys split, SS dKV)", bm, bn, d, 2 * wg + 2 * bm * bn * E,
           10 * bm * bn * d, tma(bm, d) + stage(bm, d))  # fmt: skip
    bn = 80
    wg = 2 * gemm(bm, bn // 2, d) + 2 * gemm(d // 2, bn, bm) + gemm(d // 2, bm, bn)
    report("F3 FA3 hd256 (swapped dKV, dQ)", bm, bn, d, 2 * wg + 2 * bm * bn * E,
           10 * bm * bn * d, tma(bm, d))  # fmt: skip


def candidates(d=256):
    reference()
    d_split(d)
    role_split(d)
    flash_attention(d)


if __name__ == "__main__":
    candidates()
