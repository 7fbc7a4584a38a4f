"""Block masks: which (query block, key block) tiles a mask_mod leaves empty, partial or full.

`create_block_mask` has torch's signature and result (the same kv_num_blocks, kv_indices,
full_kv_num_blocks, full_kv_indices for every mask function; tests/test_flex_blocks.py
checks it against torch's own). The mask_mod is traced once (trace.py) and its tree evaluated
vectorized in torch (`evaluate`) over index grids of a few query block rows of several
(b, h) at a time (at most CHUNK_ELEMENTS elements per step), on the device, without reading
anything back to the host; positions past Q_LEN and KV_LEN count as masked (torch pads so).
"""

from __future__ import annotations

from typing import Any

import torch

from attngen.runtime.flex.trace import Capture, trace
from attngen.spec.expressions import Expr, Tensor, validity

CHUNK_ELEMENTS = 1 << 22
_FLOAT = torch.float32  # the kernels' and torch's eager working precision
_TORCH_OPS: dict[str, Any] = {"add": torch.add, "sub": torch.sub, "mul": torch.mul}
_TORCH_OPS |= {"div": torch.div, "mod": torch.remainder, "min": torch.minimum}
_TORCH_OPS |= {"max": torch.maximum, "abs": torch.abs, "exp": torch.exp, "log": torch.log}
_TORCH_OPS |= {"sqrt": torch.sqrt, "tanh": torch.tanh, "neg": torch.neg, "lt": torch.lt}
_TORCH_OPS |= {"le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne}
_TORCH_OPS |= {"and": torch.logical_and, "or": torch.logical_or, "not": torch.logical_not}
_TORCH_OPS |= {"where": torch.where}
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_TORCH_OPS |= {"floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor")}


def evaluate(node: Expr, env: dict[str, Any], device: torch.device) -> torch.Tensor:
    """`node` over torch index grids: `env` maps b, h, q_idx, kv_idx (broadcastable int64
    tensors), each tensor name to its tensor and each dim name to its size. Reads are
    clamped into their tensor (evaluate the validity tree as well: `evaluate_mod`)."""
    if node.op == "num":
        dtype = {"int": torch.int64, "float": _FLOAT, "bool": torch.bool}[node.type]
        return torch.full((), node.value, dtype=dtype, device=device)  # type: ignore[arg-type]
    if node.op in ("var", "dim"):
        value = env[str(node.value)]
        return value if isinstance(value, torch.Tensor) else torch.full((), value, device=device)
    args = [evaluate(a, env, device) for a in node.args]
    if node.op == "load":
        tensor = env[str(node.value)]
        index = tuple(i.clamp(0, n - 1) for i, n in zip(args, tensor.shape, strict=True))
        value = tensor[index]
        return value.to(_FLOAT) if value.is_floating_point() else value
    if node.type == "float" or node.op in ("div", "exp", "log", "tanh", "sqrt"):
        first = 1 if node.op == "where" else 0
        args = args[:first] + [a.to(_FLOAT) for a in args[first:]]
    elif node.op in ("lt", "le", "gt", "ge", "eq", "ne") and any(
        a.is_floating_point() for a in args
    ):
        args = [a.to(_FLOAT) for a in args]
    return _TORCH_OPS[node.op](*args)


def evaluate_mod(field: str, node: Expr, env: dict[str, Any], tensors: tuple[Tensor, ...]):
    """What the kernel computes (expressions.evaluate_mod, vectorized): False (mask_mod) or
    -inf (score_mod) where a read is out of range."""
    device = env["q_idx"].device
    value = evaluate(node, env, device)
    valid = validity(node, {t.name: t for t in tensors})
    if valid is None:
        return value
    ok = evaluate(valid, env, device)
    return ok & value if field == "mask_mod" else torch.where(ok, value, float("-inf"))


def tensor_env(tensors: tuple[Tensor, ...], values: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The env entries of captured tensors: each tensor and its named dims' sizes."""
    env: dict[str, Any] = dict(values)
    for decl in tensors:
        env |= {str(n): size for n, size in zip(decl.shape, values[decl.name].shape, strict=True)}
    return env


class BlockMask:
    """attngen's block mask, with torch's BlockMask fields: kv_num_blocks [B, H, Q blocks]
    (int32) and kv_indices [B, H, Q blocks, KV blocks] (int32) for the partial blocks (the
    mask_mod is evaluated in them), full_kv_num_blocks and full_kv_indices for the full ones
    (every element kept), BLOCK_SIZE (Q, KV), seq_lengths (Q_LEN, KV_LEN), the mask_mod, its
    traced tree `expr` (None: no mask) and its captured `tensors` (declarations)."""

    def __init__(
        self,
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE,
        seq_lengths,
        mask_mod,
        expr,
        tensors,
    ):
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.BLOCK_SIZE, self.seq_lengths = BLOCK_SIZE, seq_lengths
        self.mask_mod, self.expr, self.tensors = mask_mod, expr, tensors

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.kv_indices.shape[:2], *self.seq_lengths)

    def __repr__(self) -> str:
        size = self.BLOCK_SIZE
        return f"attngen.BlockMask(shape={self.shape}, BLOCK_SIZE={size}, mask_mod={self.expr})"


def _positive(name: str, value: Any, none_ok: bool = False) -> int:
    if value is None and none_ok:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "None (broadcast) or an int >= 1" if none_ok else "an int >= 1"
        raise ValueError(f"create_block_mask: {name}: got {value!r}; allowed: {allowed}")
    return value


def create_block_mask(
    mask_mod: Any,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    _compile: bool = False,
) -> BlockMask:
    """torch.nn.attention.flex_attention.create_block_mask's signature and result (B or H
    None: 1, broadcast over the batch or heads; device None: the current accelerator, else
    the CPU). `_compile` is accepted for old callers and changes nothing (nothing here is
    compiled)."""
    batch, heads = _positive("B", B, True), _positive("H", H, True)
    q_len, kv_len = _positive("Q_LEN", Q_LEN), _positive("KV_LEN", KV_LEN)
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    if not isinstance(sizes, tuple) or len(sizes) != 2:
        raise ValueError(
            f"create_block_mask: BLOCK_SIZE: got {BLOCK_SIZE!r}; allowed: an int "
            ">= 1 or a pair (Q_BLOCK_SIZE, KV_BLOCK_SIZE)"
        )
    qb, kb = (_positive("BLOCK_SIZE", s) for s in sizes)
    if device is None:
        device = torch.accelerator.current_accelerator() or "cpu"
    device = torch.device(device)
    if device.index is None and device.type != "cpu":  # "cuda": the current one, as torch's
        device = torch.empty(0, device=device).device
    capture = Capture()
    expr, _ = trace(mask_mod, "mask_mod", capture)
    values = capture.values()
    for name, tensor in values.items():
        if tensor.device != device:
            raise ValueError(
                f"create_block_mask: mask_mod reads {name} on {tensor.device}; "
                f"allowed: tensors on the device asked for, {device}"
            )
    env = tensor_env(capture.declarations(), values)
    rows, cols = -(-q_len // qb), -(-kv_len // kb)
    counts = _block_counts(expr, capture, env, (batch, heads, q_len, kv_len), (qb, kb), device)
    counts = counts.view(batch, heads, rows, cols)
    partial = _ordered((counts > 0) & (counts < qb * kb))
    full = _ordered(counts == qb * kb)
    return BlockMask(
        *partial, *full, (qb, kb), (q_len, kv_len), mask_mod, expr, capture.declarations()
    )


def _block_counts(expr, capture, env, shape, block, device) -> torch.Tensor:
    """Kept elements per (b*h, query block, key block), int32, in chunks of rows and (b, h)."""
    batch, heads, q_len, kv_len = shape
    qb, kb = block
    rows, cols = -(-q_len // qb), -(-kv_len // kb)
    out = torch.empty(batch * heads, rows, cols, dtype=torch.int32, device=device)
    step = max(1, min(rows, CHUNK_ELEMENTS // (qb * cols * kb)))
    pairs = max(1, min(batch * heads, CHUNK_ELEMENTS // (step * qb * cols * kb)))
    kv = torch.arange(cols * kb, device=device)
    for first in range(0, batch * heads, pairs):
        bh = torch.arange(first, min(first + pairs, batch * heads), device=device)
        for row in range(0, rows, step):
            q = torch.arange(row * qb, min(row + step, rows) * qb, device=device)
            grid = {"b": (bh // heads)[:, None, None], "h": (bh % heads)[:, None, None]}
            grid |= {"q_idx": q[None, :, None], "kv_idx": kv[None, None, :]}
            keep = (q[:, None] < q_len) & (kv[None, :] < kv_len)
            if expr is not None:
                keep = keep & evaluate_mod("mask_mod", expr, env | grid, capture.declarations())
            keep = keep.expand(len(bh), len(q), len(kv)).reshape(len(bh), -1, qb, cols, kb)
            out[first : first + len(bh), row : row + keep.shape[1]] = keep.sum((2, 4))
    return out


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, indices) of a dense block bitmap, as torch's _dense_to_ordered: the
    blocks in order first, then the others (a stable descending sort)."""
    dense = dense.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1).to(torch.int32), indices.to(torch.int32)
