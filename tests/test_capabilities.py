"""docs/capabilities.md is what `attngen capabilities` generates from the tiling model."""

from __future__ import annotations

from pathlib import Path

from attngen.cli.capabilities import HEAD_DIMS, MATRIX_MASKS, capability_cells, render_capabilities
from attngen.spec import Dtype
from attngen.verify.measurements import data_path, load_measurements, triton_version

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "docs" / "capabilities.md"


def test_committed_capability_matrix_is_current():
    expected = render_capabilities(
        capability_cells(), load_measurements(data_path(triton_version()))
    )
    assert COMMITTED.read_text(encoding="utf-8") == expected, (
        "docs/capabilities.md is stale: run `attngen capabilities --out docs/capabilities.md`"
    )


def test_matrix_covers_every_arch_dtype_head_dim_and_mask():
    cells = capability_cells(["sm86"])
    assert len(cells) == len(Dtype) * len(HEAD_DIMS) * len(MATRIX_MASKS)
    for cell in cells:  # a config, or the reason there is none
        assert (cell.config is None) == bool(cell.reason)


def test_fp32_configs_are_never_promised_not_to_spill():
    """ptxas's fp32 (FMA) register use is not a function of the tile: the model says so."""
    for cell in capability_cells(["sm80", "sm90"]):
        if cell.config is not None:
            assert cell.may_spill == (cell.dtype == "fp32")
