"""GPU targets as data.

A new GPU target is a new row here, nothing else: the tiler reads its budgets, the spec accepts
its name, and the build emits a module for it. This module is a leaf (the spec validates arch
names against it), so it imports nothing from attngen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuArch:
    """Budgets of one NVIDIA compute capability, as the tiler sees them.

    Invariants: smem_per_block <= smem_per_sm; all sizes in bytes; counts are per SM unless named
    otherwise. `sm_count` is that of the reference part named in `part`, used only for wave
    quantization estimates (the runtime never relies on it).
    """

    name: str
    compute_capability: int
    part: str
    sm_count: int
    smem_per_block: int  # opt-in maximum dynamic shared memory for one block
    smem_per_sm: int
    regs_per_sm: int
    max_regs_per_thread: int
    max_threads_per_sm: int
    has_wgmma: bool  # Hopper warpgroup MMA (Triton uses it for 16-bit dots with BLOCK_M >= 64)
    smem_reserved: int = 0  # static shared memory ptxas puts in every cubin for this target
    # Shared memory the CUDA driver sets aside for every resident block on top of what the
    # block asks for (cudaDevAttrReservedSharedMemoryPerBlock: 1 KiB since sm80). It does not
    # count against the per-block limit, only against the SM's capacity, i.e. occupancy.
    smem_block_reserve: int = 1024
    # The tensor-memory accelerator (cp.async.bulk.tensor), which the generated prefill uses
    # for unmasked K/V blocks: measured on the H200, 5-12% faster (exp_prefill.py@163a2b7).
    has_tma: bool = False

    @property
    def smem_block_cost(self) -> int:
        """What a resident block takes from the SM's shared memory beyond what it asks for.

        Where ptxas puts static shared memory in every cubin (sm90, sm120), that 1 KiB is taken
        to be the driver's per-block reserve, not an addition to it. The evidence (H200): a
        64x64, 4-warp, 3-stage causal D = 128 prefill asking for 115712 B took 0.200 ms at
        N = 1024 where its variant asking for 115736 B took 0.297 ms (autotune, 2026-11-30).
        Two blocks fit per SM only if the 1 KiB counts once: 2 x (115712 + 1024) is the SM's
        228 KiB exactly, 24 bytes more is over; counted twice, neither would fit two.
        """
        return max(self.smem_reserved, self.smem_block_reserve)

    @property
    def smem_budget(self) -> int:
        """Dynamic shared memory one program may ask for: the opt-in limit minus the reserve."""
        return self.smem_per_block - self.smem_reserved


# One row per target. Numbers from NVIDIA's CUDA C++ Programming Guide, "Compute capabilities"
# table (shared memory opt-in limits checked against the H200: 232448).
ARCHS: dict[str, GpuArch] = {
    arch.name: arch
    for arch in (
        # A100: 164 KiB shared per SM, 163 KiB opt-in per block.
        GpuArch("sm80", 80, "A100", 108, 166_912, 167_936, 65_536, 255, 2048, False),
        # GA10x (A10, RTX 3090): 100 KiB per SM, 99 KiB per block; fewer threads per SM.
        GpuArch("sm86", 86, "A10", 72, 101_376, 102_400, 65_536, 255, 1536, False),
        # Ada (L4, L40S, RTX 4090): same budgets as sm86.
        GpuArch("sm89", 89, "L40S", 142, 101_376, 102_400, 65_536, 255, 1536, False),
        # Hopper (H100, H200): 228 KiB per SM, 227 KiB per block, of which ptxas reserves
        # 1 KiB of static shared memory in every Triton 3.6 cubin (attngen/verify/compiler.py).
        GpuArch(
            "sm90",
            90,
            "H100/H200",
            132,
            232_448,
            233_472,
            65_536,
            255,
            2048,
            True,
            1024,
            has_tma=True,
        ),
        # Consumer Blackwell (RTX 5090): like sm86/sm89 (100 KiB per SM, 99 KiB opt-in per
        # block, 1536 threads/SM; NVIDIA CCCL arch_traits<sm_120>). Triton 3.6 targets sm_120a
        # with mma.sync (no wgmma or tcgen05 in the PTX), and ptxas reserves 1 KiB as on sm90.
        GpuArch("sm120", 120, "RTX 5090", 170, 101_376, 102_400, 65_536, 255, 1536, False, 1024),
    )
}


def arch_names() -> tuple[str, ...]:
    return tuple(ARCHS)
