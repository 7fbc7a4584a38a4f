"""warmup(): build and compile what a model's attention needs before its first call.

A model's first call would otherwise pay for rendering its modules (when no loaded module
serves it: ondemand.py) and for Triton's compile of each kernel (seconds on a GPU). warmup
takes a spec, specs, a spec file, a transformers config (or its folder or config.json) or a
model with `.config`, selects (or builds) the module of every kernel kind the spec lists, as
a call would, and runs each once on small inputs of the spec's head counts so that Triton
compiles it. Triton keeps compiled kernels in its cache (~/.triton/cache, or
$TRITON_CACHE_DIR), so a later process loads them instead of compiling again.

Triton specializes a kernel on whether each integer argument (lengths, strides, the number
of query blocks) is a multiple of 16, so on a GPU the inputs have 2048 and then 2047 tokens
(lengths that are and are not multiples of 16, with a multiple of 16 query blocks for every
BLOCK_M), and a prefill kernel runs on [B, H, N, D] tensors (SDPA's and transformers' layout)
and on [B, N, H, D] ones (flash-attn's). A call whose lengths fall in another specialization
(1000 tokens in 8 query blocks of 128, say) still compiles that variant on first use; telling
Triton not to specialize the length arguments (`do_not_specialize` in the templates) would end
that. Under Triton's interpreter (CPU tensors) nothing is compiled: the modules are built and
imported, and each runs once, on 16 tokens (fp16 and fp32; bf16 is refused there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attngen.runtime.devices import device_problem
from attngen.runtime.dispatch import arch_of, select
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import Need
from attngen.spec import AttnSpec, Dtype, KernelKind, KvLayout, SpecError, load_spec_file

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
    target = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    arch = arch_of(target.type, target.index)
    warmed = []
    for spec in specs_of(spec_or_model):
        for kind in spec.kernels:
            start = time.perf_counter()
            need = need_of(spec, kind, arch)
            dispatch = select(
                "warmup", need, fallback="error", heads=(spec.num_q_heads, spec.num_kv_heads)
            )
            assert dispatch.key is not None  # fallback="error": served or raised
            module = current_registry().module(dispatch.key)
            ran = device_problem("warmup", arch, spec.dtype) is None
            if ran:
                _run(module, spec, kind, target)
            if target.type == "cuda":
                torch.cuda.synchronize(target)
            warmed.append(
                Warmed(
                    spec.name,
                    kind.value,
                    str(dispatch.module),
                    dispatch.source,
                    dispatch.built,
                    time.perf_counter() - start,
                    ran,
                )
            )
    return warmed


def specs_of(source: Any) -> tuple[AttnSpec, ...]:
    """The specs of a spec, specs, a spec file (.yaml), a transformers config (a dict, an
    object with to_dict(), a config.json or its folder) or a model with `.config`."""
    from attngen.hf_spec import spec_from_config

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
            module.attention(
                rand(1, heads_q, n, d),
                rand(1, heads_kv, n, d),
                rand(1, heads_kv, n, dv),
                alibi_slopes=slopes,
                **extra,
            )
            # flash-attn's [B, N, H, D] layout, the output too when the module writes it in
            # place (the runtime passes out= then): other strides, another specialization.
            flash_out = (
                {"out": rand(1, n, heads_q, dv).transpose(1, 2)}
                if module.ACCEPTS_OUT is True
                else {}
            )
            module.attention(
                rand(1, n, heads_q, d).transpose(1, 2),
                rand(1, n, heads_kv, d).transpose(1, 2),
                rand(1, n, heads_kv, dv).transpose(1, 2),
                alibi_slopes=slopes,
                **flash_out,
                **extra,
            )
        else:
            cu = torch.tensor([0, n], dtype=torch.int32, device=device)
            module.attention_varlen(
                rand(n, heads_q, d),
                rand(n, heads_kv, d),
                rand(n, heads_kv, dv),
                cu,
                cu,
                n,
                n,
                alibi_slopes=slopes,
                **extra,
            )


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
        caches = (
            rand(pages, page, heads_kv, spec.head_dim),
            rand(pages, page, heads_kv, spec.value_head_dim),
        )
        table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    else:
        caches = (
            rand(1, heads_kv, DECODE_CACHE, spec.head_dim),
            rand(1, heads_kv, DECODE_CACHE, spec.value_head_dim),
        )
        table = None
    if spec.kv_dtype is not None:  # an fp8 cache (descales default to 1.0)
        caches = tuple(cache.to(torch.float8_e4m3fn) for cache in caches)
    module.decode(
        q,
        *caches,
        lengths,
        block_table=table,
        k_new=k_new,
        v_new=v_new,
        alibi_slopes=slopes,
        **extra,
    )
