"""`attngen explain` and `build` when a spec cannot be served: said before any compile, with
the nearest feasible alternative or the reason none exists."""

from __future__ import annotations

import pytest

import attngen.tiling.prefill as tiling
from attngen.build import BuildError, plan_build
from attngen.cli.explain import explain_lines, explain_one
from attngen.render import build_context
from attngen.spec import KernelKind
from attngen.tiling.alternatives import nearest_alternative
from attngen.tiling.prefill import derive_tiles
from tests.kernel_harness import make_spec


@pytest.fixture
def only_128x128_tiles(monkeypatch):
    """A grid of large tiles only, so that head dim 256 fits nowhere on sm86's 99 KiB."""
    monkeypatch.setattr(tiling, "BLOCK_M_CHOICES", (128,))
    monkeypatch.setattr(tiling, "BLOCK_N_CHOICES", (128,))
    monkeypatch.setattr(tiling, "NUM_WARPS_CHOICES", (8,))
    derive_tiles.cache_clear()
    yield
    derive_tiles.cache_clear()


def test_nearest_alternative_is_a_smaller_head_dim(only_128x128_tiles):
    spec = make_spec(dtype="bf16", head_dim=256, archs=["sm86"], name="wide")
    assert derive_tiles(spec, "sm86").chosen is None
    alternative = nearest_alternative(spec, "sm86")
    # Not 128: at D = 128 the 128x128 tile needs more registers than sm86 has (ptxas spills
    # 48-196 B there, attngen/verify/data), so the register model rejects it too.
    assert alternative.startswith("head_dim <= 64 fits (BLOCK_M=128 BLOCK_N=128")
    text = "\n".join(explain_one(spec, derive_tiles(spec, "sm86")))
    assert "no config fits this arch" in text
    assert f"nearest feasible alternative: {alternative}" in text
    with pytest.raises(BuildError, match="nearest feasible alternative: head_dim <= 64 fits"):
        plan_build([spec])


def test_no_alternative_names_what_was_tried(only_128x128_tiles, monkeypatch):
    monkeypatch.setattr(tiling, "NUM_WARPS_CHOICES", (4,))
    spec = make_spec(dtype="fp32", head_dim=256, archs=["sm86"], name="huge")
    assert nearest_alternative(spec, "sm86") == (
        "none: a smaller head dim or bf16 does not fit sm86 either"
    )


def test_explain_shows_the_whole_feasible_set_and_the_rule():
    spec = make_spec(dtype="bf16", head_dim=128, archs=["sm86"])
    derivation = derive_tiles(spec, "sm86")
    text = "\n".join(explain_one(spec, derivation))
    feasible = sum(c.feasible for c in derivation.candidates)
    assert f"feasible set ({feasible}, BLOCK_M x BLOCK_N (warps, stages)):" in text
    assert "rule: predicted not to spill first" in text and "headroom:" in text


@pytest.mark.parametrize(
    "fields, arch, expected",
    [
        (
            dict(dtype="bf16", head_dim=256),
            "sm90",
            {
                "prefill": "K/V through TMA, masked blocks by pointer loads "
                "(D > 128: the extra branch spills); "
                "heaviest causal query blocks first, in groups of 16 heads",
                "varlen": "K/V by pointer loads "
                "(varlen's packed rows would need other descriptors); "
                "one head's query blocks after another's",
            },
        ),
        (
            dict(dtype="bf16", head_dim=128),
            "sm90",
            {
                "prefill": "K/V through TMA, masked blocks too; "
                "one head's query blocks after another's"
            },
        ),
        (
            dict(dtype="bf16", head_dim=256, mask="none"),
            "sm90",
            {
                "prefill": "K/V through TMA, masked blocks by pointer loads "
                "(D > 128: the extra branch spills); one head's"
            },
        ),
        (dict(dtype="fp32", head_dim=256), "sm90", {"prefill": "K/V by pointer loads (fp32 dots"}),
        (
            dict(dtype="bf16", head_dim=256),
            "sm80",
            {"prefill": "K/V by pointer loads (no TMA on sm80)"},
        ),
    ],
)
def test_explain_names_the_code_paths_render_takes(fields, arch, expected):
    """Each kernel kind's K/V loads and program order, as in its render context."""
    spec = make_spec(archs=[arch], kernels=list(expected), **fields)
    text = "\n".join(explain_lines([spec]))
    for kind, words in expected.items():
        assert f"code paths ({kind}): {words}" in text
        context = build_context(spec, KernelKind(kind), derive_tiles(spec, arch))
        assert ("groups of 16 heads" in text.split(f"code paths ({kind}):")[1].split("\n")[0]) == (
            context["lpt_group_heads"] == 16
        )
