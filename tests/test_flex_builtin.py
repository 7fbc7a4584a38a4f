"""Flex mods recognised as attngen's built-in masks (attngen/runtime/flex/builtin.py): which
traced mask_mods and score_mods map to the built-in causal mask, windows and softcap, which
stay expressions, and the block-list check that keeps Flex's meaning where a BlockMask's
lists were edited. Results against torch's flex_attention: tests/test_flex_api.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

import attngen
from attngen.runtime import last_dispatch
from attngen.runtime.arguments import INFINITE
from attngen.runtime.flex.builtin import builtin_mask, canonical, mapped
from attngen.runtime.flex.cache import traced
from attngen.spec import CausalAlign, Mask
from tests.ondemand_harness import on_demand  # noqa: F401 - a fixture
from tests.test_flex_api import _check

CAUSAL = dict(mask=Mask.causal, window=None)


def _window(left: int, right: int) -> dict:
    return dict(mask=Mask.sliding_window, window=(left, right))


MASKS = [
    (lambda b, h, q, kv: q >= kv, CAUSAL),
    (lambda b, h, q, kv: kv <= q, CAUSAL),
    (lambda b, h, q, kv: q + 2 >= kv + 2, CAUSAL),
    (
        lambda b, h, q, kv: (q >= kv) & (q - kv <= 64),
        _window(64, 0),
    ),
    (lambda b, h, q, kv: (q >= kv) & (q - kv < 64), _window(63, 0)),
    (
        lambda b, h, q, kv: (q - kv <= 9) & (kv - q <= 3),
        _window(9, 3),
    ),
    (lambda b, h, q, kv: kv - q <= 3, _window(INFINITE, 3)),
    (lambda b, h, q, kv: q > kv, None),  # row 0 sees nothing
    (lambda b, h, q, kv: (kv < 64) | (q >= kv), None),  # prefix-LM
    (lambda b, h, q, kv: 2 * q >= 2 * kv, None),  # not a sum of q_idx and kv_idx
    (lambda b, h, q, kv: (q >= kv) & (h == 0), None),
]


@pytest.mark.parametrize(("mask_mod", "expected"), MASKS)
def test_masks_that_bound_the_diagonal_distance_are_built_in(mask_mod, expected) -> None:
    score, keep, mask, _ = traced(None, mask_mod)
    found = builtin_mask(mapped((score, keep, mask)), 256, 256)
    if expected is None:
        assert found is None, str(mask)
        return
    assert found is not None, str(mask)
    assert found == dict(align=CausalAlign.top_left, alibi=False, softcap=None, **expected)


@pytest.mark.parametrize(
    ("score_mod", "cap"),
    [
        (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), 30.0),
        (lambda s, b, h, q, kv: torch.tanh(s / 2.5) * 2.5, 2.5),
        (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 20.0), None),
        (lambda s, b, h, q, kv: -3.0 * torch.tanh(s / -3.0), None),
        (lambda s, b, h, q, kv: s * 2.0, None),
        (lambda s, b, h, q, kv: s, 0.0),  # torch's identity: no score_mod
    ],
)
def test_a_softcap_score_mod_is_the_built_in_softcap(score_mod, cap) -> None:
    score, keep, mask, _ = traced(score_mod, lambda b, h, q, kv: q >= kv)
    found = builtin_mask(mapped((score, keep, mask)), 64, 64)
    assert (found is None) == (cap is None), str(score)
    assert found is None or found["softcap"] == (cap or None)


def test_a_window_with_rows_past_the_keys_stays_an_expression() -> None:
    """More queries than keys (top-left): a window leaves late rows without a key, where Flex
    and the built-in kernels answer differently; causal keeps key 0 for every row."""
    window = mapped(traced(None, lambda b, h, q, kv: (q >= kv) & (q - kv <= 8))[:3])
    causal = mapped(traced(None, lambda b, h, q, kv: q >= kv)[:3])
    assert builtin_mask(window, 64, 32) is None and builtin_mask(window, 32, 64) is not None
    assert builtin_mask(causal, 64, 32) == dict(
        mask=Mask.causal, align=CausalAlign.top_left, alibi=False, softcap=None, window=None
    )


def test_edited_block_lists_are_not_canonical() -> None:
    """torch's and attngen's create_block_mask list the same blocks; an edited list (Flex then
    follows the lists, not mask_mod) is seen, also after an earlier check of the same mask."""

    def causal(b, h, q, kv):
        return q >= kv

    for made in (torch_block_mask, attngen.create_block_mask):
        blocks = made(causal, 2, None, 256, 256, "cpu", BLOCK_SIZE=64)
        assert canonical(blocks) and canonical(blocks)
        blocks.kv_num_blocks[1, 0, 3] -= 1
        assert not canonical(blocks)


def test_a_torch_causal_block_mask_runs_the_built_in_kernels(on_demand) -> None:  # noqa: F811
    """The same answer as torch's flex_attention (test_flex_api.py's rule), on the built-in
    causal module, with the dispatch saying why."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 48, 16) for _ in range(3))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    blocks = torch_block_mask(causal, 2, None, 48, 48, "cpu", BLOCK_SIZE=16)
    out, lse = attngen.flex_attention(q, k, v, block_mask=blocks, return_lse=True)
    assert "a built-in mask" in last_dispatch().reason and "_causal" in last_dispatch().module
    _check(out, lse, q, k, v, None, causal)


def test_the_backward_is_deterministic_as_torch_is_asked(on_demand, monkeypatch) -> None:  # noqa: F811
    """As SDPA and the transformers function: dQ by atomics (deterministic=False, flash-attn's
    default) unless torch.use_deterministic_algorithms(True)."""
    from attngen.runtime.flex import attention as flex

    q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))
    attngen.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5)
    module = next(m for m, d in flex._modules.values() if d.key == last_dispatch().key)
    seen: list[dict] = []
    attention = module.attention

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return attention(*args, **kwargs)

    monkeypatch.setattr(module, "attention", recording)
    attngen.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5).sum().backward()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        attngen.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert [kw.get("deterministic") for kw in seen] == [False, True]
    assert q.grad is not None and q.grad.abs().sum() > 0


def _gym_alibi(heads: int):
    def alibi(score, b, h, q_idx, kv_idx):  # attention-gym's: the slope a function of h
        return score + (kv_idx - q_idx) * torch.exp2(-((h + 1) * 8.0 / heads))

    return alibi


@pytest.mark.parametrize("form", ["gym", "captured", "subtracted"])
def test_alibi_score_mods_under_a_causal_mask_run_the_built_in_alibi(on_demand, form) -> None:  # noqa: F811
    """The slope read per head (a function of h, or a captured tensor indexed by h) under a
    causal mask at Nq == Nk is flash-attn's ALiBi; the same answer as torch's flex_attention."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, 48, 16) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    score_mod = {
        "gym": _gym_alibi(4),
        "captured": lambda s, b, h, i, j: s + slopes[h] * (j - i),
        "subtracted": lambda s, b, h, i, j: s - slopes[h] * (i - j),
    }[form]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    blocks = attngen.create_block_mask(causal, 2, None, 48, 48, "cpu", BLOCK_SIZE=16)
    out, lse = attngen.flex_attention(q, k, v, score_mod, blocks, return_lse=True)
    assert "a built-in mask" in last_dispatch().reason and "_alibi" in last_dispatch().module
    _check(out, lse, q, k, v, score_mod, causal)


def test_alibi_without_a_causal_mask_or_past_its_table_stays_an_expression(on_demand) -> None:  # noqa: F811
    """flash-attn's ALiBi is -slope |i - j|: without the causal mask the score_mod's
    slope (j - i) differs on later keys; a table shorter than the heads reads past its end
    (a masked key in Flex's meaning); learned slopes need their gradient: all keep the
    expression kernels."""
    q, k, v = (torch.randn(1, 4, 32, 16) for _ in range(3))
    attngen.flex_attention(q, k, v, _gym_alibi(4))
    assert "a built-in mask" not in last_dispatch().reason
    short = torch.tensor([0.5, 0.25])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    blocks = attngen.create_block_mask(causal, 1, None, 32, 32, "cpu", BLOCK_SIZE=16)
    attngen.flex_attention(q, k, v, lambda s, b, h, i, j: s + short[h] * (j - i), blocks)
    assert "a built-in mask" not in last_dispatch().reason
    learned = torch.full((4,), 0.25, requires_grad=True)  # its gradient: the expression path's
    attngen.flex_attention(q, k, v, lambda s, b, h, i, j: s + learned[h] * (j - i), blocks)
    assert "a built-in mask" not in last_dispatch().reason
