"""Which keys a query sees, and how far it is from each for ALiBi: the one definition of
the spec's masks and of ALiBi's distance convention, in torch.

Used by the torch fallback (attngen/runtime/fallback.py) and by the float64 oracle
(attngen/reference/), so that the kernels' tests and the runtime's fallback cannot disagree
on what a mask means, and evaluates score_mod / mask_mod on index grids (expression_values).
It lives outside attngen.runtime because importing any runtime module
runs the runtime package (the registry, the dispatcher, Triton): the oracle, which the tests,
the verifier and the tuner import, needs torch and the spec only. Not on the build path
(spec -> generated/), which imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from attngen.spec import CausalAlign, Mask
from attngen.spec.expressions import Expr, validity
from attngen.spec.expressions import Tensor as ExprTensor


def visible(
    mask: Mask | str,
    align: CausalAlign | str | None,
    window: tuple[int, int] | None,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str | None = None,
    *,
    chunk_size: int | None = None,
    sink_tokens: int | None = None,
) -> torch.Tensor | None:
    """[Nq, Nk] bool, True where query row i may see key j; None for mask none (every key).

    Positions are compared at i' = i + (Nk - Nq) under bottom_right alignment (the KV-cache
    diagonal), i' = i under top_left. causal: j <= i'. sliding_window (left, right):
    i' - left <= j <= i' + right; with sink_tokens k the first k keys ignore the left side
    (j < k and j <= i' + right: StreamingLLM's always-visible first tokens). chunked
    (chunk_size C): j <= i' and j // C == i' // C (causal inside each chunk of C aligned
    positions, Llama 4's chunked attention)."""
    if mask == Mask.none:
        return None
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    if align == CausalAlign.bottom_right:
        i = i + (seqlen_k - seqlen_q)
    if mask == Mask.causal:
        return j <= i
    if mask == Mask.chunked:
        if chunk_size is None or chunk_size < 1:
            raise ValueError(
                f"chunk_size: got {chunk_size!r}; allowed: an int >= 1 with mask chunked"
            )
        return (j <= i) & (
            torch.div(j, chunk_size, rounding_mode="floor")
            == torch.div(i, chunk_size, rounding_mode="floor")
        )
    if mask != Mask.sliding_window or window is None:
        raise ValueError(
            f"mask: got {mask!r} with window {window!r}; allowed: none, causal, "
            "sliding_window with (left, right), chunked with chunk_size"
        )
    left, right = window
    seen = (j >= i - left) & (j <= i + right)
    return seen | ((j < sink_tokens) & (j <= i + right)) if sink_tokens else seen


def alibi_distance(
    mask: Mask | str,
    align: CausalAlign | str | None,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[Nq, Nk] |i' - j|, the distance ALiBi's bias is proportional to. With a mask, i'
    follows its alignment; without one, i' = i + (Nk - Nq): bottom-right, flash-attn's
    convention (the queries are the last Nq positions of the keys' sequence)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    bottom_right = mask == Mask.none or align == CausalAlign.bottom_right
    return (i + (seqlen_k - seqlen_q if bottom_right else 0) - j).abs()


def expression_values(
    field: str,
    node: Expr,
    declared: tuple[ExprTensor, ...],
    tensors: Mapping[str, torch.Tensor],
    shape: tuple[int, int, int, int],
    score: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    first_b: int = 0,
    guarded: bool = True,
    first_q: int = 0,
) -> torch.Tensor:
    """score_mod's ([B, H, Nq, Nk] in `dtype`, from the scaled `score`) or mask_mod's (bool)
    values over every (b, h, q_idx, kv_idx) of `shape`: the checked tree evaluated on index
    grids, meaning what attngen.spec.expressions.evaluate_mod means (and the kernel computes): where
    a read it uses is out of its tensor, False (mask_mod) or -inf (score_mod). b counts from
    `first_b` (a varlen sequence compared on its own), q_idx from `first_q` (a decode step's
    queries, the last of their sequence). guarded=False: a read out of range
    gives 0 and nothing else (a derivative's tree, as the kernels load it)."""
    batch, heads, seqlen_q, seqlen_k = shape
    device = score.device if score is not None else None
    env: dict[str, Any] = {
        name: torch.arange(n, device=device).view([-1 if a == axis else 1 for a in range(4)])
        for axis, (name, n) in enumerate(zip(("b", "h", "q_idx", "kv_idx"), shape, strict=True))
    }
    env["b"] = env["b"] + first_b
    env["q_idx"] = env["q_idx"] + first_q
    env["score"] = score
    for tensor in declared:
        env[tensor.name] = tensors[tensor.name]
        for want, size in zip(tensor.shape, tensors[tensor.name].shape, strict=True):
            if isinstance(want, str):
                env[want] = torch.tensor(size, device=device)
    valid = validity(node, {t.name: t for t in declared}) if guarded else None
    values = _grid(node, env, dtype)  # on the CPU where the tree is a constant (a derivative)
    values = (values if device is None else values.to(device)).expand(
        batch, heads, seqlen_q, seqlen_k
    )
    if valid is None:
        return values
    other = torch.tensor(False if field == "mask_mod" else -math.inf, dtype=values.dtype)
    return torch.where(_grid(valid, env, dtype), values, other.to(values.device))


def _grid(node: Expr, env: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """`node` on broadcast index grids: ints int64, floats `dtype`; a read out of range gives 0
    (as evaluate's)."""
    kinds = {"int": torch.int64, "float": dtype, "bool": torch.bool}
    if node.op == "num":
        return torch.tensor(node.value, dtype=kinds[node.type])
    if node.op in ("var", "dim"):
        return env[str(node.value)].to(kinds[node.type])
    args = [_grid(a, env, dtype) for a in node.args]
    if node.op == "load":
        return _read(env[str(node.value)], args).to(kinds[node.type])
    if node.op == "where":
        return torch.where(args[0], args[1].to(kinds[node.type]), args[2].to(kinds[node.type]))
    if node.op in _FLOAT_ARGS or any(a.dtype == dtype for a in args):  # int operands widen
        args = [a.to(dtype) if a.dtype == torch.int64 else a for a in args]
    return _GRID_OPS[node.op](*args)


def _read(array: torch.Tensor, index: list[torch.Tensor]) -> torch.Tensor:
    """array[index...] on broadcast grids, 0 where an index is out of range (nothing read)."""
    index = list(torch.broadcast_tensors(*index))
    inside = torch.ones_like(index[0], dtype=torch.bool)
    for i, size in zip(index, array.shape, strict=True):
        inside = inside & (i >= 0) & (i < size)
    if array.numel() == 0:
        return torch.zeros(inside.shape, dtype=array.dtype, device=array.device)
    clamped = [i.clamp(0, size - 1) for i, size in zip(index, array.shape, strict=True)]
    values = array[tuple(clamped)]
    return torch.where(inside, values, torch.zeros((), dtype=array.dtype, device=array.device))


_FLOAT_ARGS = ("div", "exp", "log", "tanh", "sqrt")
_GRID_OPS: dict[str, Any] = {"add": torch.add, "sub": torch.sub, "mul": torch.mul}
_GRID_OPS |= {"div": torch.div, "mod": torch.remainder, "neg": torch.neg, "abs": torch.abs}
_GRID_OPS |= {"floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor")}
_GRID_OPS |= {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sqrt": torch.sqrt}
_GRID_OPS |= {"min": torch.minimum, "max": torch.maximum, "lt": torch.lt, "le": torch.le}
_GRID_OPS |= {"gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne}
_GRID_OPS |= {"and": torch.logical_and, "or": torch.logical_or, "not": torch.logical_not}
