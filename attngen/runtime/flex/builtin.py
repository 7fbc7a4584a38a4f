"""Flex mods that are built-in masks: a mask_mod bounding q_idx - kv_idx by constants (causal,
windows) and a score_mod `C * tanh(score / C)` run on the built-in kernels, which skip blocks
by themselves (Hopper's warp-specialized ones included). Anything else stays an expression."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from attngen.runtime.arguments import INFINITE
from attngen.runtime.flex.blocks import create_block_mask
from attngen.spec import CausalAlign, Mask
from attngen.spec.expressions import Expr

Linear = tuple[int, int, int] | None  # (q_idx's, kv_idx's coefficient, constant) of a sum
_FLIP = {"ge": "le", "le": "ge", "gt": "lt", "lt": "gt"}
_KNOWN: dict[tuple, tuple] = {}  # builtin_mask's answers by the trees' ids: (trees, answer)
_CHECKED: dict[int, tuple] = {}  # canonical()'s answers by id: (weakref, versions, answer)


def _linear(node: Expr) -> Linear:
    if node.op == "num" and isinstance(node.value, int) and not isinstance(node.value, bool):
        return 0, 0, node.value
    if node.op == "var" and node.value in ("q_idx", "kv_idx"):
        return (1, 0, 0) if node.value == "q_idx" else (0, 1, 0)
    parts = [_linear(a) for a in node.args]
    if node.op == "neg" and parts[0] is not None:
        q, kv, c = parts[0]
        return -q, -kv, -c
    if node.op in ("add", "sub") and parts[0] is not None and parts[1] is not None:
        sign = 1 if node.op == "add" else -1
        (q1, kv1, c1), (q2, kv2, c2) = parts[0], parts[1]
        return q1 + sign * q2, kv1 + sign * kv2, c1 + sign * c2
    return None


def _bounds(node: Expr) -> tuple[float, float] | None:
    """(lowest, highest) q_idx - kv_idx that `node` keeps, where it is a conjunction of
    comparisons of integer sums that bound that difference alone; else None."""
    if node.op == "and":
        sides = [side for side in map(_bounds, node.args) if side is not None]
        if len(sides) != len(node.args):
            return None
        return max(low for low, _ in sides), min(high for _, high in sides)
    if node.op not in _FLIP:
        return None
    left, right = (_linear(a) for a in node.args)
    if left is None or right is None:
        return None
    a, b, c = (x - y for x, y in zip(left, right, strict=True))  # a q + b kv + c op 0
    if a == 0 or a != -b:
        return None
    op = node.op if a > 0 else _FLIP[node.op]  # d op -c / a, d = q_idx - kv_idx
    bound = -c / a
    if op in ("ge", "gt"):
        return float(math.floor(bound) + 1 if op == "gt" else math.ceil(bound)), math.inf
    return -math.inf, float(math.ceil(bound) - 1 if op == "lt" else math.floor(bound))


def _softcap(score: Expr | None) -> float | None:
    """C of `C * tanh(score / C)` (either operand order, C > 0), 0.0 for no score_mod."""
    if score is None:
        return 0.0
    for cap in (a.value for a in score.args if a.op == "num" and isinstance(a.value, float)):
        forms = (f"({cap!r} * tanh((score / {cap!r})))", f"(tanh((score / {cap!r})) * {cap!r})")
        if str(score) in forms and 0 < cap < math.inf:  # the normalized text: one per tree
            return cap
    return None


def builtin_mask(trees: tuple, lq: int, lk: int) -> dict[str, Any] | None:
    """need_for's mask, align, window, softcap and alibi for the call's (score, keep, mask)
    trees where they are built-in ones; None otherwise. Top-left alignment (torch's indices),
    and only where every query row keeps a key (the diagonal, or key 0 when the window has no
    left edge), so no row meets the built-in kernels' and Flex's different answers for a row
    that sees nothing. Kept per trees (the trace cache's objects on every hit)."""
    known = _KNOWN.get(tuple(map(id, trees)))
    if known is None or any(a is not b for a, b in zip(known[0], trees, strict=True)):
        if len(_KNOWN) >= 256:
            _KNOWN.clear()
        known = _KNOWN[tuple(map(id, trees))] = (trees, _mapped(*trees))
    plain = known[1]
    bounded = plain is not None and plain["window"] is not None and plain["window"][0] < INFINITE
    return None if plain is None or (lq > lk and bounded) else plain


def _mapped(score: Expr | None, keep: Expr | None, mask: Expr | None) -> dict[str, Any] | None:
    score = None if score is not None and str(score) == "score" else score  # torch's _identity
    mask = None if mask is not None and str(mask) == "True" else mask
    softcap = _softcap(score)
    if keep is not None or softcap is None:
        return None
    low, high = (-math.inf, math.inf) if mask is None else _bounds(mask) or (1, 0)
    if not low <= 0 <= high:
        return None
    found: dict[str, Any] = dict(softcap=softcap or None, alibi=False)
    if low == -math.inf and high == math.inf:
        return found | dict(mask=Mask.none, align=None, window=None)
    if low == 0 and high == math.inf:
        return found | dict(mask=Mask.causal, align=CausalAlign.top_left, window=None)
    sides = (INFINITE if abs(s) == math.inf else int(abs(s)) for s in (high, low))
    return found | dict(mask=Mask.sliding_window, align=CausalAlign.top_left, window=tuple(sides))


def canonical(block_mask: Any) -> bool:
    """Whether a BlockMask lists exactly the blocks create_block_mask makes of its mask_mod, so
    that the built-in mask computes Flex's answer (where a block list was edited, Flex lets the
    lists win over mask_mod: such calls keep the expression path). Checked once per BlockMask
    and version of its tensors (a device sync then), kept while the tensors live."""
    lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
             block_mask.full_kv_indices)  # fmt: skip
    counts, versions = lists[0], tuple(getattr(t, "_version", -1) for t in lists)
    known = _CHECKED.get(id(counts))
    if known is None or known[0]() is not counts or known[1] != versions:
        (batch, heads), (q_len, kv_len) = counts.shape[:2], block_mask.seq_lengths
        made = (batch, heads, q_len, kv_len, counts.device, tuple(block_mask.BLOCK_SIZE))
        fresh = create_block_mask(block_mask.mask_mod, *made)
        same = all(map(torch.equal, listed(block_mask), listed(fresh)))
        if len(_CHECKED) >= 256:
            _CHECKED.clear()
        known = _CHECKED[id(counts)] = (weakref.ref(counts), versions, same)
    return known[2]


def listed(block_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The (partial, full) blocks a BlockMask lists, as dense bool [B, H, rows, cols]."""
    cols, found = block_mask.kv_indices.shape[-1], list[torch.Tensor]()
    for num, indices in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                         (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):  # fmt: skip
        if num is None:
            found.append(torch.zeros_like(found[0]))
            continue
        kept = torch.arange(cols, device=num.device) < num[..., None]
        where = torch.where(kept, indices.long(), cols)
        dense = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.bool, device=num.device)
        found.append(dense.scatter(-1, where, True)[..., :cols])
    return found[0], found[1]
