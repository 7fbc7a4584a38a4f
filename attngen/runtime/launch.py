"""From a call's tensors to a kernel run: the Need, dispatch, then the module (ops.py) or the
torch fallback. The public functions (api.py, kvcache.py, hf.py) and context parallelism
(attngen/distributed) run every kernel through `run_dense` and `run_varlen`; context
parallelism's backward runs the gradient kernels of each chunk pair through
`run_dense_backward`.

A caller that wants flash-attn's [B, N, H, D] output sets the Call's heads_last: a module
that takes `out=` (every rendered one) writes that layout through `attention_flash_out`;
a stand-in's [B, H, N, D] output is copied. With dropout_p > 0 the call's Philox state is
drawn here (arguments.dropout_rng_state) for the module's forward and, through the op's
formula, its backward (so such a call leaves no plan); `deterministic` goes the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from attngen.runtime import ops, plans
from attngen.runtime.arguments import (
    dropout_probability,
    dropout_rng_state,
    needs_gradients,
    seqlen_bound,
    softcap_value,
    softmax_scale,
)
from attngen.runtime.dispatch import (
    Call,
    arch_of,
    choose,
    device_problem,
    select,
    unsupported_dtype,
)
from attngen.runtime.fallback import fallback_dense, fallback_varlen
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import Dispatch, Need
from attngen.spec import AttnSpec, Dtype, KernelKind, KvLayout, SpecError, load_spec_file


def run_dense(api: str, q, k, v, call: Call, *, refusal: str | None = None,
              attn_mask=None, rng_state=None, plan_key: tuple | None = None):  # fmt: skip
    """[B, H, N, D] attention through the prefill kind; (out, lse or None). With
    call.heads_last, out is [B, N, H, DV], contiguous. plan_key: the caller's signature key,
    under which a call a module served leaves its plan (plans.py; the key must tell calls with
    sinks, chunk_size and sink_tokens apart). rng_state: the call's Philox state when the
    caller drew it (arguments.attn_probs_rng_state), else drawn here."""
    call = _checked(call)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    backward = needs_gradients(q, k, v, call.sinks)
    need = call.need(
        KernelKind.prefill, q, v, (seqlen_q, seqlen_k), seqlen_q == seqlen_k, backward=backward
    )
    if need.dtype is None:
        refusal = refusal or unsupported_dtype(q)
    dispatch = choose(api, need, call.fallback, refusal, (q.shape[1], k.shape[1]))
    sm_scale = softmax_scale(call.scale, q)
    if dispatch.key is None:
        options = call.torch_options(sm_scale)
        result = fallback_dense(q, k, v, attn_mask=attn_mask, return_lse=call.return_lse, **options)
        out, lse = result if call.return_lse else (result, None)
        return (out.transpose(1, 2).contiguous() if call.heads_last else out), lse
    in_place = call.heads_last and dispatch.writes_out
    args = (sm_scale, call.alibi_slopes, call.return_lse, in_place, call.sinks)
    dropout = _dropout(call.dropout_p, q, rng_state)
    out, lse = ops.prefill(dispatch.key, q, k, v, *args, *dropout, deterministic=call.deterministic)
    if call.heads_last and not in_place:  # the module wrote [B, H, N, D]: copied (no out=)
        out = out.transpose(1, 2).contiguous()
    if not call.dropout_p:  # dropout: no plan (a planned call would skip the seed's draw)
        plans.remember(plan_key, dispatch, sm_scale, call.return_lse, in_place)
    return out, lse


def _checked(call: Call) -> Call:
    """The call with dropout_p and softcap checked (softcap <= 0: off, for the fallback too, as
    in flash-attn) and `deterministic` a bool."""
    dropout_p = dropout_probability(call.dropout_p)
    softcap = softcap_value(call.softcap)
    ops.check_deterministic(call.deterministic)
    return replace(call, dropout_p=dropout_p, softcap=softcap)


def run_dense_backward(api: str, dout, q, k, v, out, lse, dlse, call: Call):
    """(dq, dk, dv) of [B, H, N, D] attention through a prefill module's gradient kernels,
    given the forward's out and LSE (any LSE: context parallelism passes the whole sequence's)
    and the output's gradient dout (and the LSE's, dlse, or None); of `call`, the mask, its
    alignment and window, softcap, ALiBi and scale count. The Need asks for a module built
    with `backward: true`, so dispatch picks and records one, or raises NoKernelError: no
    torch fallback computes gradients from a given LSE."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    lengths = (seqlen_q, seqlen_k)
    need = call.need(KernelKind.prefill, q, v, lengths, seqlen_q == seqlen_k, backward=True)
    refusal = unsupported_dtype(q) if need.dtype is None else None
    dispatch = choose(api, need, "error", refusal, (q.shape[1], k.shape[1]))
    assert dispatch.key is not None  # fallback "error": a Dispatch without a module raised
    scale = softmax_scale(call.scale, q)
    return ops.prefill_backward(
        dispatch.key, dout, q, k, v, out, lse, dlse, scale, call.alibi_slopes
    )


def run_varlen(api: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k, call: Call, *, seqused_k=None, refusal: str | None = None,
               rng_state=None, length_bounds=None, dispatch: Dispatch | None = None,
               plan_key: tuple | None = None):  # fmt: skip
    """Packed [T, H, D] attention through the varlen kind; (out, lse [H, Tq] or None).

    The kernel is chosen with lengths the tensors guarantee, never max_seqlen_q/k (the
    caller's claim, which only sizes the grid): `length_bounds` (Nq, Nk) when the caller
    knows tighter ones from shapes (a cache's capacity), else the packed totals. A caller
    that must know the choice before it changes anything (the KV-cache route appends) passes
    the `dispatch` varlen_dispatch gave it. plan_key and rng_state: as run_dense's (a plan
    only for a call without seqused_k)."""
    call = _checked(call)
    if dispatch is None:
        same = cu_seqlens_q is cu_seqlens_k and seqused_k is None
        bounds = length_bounds or (q.shape[0], k.shape[0])
        backward = needs_gradients(q, k, v, call.sinks)
        heads = (q.shape[1], k.shape[1])
        dispatch = varlen_dispatch(api, q, v, call, bounds, same, refusal, heads, backward)
    max_seqlen_q = seqlen_bound(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = seqlen_bound(max_seqlen_k, "max_seqlen_k")
    sm_scale = softmax_scale(call.scale, q)
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if dispatch.key is None:
        options = call.torch_options(sm_scale)
        return fallback_varlen(q, k, v, *lengths, seqused_k, return_lse=call.return_lse, **options)
    args = (*lengths, sm_scale, call.alibi_slopes, seqused_k, call.return_lse, call.sinks)
    dropout = _dropout(call.dropout_p, q, rng_state)
    result = ops.varlen(dispatch.key, q, k, v, *args, *dropout, deterministic=call.deterministic)
    if seqused_k is None and not call.dropout_p:  # dropout: no plan (it would skip the draw)
        plans.remember(plan_key, dispatch, sm_scale, call.return_lse, False)
    return result


def _dropout(dropout_p: float, q, rng_state=None) -> tuple[float, Any]:
    """(dropout_p, the call's Philox state or None) for the ops: a fresh seed per call (the
    caller's, when it drew it)."""
    if not dropout_p:
        return dropout_p, None
    return dropout_p, (dropout_rng_state(q) if rng_state is None else rng_state)


def varlen_dispatch(api: str, q, v, call: Call, length_bounds: tuple[int, int],
                    same_lengths: bool, refusal: str | None, heads: tuple[int, int],
                    backward: bool = False) -> Dispatch:  # fmt: skip
    """The varlen module (or the warned fallback) that serves packed q [T, HQ, D] and values
    of v's head dim at lengths up to `length_bounds` (with learned sinks when call.sinks; with
    gradient kernels when `backward`); NoKernelError when none does."""
    need = call.need(KernelKind.varlen, q, v, length_bounds, same_lengths, backward=backward)
    if need.dtype is None:
        refusal = refusal or unsupported_dtype(q)
    return choose(api, need, call.fallback, refusal, heads)


# --------------------------------------------------------------------------------- warmup
#
# warmup(): build and compile what a model's attention needs before its first call.
#
# A model's first call would otherwise pay for rendering its modules (when no loaded module
# serves it: selection.build_for) and for Triton's compile of each kernel (seconds on a GPU). warmup
# takes a spec, specs, a spec file, a transformers config (or its folder or config.json) or a
# model with `.config`, selects (or builds) the module of every kernel kind the spec lists, as
# a call would, and runs each once on small inputs of the spec's head counts so that Triton
# compiles it. Triton keeps compiled kernels in its cache (~/.triton/cache, or
# $TRITON_CACHE_DIR), so a later process loads them instead of compiling again.
#
# Triton specializes a kernel on whether each integer argument (lengths, strides, the number
# of query blocks) is a multiple of 16, so on a GPU the inputs have 2048 and then 2047 tokens
# (lengths that are and are not multiples of 16, with a multiple of 16 query blocks for every
# BLOCK_M), and a prefill kernel runs on [B, H, N, D] tensors (SDPA's and transformers' layout)
# and on [B, N, H, D] ones (flash-attn's). A call whose lengths fall in another specialization
# (1000 tokens in 8 query blocks of 128, say) still compiles that variant on first use; telling
# Triton not to specialize the length arguments (`do_not_specialize` in the templates) would end
# that. Under Triton's interpreter (CPU tensors) nothing is compiled: the modules are built and
# imported, and each runs once, on 16 tokens (fp16 and fp32; bf16 is refused there).

LENGTHS = (2048, 2047)  # a multiple of 16 and not (module docstring)
INTERPRETED_LENGTHS = (16,)  # nothing compiles under the interpreter: one small run
DECODE_CACHE = 256  # keys of the cache a decode kernel is warmed on


@dataclass(frozen=True)
class Warmed:
    """One kernel warmed: which module, where it came from, and the seconds it took."""

    spec: str
    kind: str
    module: str  # <arch>/<module name>
    source: str | None  # "folder", "cache" (built on demand) or "bundled"
    built: bool  # rendered by this warmup
    seconds: float  # selecting (and building), importing and the runs (compiles) together
    ran: bool  # the kernel ran (False where the device cannot run it: bf16 on the CPU)


def warmup(spec_or_model: Any, *, device: str | torch.device | None = None) -> list[Warmed]:
    """Build (when no loaded module serves it) and compile every kernel `spec_or_model`
    needs on `device` (default: the current CUDA device, else the CPU under Triton's
    interpreter). Returns what was warmed; raises NoKernelError for a kernel no module
    serves and none can be built (its message says why)."""
    default = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(default if device is None else device)
    arch = arch_of(target.type, target.index)
    warmed = []
    for spec in specs_of(spec_or_model):
        for kind in spec.kernels:
            start = time.perf_counter()
            need = need_of(spec, kind, arch)
            heads = (spec.num_q_heads, spec.num_kv_heads)
            dispatch = select("warmup", need, fallback="error", heads=heads)
            assert dispatch.key is not None  # fallback="error": served or raised
            module = current_registry().module(dispatch.key)
            ran = device_problem("warmup", arch, spec.dtype) is None
            if ran:
                _run(module, spec, kind, target)
            if target.type == "cuda":
                torch.cuda.synchronize(target)
            served = (str(dispatch.module), dispatch.source, dispatch.built)
            seconds = time.perf_counter() - start
            warmed.append(Warmed(spec.name, kind.value, *served, seconds, ran))
    return warmed


def specs_of(source: Any) -> tuple[AttnSpec, ...]:
    """The specs of a spec, specs, a spec file (.yaml), a transformers config (a dict, an
    object with to_dict(), a config.json or its folder) or a model with `.config`."""
    from attngen.spec.hf import spec_from_config

    if isinstance(source, AttnSpec):
        return (source,)
    if isinstance(source, (list, tuple)) and all(isinstance(s, AttnSpec) for s in source):
        return tuple(source)
    if isinstance(source, (str, Path)) and Path(source).suffix in (".yaml", ".yml"):
        return load_spec_file(source)
    if isinstance(source, torch.nn.Module):
        config = getattr(source, "config", None)
        if config is None:
            raise SpecError(
                f"spec_or_model: a {type(source).__name__} without .config; pass "
                "a spec, a spec file or a transformers config"
            )
        parameter = next(source.parameters(), None)
        dtype = Dtype.from_torch_name(str(parameter.dtype)) if parameter is not None else None
        return spec_from_config(config, dtype=dtype.value if dtype else None)
    return spec_from_config(source)


def need_of(spec: AttnSpec, kind: KernelKind, arch: str) -> Need:
    """What any call of this spec's kernel needs, at lengths where no mask equals another."""
    decode = kind is KernelKind.decode
    return Need(
        kind=kind,
        dtype=spec.dtype,
        head_dim=spec.head_dim,
        head_dim_v=spec.value_head_dim,
        mask=spec.mask,
        causal_align=spec.causal_align,
        window=spec.window,
        softcap=float(spec.softcap),
        alibi=spec.alibi,
        arch=arch,
        seqlen_q=spec.query_tokens if decode else 2**30,
        seqlen_k=2**30 + 1,
        same_lengths=False,
        kv_layout=spec.kv_layout if decode else None,
        page_size=spec.page_size if decode else None,
        kv_dtype=spec.kv_dtype if decode else None,
        sinks=spec.sinks,
        chunk_size=spec.chunk_size,
        sink_tokens=spec.sink_tokens,
    )


def _run(module: Any, spec: AttnSpec, kind: KernelKind, device: torch.device) -> None:
    dtype = getattr(torch, spec.dtype.torch_name)
    heads_q, heads_kv = spec.num_q_heads, spec.num_kv_heads
    d, dv = spec.head_dim, spec.value_head_dim
    slopes = torch.full((heads_q,), 0.5, device=device) if spec.alibi else None
    # A module built with sinks takes them (the entry point refuses a call without).
    extra = {"sinks": torch.zeros(heads_q, device=device)} if spec.sinks else {}

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    if kind is KernelKind.decode:
        _run_decode(module, spec, rand, slopes, device, extra)
        return
    for n in LENGTHS if device.type == "cuda" else INTERPRETED_LENGTHS:
        if kind is KernelKind.prefill:
            qkv = (rand(1, heads_q, n, d), rand(1, heads_kv, n, d), rand(1, heads_kv, n, dv))
            module.attention(*qkv, alibi_slopes=slopes, **extra)
            # flash-attn's [B, N, H, D] layout, the output too when the module writes it in
            # place (the runtime passes out= then): other strides, another specialization.
            out = rand(1, n, heads_q, dv).transpose(1, 2)
            flash_out = {"out": out} if module.ACCEPTS_OUT is True else {}
            qkv = (rand(1, n, heads_q, d), rand(1, n, heads_kv, d), rand(1, n, heads_kv, dv))
            flash = (t.transpose(1, 2) for t in qkv)
            module.attention(*flash, alibi_slopes=slopes, **flash_out, **extra)
        else:
            cu = torch.tensor([0, n], dtype=torch.int32, device=device)
            qkv = (rand(n, heads_q, d), rand(n, heads_kv, d), rand(n, heads_kv, dv))
            module.attention_varlen(*qkv, cu, cu, n, n, alibi_slopes=slopes, **extra)


def _run_decode(
    module: Any,
    spec: AttnSpec,
    rand: Any,
    slopes: torch.Tensor | None,
    device: torch.device,
    extra: dict[str, torch.Tensor],
) -> None:
    heads_kv, new = spec.num_kv_heads, spec.query_tokens
    lengths = torch.tensor([DECODE_CACHE // 2], dtype=torch.int32, device=device)
    q = rand(1, spec.num_q_heads, new, spec.head_dim)
    k_new = rand(1, heads_kv, new, spec.head_dim)
    v_new = rand(1, heads_kv, new, spec.value_head_dim)
    if spec.cache_layout is KvLayout.paged:
        page = spec.page_size or 1
        pages = -(-DECODE_CACHE // page)
        lead: tuple[int, ...] = (pages, page, heads_kv)
        table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    else:
        lead, table = (1, heads_kv, DECODE_CACHE), None
    caches = (rand(*lead, spec.head_dim), rand(*lead, spec.value_head_dim))
    if spec.kv_dtype is not None:  # an fp8 cache (descales default to 1.0)
        caches = tuple(cache.to(torch.float8_e4m3fn) for cache in caches)
    news = {"k_new": k_new, "v_new": v_new}
    module.decode(q, *caches, lengths, block_table=table, alibi_slopes=slopes, **news, **extra)
