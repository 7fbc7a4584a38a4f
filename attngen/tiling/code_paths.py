"""The code paths a prefill or varlen module takes besides its tile config: how K/V blocks are
loaded and in which order programs start. render puts them in the template context and
`attngen explain` prints them. Each threshold is a measurement on the H200
(exp_prefill.py@163a2b7; docs/performance.md), so every path beyond the portable one is chosen
only on Hopper.

TMA needs 16-byte aligned strides: a head dim whose rows are not a multiple of 16 bytes
(D * itemsize % 16 != 0, e.g. 59 or 111 in fp16) is read through pointer loads on every arch,
and the tiling model leaves the TMA barriers out of its shared memory for it
(prefill.tma_strides_aligned). The module also checks each call's strides and falls back to
pointers for a layout TMA cannot read (its kv_load_path).
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.arch import ARCHS
from attngen.spec import AttnSpec, KernelKind
from attngen.tiling.prefill import TMA_MASKED_MAX_HEAD_DIM
from attngen.tiling.rows import tma_strides_aligned

# Causal prefill modules on Hopper with a head dim above LPT_ABOVE_HEAD_DIM schedule
# LPT_GROUP_HEADS heads at a time longest-processing-time first: the heaviest query block of
# each head in the group first, then the next heaviest. Measured on the H200 with
# exp_prefill.py@163a2b7, "lpt_group16":
# - D = 256 causal: +6.9% at N = 1024 and +6.4% at N = 4096;
# - D = 64 and 128: the committed configs moved between -1.6% and +1.4%, so those stay
#   head by head;
# - grouping every head at once lost 10-30%.
# Sixteen heads of K/V (16 MB at D = 256, N = 1024) stay in the 50 MB L2.
LPT_GROUP_HEADS = 16
LPT_ABOVE_HEAD_DIM = 128

# A launch of at most POINTER_LOADS_UP_TO (program, key block) pairs reads K/V by pointer loads
# even where TMA could: building its two tensor descriptors costs more host time than TMA can
# save on so small a kernel. On the H200's host (exp_host_overhead.py@edd285e,
# docs/results/host_overhead_2026-11-30_before_launcher.json) the compiled launcher took
# 23.3 us with TMA descriptors and 14.1 us with pointers at B 1, H 12, N 64, D 64: about 9 us
# of descriptor encoding per launch, on every launch. TMA saves 5-12% of the kernel's time
# (exp_prefill.py@163a2b7: pointers -> tma). 512 pairs are about four key blocks per SM of an
# H100/H200's 132: a kernel of a few microseconds, of which 5-12% is well under the 9 us the
# descriptors cost, and whose launch the host is the bottleneck of anyway. Under Triton's
# interpreter (the CPU tests) the threshold is 0: no launcher encodes anything there, and
# the tests' small shapes keep exercising the TMA path.
POINTER_LOADS_UP_TO = 512


@dataclass(frozen=True)
class CodePaths:
    why_not_tma: str  # why K/V go through pointers; empty when TMA loads them
    tma_masked_blocks: bool  # the masked (diagonal, window edge, tail) blocks through TMA too
    lpt_group_heads: int  # heads per longest-first group of the causal schedule; 0: off

    @property
    def tma(self) -> bool:
        """Unmasked K/V blocks through tensor descriptors (Hopper's copy engine)."""
        return not self.why_not_tma

    def describe(self) -> str:
        if not self.tma:
            loads = f"K/V by pointer loads ({self.why_not_tma})"
        elif self.tma_masked_blocks:
            loads = "K/V through TMA, masked blocks too"
        else:
            loads = "K/V through TMA, masked blocks by pointer loads (D > "
            loads += f"{TMA_MASKED_MAX_HEAD_DIM}: the extra branch spills)"
        order = "one head's query blocks after another's, the last block first"
        if self.lpt_group_heads:
            order = f"heaviest causal query blocks first, in groups of {self.lpt_group_heads}"
            order += f" heads (causal, D > {LPT_ABOVE_HEAD_DIM})"
        return f"{loads}; {order}"


def code_paths(spec: AttnSpec, arch: str, kind: KernelKind) -> CodePaths:
    """The paths of `kind` (prefill or varlen) for `spec` on `arch`."""
    widest = max(spec.head_dim, spec.value_head_dim)
    if not ARCHS[arch].has_tma:
        why_not = f"no TMA on {arch}"
    elif spec.dtype.itemsize != 2:
        why_not = "fp32 dots are FMA loops, which do not read operands as TMA lays them out"
    elif kind is not KernelKind.prefill:
        why_not = "varlen's packed rows would need other descriptors"
    elif not tma_strides_aligned(spec):
        why_not = (
            f"head dims {spec.head_dim}/{spec.value_head_dim} x {spec.dtype.itemsize} B "
            "are not multiples of 16 B, which a tensor descriptor's strides must be"
        )
    else:
        why_not = ""
    tma = not why_not
    lpt = tma and spec.mask.value == "causal" and widest > LPT_ABOVE_HEAD_DIM
    masked_blocks = tma and widest <= TMA_MASKED_MAX_HEAD_DIM
    return CodePaths(why_not, masked_blocks, LPT_GROUP_HEADS if lpt else 0)
