"""The name of a generated module (one function, so that every path agrees on it) and the
attngen version a module and a build index record."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngen.spec.expressions import declared, digest, parsed

if TYPE_CHECKING:
    from attngen.spec import AttnSpec, KernelKind

__version__ = "0.1.0"  # attngen's, re-exported by the package (pyproject.toml says the same)


def module_name(spec: AttnSpec, kernel: KernelKind) -> str:
    """The one function that names a generated module; no tile sizes, so re-tuning keeps it.

    Fixed field order: spec name, kernel, dtype, head dims, mask (window and sink tokens, or
    chunk size; then alignment), softcap, alibi, sinks, score_mod and mask_mod digests, for
    prefill and varlen `bwd` (and `drop`) when the module trains, and for decode the KV layout
    (page size), max_query_tokens when > 1 and `kvfp8` for an fp8 cache.
    Head counts are runtime arguments of the kernel, so they are not in it.
    """
    parts = [spec.name, kernel.value, spec.dtype.value, f"d{spec.head_dim}"]
    if spec.value_head_dim != spec.head_dim:
        parts.append(f"dv{spec.value_head_dim}")
    if spec.mask.value == "causal":
        parts.append("causal")
    elif spec.mask.value == "sliding_window":
        left, right = spec.window or (0, 0)
        parts.append(f"win{left}x{right}")
        if spec.sink_tokens:
            parts.append(f"st{spec.sink_tokens}")
    elif spec.mask.value == "chunked":
        parts.append(f"chunk{spec.chunk_size}")
    if spec.causal_align is not None:
        parts.append("tl" if spec.causal_align.value == "top_left" else "br")
    if spec.softcap:
        # repr: the shortest text that round-trips, so distinct softcaps get distinct names
        # (format "g" keeps 6 digits: 50.0000001 -> "50"); "-" of an exponent becomes "m".
        cap = repr(spec.softcap).removesuffix(".0")
        parts.append("cap" + cap.replace(".", "p").replace("-", "m").replace("+", ""))
    if spec.alibi:
        parts.append("alibi")
    if spec.sinks:
        parts.append("sinks")
    for field, tag in (("score_mod", "sm"), ("mask_mod", "mm")):
        tree = parsed(spec, field)
        if tree is not None:  # the normalized tree's digest: spacing does not rename it
            parts.append(tag + digest(tree, declared(spec)))
    if kernel.value != "decode" and spec.backward:
        parts.append("bwd_drop" if spec.dropout else "bwd")
    if kernel.value == "decode":
        paged = spec.kv_layout is not None and spec.kv_layout.value == "paged"
        parts.append(f"paged{spec.page_size}" if paged else "contig")
        if spec.query_tokens > 1:
            parts.append(f"q{spec.query_tokens}")
        if spec.kv_dtype is not None:
            parts.append("kvfp8")
    return "_".join(parts)
