"""tools/bench_grid.py's per-kernel account: each step's main forward and backward kernels
(not the small ones) and FA4's time over attngen's, per cell and as geomeans."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import bench_grid  # noqa: E402

# A recorded grid (H100, D 128 N 1k causal is cell 7), its attngen step's kernels as profiled
GRID = ROOT / "docs" / "results" / "grid_h100_2026-12-07_48e6759a.json"
FA4_STEP = {  # FA4's kernel names as torch.profiler lists them (times made up)
    "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object": 378.0,
    "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object": 180.0,
    "kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPre": 92.0,
    "kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardPo": 62.0,
}


def test_the_main_kernels_leave_out_the_small_ones():
    cells = json.loads(GRID.read_text())["cells"]
    ours = cells[7]["results"]["attngen"]["step_kernels_us"]
    assert bench_grid.main_kernels(ours) == {"bwd": 469.4, "fwd": 202.3}  # not dQ's pass
    assert bench_grid.main_kernels(FA4_STEP) == {"bwd": 378.0, "fwd": 180.0}


def test_the_summary_gives_fa4_over_attngen_per_cell_and_their_geomeans():
    report = json.loads(GRID.read_text())
    report["cells"][7]["results"]["fa4"]["step_kernels_us"] = FA4_STEP
    lines = bench_grid.summary(report).splitlines()
    assert "128  1024  yes    main kernels fa4/attngen: fwd 0.89, bwd 0.81" in lines
    assert "geomean main kernels fa4/attngen: fwd 0.890, bwd 0.805" in lines
