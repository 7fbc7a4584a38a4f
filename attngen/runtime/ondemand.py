"""Kernels on demand: the module a call needs, derived, rendered, cached and loaded.

When no loaded module serves a call (dispatch.py asks, with the call's Need and head counts),
`build_for` states the call as a spec, renders it through the build path (plan_build: the
tiling model's choice, or the tuning database's config when it has one for this spec and
arch), writes it into the on-demand cache (kernel_cache.py) as an ordinary build folder, and
adds it to the registry in use. No torch here: the build path stays torch-free, and this is
its glue.

The spec of a call:
- every field a kernel depends on comes from the Need (kind, dtype, head dims, mask and
  alignment, window, sink tokens, chunk size, softcap, ALiBi, sinks; for decode the KV
  layout, page size and the step's query tokens as max_query_tokens; `backward: true` when
  the call runs gradient kernels). A window side of 2**31 - 1 (flash-attn's -1) is
  unbounded: a window unbounded on both sides is no mask, and one unbounded left and closed
  right is causal.
- head counts are runtime arguments of every module, but the tiling model uses them (prefill
  estimates waves from the query heads; decode's row tile is query heads per KV head times
  query tokens) and so does the tuning database's key. The spec takes the call's own counts,
  and so does its name, `auto_h<HQ>kv<HKV>`: a module is a function of its name, and any
  module serves any head counts, so a later call with other counts uses it rather than
  building again.
- dropout_p > 0 (Need.dropout): `backward: true, dropout: true` (the only modules that take
  dropout_p; they serve calls without dropout as well).
- arch: the device's. Under Triton's interpreter (CPU tensors) it is INTERPRETER_ARCH, sm80:
  the portable code path (pointer loads, no Hopper-only TMA or wgmma), which every arch
  shares.

The cache itself (its folders, locks, renders and writes) is kernel_cache.py's.
"""

from __future__ import annotations

from typing import Any

from attngen.runtime import kernel_cache
from attngen.runtime.registry import KernelEntry, Registry, cache_entry
from attngen.runtime.selection import INTERPRETER, Need
from attngen.spec import AttnSpec, KernelKind, Mask, SpecError, specs_from_data

INTERPRETER_ARCH = "sm80"
UNBOUNDED = 2**31 - 1  # flash-attn's -1 window side, as arguments.INFINITE
NAME_PREFIX = "auto"


class NotExpressible(ValueError):
    """A call no spec can state (its message says which field, and why)."""


def render_count() -> int:
    """How many modules this process has rendered on demand (a cached one is not rendered)."""
    return kernel_cache.render_count()


def build_for(
    need: Need, heads: tuple[int, int] | None, registry: Registry
) -> tuple[KernelEntry, bool]:
    """The cache's module for `need` (built now unless a valid one is there), added to
    `registry`; (entry, whether this call rendered it). NotExpressible or BuildError say why
    none can be built."""
    spec, kind, arch = spec_for(need, heads)
    folder, item, built = kernel_cache.cached_build(spec, kind, arch)
    registry.add(cache_entry(folder, item), folder.resolve())
    return cache_entry(folder, item), built


def spec_for(
    need: Need, heads: tuple[int, int] | None, expressions: dict[str, Any] | None = None
) -> tuple[AttnSpec, KernelKind, str]:
    """The spec, kind and arch that serve `need` (the module docstring), with `expressions`'
    fields (score_mod, mask_mod, tensors: flex_attention's), or NotExpressible."""
    from attngen.arch import ARCHS

    arch = INTERPRETER_ARCH if need.arch == INTERPRETER else need.arch
    if arch not in ARCHS:
        raise NotExpressible(
            f"arch: {need.arch} has no row in attngen/arch.py (known: {', '.join(ARCHS)})"
        )
    if need.dtype is None:
        raise NotExpressible("dtype: no generated kernels for q's dtype")
    num_q, num_kv = _head_counts(heads)
    fields: dict[str, Any] = {
        "name": f"{NAME_PREFIX}_h{num_q}kv{num_kv}",
        "archs": [arch],
        "dtype": need.dtype.value,
        "head_dim": need.head_dim,
        "head_dim_v": need.head_dim_v,
        "num_q_heads": num_q,
        "num_kv_heads": num_kv,
        "softcap": float(need.softcap),
        "alibi": need.alibi,
        "kernels": [need.kind.value],
        **_mask_fields(need),
    }
    if need.sinks:
        fields["sinks"] = True
    if need.dropout:
        fields.update(backward=True, dropout=True)
    if need.kind is KernelKind.decode:
        fields["kv_layout"] = need.kv_layout.value if need.kv_layout else None
        if need.page_size is not None:
            fields["page_size"] = need.page_size
        fields["max_query_tokens"] = max(1, need.seqlen_q)
    if need.backward:
        fields["backward"] = True
    fields.update(expressions or {})
    try:
        (spec,) = specs_from_data(fields)
    except SpecError as exc:
        raise NotExpressible(str(exc)) from None
    return spec, need.kind, arch


def _head_counts(heads: tuple[int, int] | None) -> tuple[int, int]:
    """The call's (query heads, KV heads) as valid spec fields: 1..1024 and a divisor."""
    if heads is None:
        return 1, 1
    num_q, num_kv = heads
    if num_kv < 1 or num_q < num_kv or num_q % num_kv:
        return 1, 1  # the module itself refuses such a call, naming the head counts
    ratio = num_q // num_kv
    num_kv = max(1, min(num_kv, 1024 // min(ratio, 1024)))
    return min(ratio, 1024) * num_kv, num_kv


def _mask_fields(need: Need) -> dict[str, Any]:
    mask, window = need.mask, need.window
    if mask is Mask.sliding_window and window is not None:
        left, right = window
        if left >= UNBOUNDED and right >= UNBOUNDED:
            mask = Mask.none
        elif left >= UNBOUNDED and right == 0:
            mask = Mask.causal
    if mask is Mask.none:
        return {"mask": "none"}
    align = need.causal_align.value if need.causal_align else None
    fields: dict[str, Any] = {"mask": mask.value, "causal_align": align}
    if mask is Mask.sliding_window and window is not None:
        fields.update(window_left=window[0], window_right=window[1])
        if need.sink_tokens:
            fields["sink_tokens"] = need.sink_tokens
    if mask is Mask.chunked:
        fields["chunk_size"] = need.chunk_size
    return fields


def cached_module(spec: AttnSpec, kind: KernelKind, arch: str) -> tuple[KernelEntry, bool]:
    """The cache's entry for (spec, kind, arch), rendered and written unless a valid one is
    there (kernel_cache.cached_build); (entry, whether it was rendered now)."""
    folder, item, built = kernel_cache.cached_build(spec, kind, arch)
    return cache_entry(folder, item), built
