"""Flex mods that are built-in: a mask_mod bounding q_idx - kv_idx by constants (causal, windows),
a score_mod `C * tanh(score / C)` or adding an ALiBi slope read per head run on the built-in
kernels, which skip blocks by themselves (warp-specialized on Hopper); the rest, expressions."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from attngen.runtime.arguments import INFINITE
from attngen.runtime.flex.blocks import create_block_mask, evaluate, tensor_env
from attngen.spec import CausalAlign, Mask
from attngen.spec.expressions import Expr, Tensor

_FLIP = {"ge": "le", "le": "ge", "gt": "lt", "lt": "gt"}
_CHECKED: dict[int, tuple] = {}  # canonical()'s answers by id: (weakref, versions, answer)


def _linear(node: Expr) -> tuple[int, int, int] | None:  # q_idx's, kv_idx's factor, constant
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
        every = len(sides) == len(node.args)
        return (max(low for low, _ in sides), min(high for _, high in sides)) if every else None
    if node.op not in _FLIP:
        return None
    left, right = (_linear(a) for a in node.args)
    a, b, c = (x - y for x, y in zip(left, right, strict=True)) if left and right else (0, 0, 0)
    if a == 0 or a != -b:  # a q + b kv + c op 0 bounds q_idx - kv_idx alone only where b == -a
        return None
    op = node.op if a > 0 else _FLIP[node.op]  # d op -c / a, d = q_idx - kv_idx
    bound = -c / a
    if op in ("ge", "gt"):
        return float(math.floor(bound) + 1 if op == "gt" else math.ceil(bound)), math.inf
    return -math.inf, float(math.ceil(bound) - 1 if op == "lt" else math.floor(bound))


def _softcap(score: Expr) -> float | None:
    """C of `C * tanh(score / C)` (either operand order, a float C > 0), else None."""
    for cap in (a.value for a in score.args if a.op == "num" and isinstance(a.value, float)):
        forms = (f"({cap!r} * tanh((score / {cap!r})))", f"(tanh((score / {cap!r})) * {cap!r})")
        if str(score) in forms and 0 < cap < math.inf:  # the normalized text: one per tree
            return cap
    return None


def builtin_mask(known: tuple, lq: int, lk: int) -> dict[str, Any] | None:
    """need_for's mask, align, window, softcap and alibi of a call whose trees `mapped` gave
    `known`, where they are built-in ones, else None; top-left (torch's indices), only where
    each query row keeps a key (Flex and the built-in kernels differ on a row that sees none),
    ALiBi (flash-attn's: bottom-right) only at Nq == Nk."""
    plain = known[0]
    if plain is None or (plain["alibi"] and lq != lk):
        return None
    return None if lq > lk and plain["window"] and plain["window"][0] < INFINITE else plain


def mapped(trees: tuple) -> tuple:
    """(need_for's fields or None, the ALiBi slope, slopes made of it) of a call's trees."""
    return (*_mapped(*trees), {})


def _mapped(score: Expr | None, keep: Expr | None, mask: Expr | None) -> tuple:
    score = None if score is not None and str(score) == "score" else score  # torch's _identity
    mask = None if mask is not None and str(mask) == "True" else mask
    softcap = 0.0 if score is None else _softcap(score)
    slope = None if score is None or softcap is not None else _alibi(score)
    low, high = (-math.inf, math.inf) if mask is None else _bounds(mask) or (1, 0)
    refused = keep is not None or (softcap is None and slope is None) or not low <= 0 <= high
    if refused or (slope is not None and low < 0):  # ALiBi's -slope |i - j|: keys <= query
        return None, None
    found: dict[str, Any] = dict(softcap=softcap or None, alibi=slope is not None)
    if low == -math.inf and high == math.inf:
        return found | dict(mask=Mask.none, align=None, window=None), slope
    if low == 0 and high == math.inf:
        return found | dict(mask=Mask.causal, align=CausalAlign.top_left, window=None), slope
    window = tuple(INFINITE if abs(s) == math.inf else int(abs(s)) for s in (high, low))
    return found | dict(mask=Mask.sliding_window, align=CausalAlign.top_left, window=window), slope


def _alibi(score: Expr) -> Expr | None:
    """X of `score + X * (kv_idx - q_idx)` or `score - X * (q_idx - kv_idx)` (either factor
    first) where X reads nothing but h (constants, tensors indexed by h): the ALiBi slope."""
    if score.op not in ("add", "sub") or str(score.args[0]) != "score":
        return None
    want = (-1, 1, 0) if score.op == "add" else (1, -1, 0)
    product = score.args[1]
    for slope, distance in (product.args, product.args[::-1]) if product.op == "mul" else ():
        if _linear(distance) == want and {n.value for n in slope.nodes() if n.op == "var"} <= {"h"}:
            return slope
    return None


def alibi_slopes(known: tuple, decls: tuple[Tensor, ...], values: dict, heads: int, device):
    """The [heads] fp32 slopes of a call builtin_mask found ALiBi in (kept when they read no
    tensor); None where a read is not T[h] of at least `heads` entries (Flex masks past it)."""
    _, slope, made = known
    loads = [] if slope is None else [n for n in slope.nodes() if n.op == "load"]
    past = any([str(a) for a in n.args] != ["h"] or len(values[n.value]) < heads for n in loads)
    if slope is None or past:
        return None
    table = values[slope.value] if loads == [slope] else None  # the captured slopes themselves
    if table is not None and table.dtype == torch.float32 and table.stride(0) == 1:
        return table[:heads]  # a view: no launch
    if (heads, device) in made:
        return made[(heads, device)]
    env = tensor_env(decls, values) | {"h": torch.arange(heads, device=device)}
    slopes = evaluate(slope, env, device).to(torch.float32).expand(heads).contiguous()
    if not loads:  # a function of h alone: the same slopes at every call
        made[(heads, device)] = slopes
    return slopes


def canonical(block_mask: Any) -> bool:
    """Whether a BlockMask lists exactly the blocks create_block_mask makes of its mask_mod (an
    edited list wins over mask_mod in Flex: the expression path keeps that), checked once per
    BlockMask and version of its tensors (a device sync then)."""
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
