"""attngen.flex_attention: torch's FlexAttention call, run by a module built on demand.

A call's score_mod and its block mask's mask_mod are traced (trace.py) into expression trees;
with q's dtype, the head dims, the head counts and the device's arch they state a spec
(`score_mod`, `mask_mod` and `tensors` fields: attngen.spec.expressions), whose module is built on
demand (selection.py's on-demand part, the cache of registry.py) and kept here under the
call's key (the trees' text, the tensors' declarations, the Need), then called with the
captured tensors (`tensors=`); built-in masks run built-in kernels (builtin.py). Nothing
falls back: without on-demand builds, on a device no kernel runs on, or for a function the
tracer cannot express, the call is refused, saying why; `last_dispatch()` names the module.

The block mask (attngen's or torch's): its mask_mod is traced into the spec and its block
lists go to the kernels (gradient kernels too), which visit only the listed key blocks and
skip the mask on full ones where the module's tiles divide the blocks (docs/integration.md,
"FlexAttention drop-in"); one without a mask_mod becomes a mask reading its block bitmap.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, replace
from typing import Any

import torch

from attngen.runtime import registry, selection
from attngen.runtime.arguments import needs_gradients
from attngen.runtime.dispatch import (
    device_problem,
    eager_only,
    expected_forward,
    need_for,
    problem_may_change,
    unsupported_dtype,
)
from attngen.runtime.flex.blocks import BlockMask
from attngen.runtime.flex.builtin import alibi_slopes, builtin_mask, canonical, listed, mapped
from attngen.runtime.flex.cache import traced
from attngen.runtime.flex.trace import Capture
from attngen.runtime.registry import import_verified
from attngen.runtime.selection import Dispatch, NoKernelError, record
from attngen.spec import KernelKind, Mask
from attngen.spec.expressions import Expr, Tensor, expression_key, make

API = "flex_attention"
_PLAIN: dict[str, Any] = dict(mask=Mask.none, align=None, window=None, softcap=None, alibi=False)
_modules: dict[tuple, tuple[Any, Dispatch]] = {}
_derived: dict[tuple, tuple] = {}  # _fields'
_BITMAP = object()  # a block mask without a mask_mod: its block bitmap is the mask
_BUILT_IN = "its mods are a built-in mask and softcap: the kernels skip blocks by themselves"


# torch.compile: the tracer reads the functions' code and closures and runs them on its own
# symbolic values, which Dynamo cannot trace; the call is a graph break (fullgraph=True raises).
_EAGER = "attngen.flex_attention traces its score_mod and mask_mod in Python"


@eager_only(_EAGER)
def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Any = None, block_mask: Any = None,
                   scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: Any = None, *,
                   return_aux: Any = None) -> Any:  # fmt: skip
    """torch.nn.attention.flex_attention.flex_attention's call and results: query [B, HQ, L,
    E], key [B or 1, HKV, S, E], value [B or 1, HKV, S, EV] (HQ == HKV unless enable_gqa);
    out [B, HQ, L, EV] in query's dtype, and with return_lse the log-sum-exp [B, HQ, L]
    (float32, natural log; a row that sees no key: out 0, lse -inf); return_aux
    AuxRequest(lse=True) gives (out, AuxOutput(lse=...)). kernel_options is refused (the
    module's tiling is derived), as is max_scores."""
    want_lse = _check_options(scale, enable_gqa, return_lse, kernel_options, return_aux)
    _check_tensors(query, key, value, enable_gqa)
    mask_mod = _mask_mod(block_mask, query, key)
    score, keep, mask, capture = traced(score_mod, None if mask_mod is _BITMAP else mask_mod)
    if mask_mod is _BITMAP:
        mask = _bitmap(block_mask, query.shape[0], query.shape[1], capture)
    trees = (score, keep, mask)
    result = attend(API, query, key, value, trees, capture, scale, want_lse, block_mask)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return result[0], AuxOutput(lse=result[1], max_scores=None)
    return result


def attend(
    api: str, query, key, value, trees, capture: Capture, scale, want_lse: bool, blocks=None,
    sinks=None, dropout_p: float = 0.0,
) -> Any:  # fmt: skip
    """Run the (score, keep, mask) trees of a call (keep: where the score_mod is not -inf)
    with the captured tensors on the module built for them, skipping the key blocks that the
    block mask `blocks` leaves out (see _sparsity); record the dispatch as `api`. sinks [HQ]
    fp32 and dropout_p (the transformers path's) pick a module with them."""
    fields, expressions, trained, known = _fields(trees, capture.declarations())
    values, device = {}, query.device
    for decl, tensor in capture.found.values():  # as the module reads them: Capture.values
        if tensor.device != device:
            raise ValueError(
                f"{api}: the captured tensor {decl.name} is on {tensor.device}; "
                f"allowed: query's device, {device}"
            )
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        values[decl.name] = tensor if decl.name in trained else tensor.detach()
    plain = None if trained else builtin_mask(known, query.shape[2], key.shape[2])
    plain = None if blocks is not None and plain and not canonical(blocks) else plain
    slopes = plain and alibi_slopes(known, capture.declarations(), values, query.shape[1], device)
    plain = None if plain and plain["alibi"] and slopes is None else plain  # a read past its end
    backward = bool(trained) or needs_gradients(query, key, value, sinks)
    extras = (sinks is not None, dropout_p > 0)
    found = _module(api, query, key, value, (fields, expressions, plain), backward, extras)
    module, dispatch, reasons = found
    if key.shape[0] != query.shape[0]:  # batch 1 broadcast, as torch's (a view: stride 0)
        key = key.expand(query.shape[0], *key.shape[1:])
        value = value.expand(query.shape[0], *value.shape[1:])
    sm_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    options: dict[str, Any] = {"tensors": values} if values and not plain else {}
    options |= {"alibi_slopes": slopes} if plain and slopes is not None else {}
    options |= {"sinks": sinks} if extras[0] else {}  # (a module without sinks takes none)
    options |= {"dropout_p": dropout_p} if extras[1] else {}
    options |= {"deterministic": torch.are_deterministic_algorithms_enabled()} if backward else {}
    blocks = blocks if expressions and not plain else None
    sparsity, why = _sparsity(module, blocks, query, key, backward)
    why = _BUILT_IN if plain and expressions else why
    if sparsity is not None:
        options["block_mask"] = sparsity
    result = module.attention(query, key, value, sm_scale=sm_scale, return_lse=want_lse, **options)
    if why not in reasons:  # the Dispatch with the block mask's part of the reason, kept
        reasons[why] = replace(dispatch, reason=f"{dispatch.reason}; {why}") if why else dispatch
    record(reasons[why])
    return result


def _sparsity(module, blocks, query, key, backward: bool) -> tuple[tuple | None, str]:
    """The module's `block_mask=` tuple of a BlockMask (attngen's or torch's), so the kernels
    (with `backward`, the gradient kernels too) visit only its listed key blocks; None with
    the reason where the module's block_mask_problem refuses its block sizes: then every key
    block runs with the mask per element (torch's eager meaning)."""
    if blocks is None:
        return None, ""
    q_block, kv_block = (int(size) for size in blocks.BLOCK_SIZE)
    longest = max(query.shape[2], key.shape[2])
    problem = module.block_mask_problem(q_block, kv_block, longest, backward=backward)
    if problem is not None:
        return None, f"block mask not used to skip blocks: its {problem}"
    lists = (blocks.kv_num_blocks, blocks.kv_indices)
    full = (blocks.full_kv_num_blocks, blocks.full_kv_indices)
    return (*lists, *full, q_block, kv_block), "block mask: listed key blocks only"


def _check_options(scale, enable_gqa, return_lse, kernel_options, return_aux) -> bool:
    """Whether the call returns the LSE; ValueError naming an argument outside torch's."""
    number = isinstance(scale, int | float) and not isinstance(scale, bool)
    if scale is not None and not (number and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{API}: scale: got {scale!r}; allowed: None or a finite float > 0")
    for name, flag in (("enable_gqa", enable_gqa), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise ValueError(f"{API}: {name}: got {flag!r}; allowed: True or False")
    if kernel_options is not None:
        raise ValueError(
            f"{API}: kernel_options: got {kernel_options!r}; allowed: None (the "
            "module's tiling is derived from its spec)"
        )
    if return_aux is None:
        return return_lse
    if return_lse or getattr(return_aux, "max_scores", True) or not return_aux.lse:
        raise ValueError(
            f"{API}: return_aux: got {return_aux!r} (return_lse={return_lse}); "
            "allowed: None or AuxRequest(lse=True) without return_lse"
        )
    return True


def _check_tensors(query, key, value, enable_gqa: bool) -> None:
    dtype, device = getattr(query, "dtype", None), getattr(query, "device", None)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shown = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{API}: {name}: got {shown}; allowed: a 4-D tensor [B, H, N, D]")
        if t.dtype != dtype or t.device != device:
            raise ValueError(
                f"{API}: {name}: {t.dtype} on {t.device}; allowed: query's dtype "
                f"and device, {dtype} on {device}"
            )
    (batch, heads, _, dim), (kv_batch, kv_heads, seqlen, kdim) = query.shape, key.shape
    v_batch, v_heads, v_seqlen, _ = value.shape
    if kdim != dim or v_batch != kv_batch or v_heads != kv_heads or v_seqlen != seqlen:
        raise ValueError(
            f"{API}: key {tuple(key.shape)} and value {tuple(value.shape)} with "
            f"query {tuple(query.shape)}; allowed: key [B, HKV, S, {dim}], value "
            "[B, HKV, S, EV] of the same B, HKV and S"
        )
    if kv_batch != batch and kv_batch != 1:
        raise ValueError(f"{API}: key's batch {kv_batch}; allowed: query's, {batch}, or 1")
    if kv_heads != heads and (not enable_gqa or not kv_heads or heads % kv_heads):
        allowed = f"a divisor of query's {heads} with enable_gqa" if enable_gqa else f"{heads}"
        raise ValueError(f"{API}: key's heads {kv_heads}; allowed: {allowed}")


def _mask_mod(block_mask: Any, query, key) -> Any:
    """The mask_mod of the call's block mask (its blocks checked against the call); _BITMAP
    for torch's BlockMask without one."""
    if block_mask is None:
        return None
    torch_block_mask, sliced, noop_mask = _torch_flex()
    if not isinstance(block_mask, (BlockMask, torch_block_mask)):
        raise ValueError(
            f"{API}: block_mask: got {type(block_mask).__name__}; allowed: None, "
            "attngen.create_block_mask's or torch's BlockMask"
        )
    blocks, mask_mod, shape = block_mask.kv_num_blocks, block_mask.mask_mod, query.shape
    lengths, batch, heads = block_mask.seq_lengths, blocks.shape[0], blocks.shape[1]
    if (lengths[0], lengths[1]) != (shape[2], key.shape[2]) or (batch != 1 and batch != shape[0]):
        raise ValueError(
            f"{API}: block_mask: made for shape {tuple(block_mask.shape)}; allowed: "
            f"B 1 or {shape[0]}, (Q_LEN, KV_LEN) = {(shape[2], key.shape[2])}"
        )
    if (heads != 1 and heads != shape[1]) or blocks.device != query.device:
        raise ValueError(
            f"{API}: block_mask: {heads} heads on {blocks.device}; allowed: 1 or "
            f"{shape[1]} heads, on {query.device}"
        )
    if mask_mod is sliced:
        raise ValueError(f"{API}: block_mask: a sliced BlockMask has no mask_mod to apply")
    if mask_mod is noop_mask and isinstance(block_mask, torch_block_mask):
        return _BITMAP
    return mask_mod


@functools.cache
def _torch_flex() -> tuple[Any, Any, Any]:
    """torch's BlockMask, its sliced mask's mask_mod and noop_mask (imported on first use)."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    from torch.nn.attention.flex_attention import _sliced_mask_mod_error, noop_mask

    return TorchBlockMask, _sliced_mask_mod_error, noop_mask


def _bitmap(block_mask: Any, batch: int, heads: int, capture: Capture) -> Expr:
    """A block mask without a mask_mod: blocks[b, h, q_idx // QB, kv_idx // KB], its listed
    (partial and full) blocks as a dense bool tensor built on the device."""
    rows, cols = block_mask.kv_indices.shape[-2:]
    partial, full = listed(block_mask)
    blocks = (partial | full).expand(batch, heads, rows, cols)
    decl = capture.declare(blocks, None, "block_mask")
    qb, kb = block_mask.BLOCK_SIZE
    index = [Expr("var", (), n, "int") for n in ("b", "h", "q_idx", "kv_idx")]
    index[2:] = [
        make("mask_mod", "floordiv", (i, Expr("num", (), s, "int")))
        for i, s in zip(index[2:], (qb, kb), strict=True)
    ]
    return Expr("load", tuple(index), decl.name, "bool")


def _fields(trees: tuple, decls: tuple[Tensor, ...]) -> tuple[dict[str, Any], str, set, tuple]:
    """The spec's score_mod, mask_mod and tensors fields of a call's trees, their
    expression_key, the trainable tensors' names (those that require grad and that score_mod
    reads: none flows through a bool) and builtin.mapped's answer; kept per trees (the trace
    cache's objects on every hit)."""
    (score, keep, mask), parts = trees, (*trees, *decls)
    kept = _derived.get(tuple(map(id, parts)))  # parts kept alive there: the same objects
    if kept is not None:
        return kept[1]
    mask = keep if mask is None else mask if keep is None else make("mask_mod", "and", (mask, keep))
    score = None if score is not None and str(score) == "score" else score  # torch's _identity
    mask = None if mask is not None and mask.op == "num" and mask.value is True else mask
    fields: dict[str, Any] = {"score_mod": None if score is None else str(score)}
    fields |= {"mask_mod": None if mask is None else str(mask)}
    scored = set() if score is None else {n.value for n in score.nodes() if n.op == "load"}
    decls = tuple(replace(d, trainable=d.trainable and d.name in scored) for d in decls)
    fields |= {"tensors": [asdict(d) | {"shape": list(d.shape)} for d in decls]}
    if len(_derived) >= 256:
        _derived.clear()
    trained = {d.name for d in decls if d.trainable}
    derived = (fields, expression_key(fields), trained, mapped(trees))
    _derived[tuple(map(id, parts))] = (parts, derived)
    return derived


def _module(api: str, query, key, value, mods: tuple, backward, extras):
    """(module, Dispatch, the Dispatches recorded with each block-mask reason) of the call
    whose mods are (spec fields, their expression_key, builtin_mask's answer or None):
    from the route cache of the registry in use (selection.routes: keyed by what decides the
    Need, so a repeated call asks no Need, settings or device question, but bf16 under the
    interpreter's, whose answer may change), else kept per call key and the settings, built
    on demand on a first call (with gradient kernels when the call needs gradients; extras:
    whether it has sinks, dropout). configure() reloads the registry: routes start over."""
    fields, expressions, plain = mods
    route: tuple = (API, api, expressions, query.dtype, query.device, query.shape, key.shape)
    route += (value.shape, backward, extras, plain is None)
    table = selection.routes(registry.current_registry())
    hit = table.get(route)
    if hit is not None and (hit[3] is None or device_problem(*hit[3]) is None):
        return hit[:3]
    lq, lk = query.shape[2], key.shape[2]
    sizes = dict(seqlen_q=lq, seqlen_k=lk, same_lengths=lq == lk, backward=backward)
    sizes |= dict(sinks=extras[0], dropout=extras[1])
    need = need_for(KernelKind.prefill, query, value, **(plain or _PLAIN), **sizes)
    why = unsupported_dtype(query) if need.dtype is None else None
    why = why or device_problem(API, need.arch, need.dtype)
    settings = registry.settings()
    if why is None and not settings.on_demand:
        why = "its modules are built on demand, and on-demand builds are off "
        why += f"(attngen.configure(on_demand=False) or {registry.ENV_ON_DEMAND}=0)"
    if why is not None:
        who = f"attngen.{API}" if api == API else f"attngen ({api}: the model's mask function)"
        raise NoKernelError(f"{who}: {why}")
    need = need._replace(expressions="" if plain else expressions)
    heads = (query.shape[1], key.shape[1])
    call_key = (need._replace(seqlen_q=0, seqlen_k=0, same_lengths=False), heads, settings)
    hit = _modules.get(call_key)
    if hit is None:
        module, dispatch = _build(need, heads, fields)
        _modules[call_key] = (module, _reused(dispatch))
        return module, replace(dispatch, api=api), {}  # the first call's record: built now
    check = (API, need.arch, need.dtype) if problem_may_change(need.arch, need.dtype) else None
    planned: tuple = (hit[0], replace(hit[1], need=need, api=api), {}, check)
    selection.keep(registry.current_registry(), route, planned)
    return planned[:3]


def _build(need, heads, fields: dict[str, Any]) -> tuple[Any, Dispatch]:
    from attngen.build import BuildError

    try:
        spec, kind, arch = selection.spec_for(need, heads, fields if need.expressions else None)
        entry, built = selection.cached_module(spec, kind, arch)
    except (selection.NotExpressible, BuildError) as exc:
        raise NoKernelError(f"attngen.{API}: no module can be built: {exc}") from None
    module = import_verified(entry)
    how = "built on demand now" if built else "found in the on-demand cache"
    reason = f"{entry.describe()} {how} ({entry.key}) for score_mod {fields['score_mod']}, "
    reason += f"mask_mod {fields['mask_mod']}"
    forward = expected_forward(module)
    dispatch = Dispatch(API, need, entry.describe(), entry.key, reason, source="cache")
    return module, replace(dispatch, built=built, forward=forward)


def _reused(dispatch: Dispatch) -> Dispatch:
    """The record later calls of a key leave: they did not build the module."""
    reason = dispatch.reason.replace("built on demand now", "built on demand earlier")
    return replace(dispatch, built=False, reason=reason)
