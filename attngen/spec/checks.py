"""The spec's cross-field checks for the training fields (backward, dropout) and the newer
models' fields (sinks, chunked masks, sink tokens, latent attention's head dims).

They read the spec through enum values rather than importing attngen.spec, which imports
them (each raises the spec's one-line field error).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngen.spec.errors import field_error

if TYPE_CHECKING:
    from attngen.spec import AttnSpec

# Any head dim flash-attn serves: the kernels pad it to a power of two >= 16 (tl.dot's and
# tl.arange's extents) and mask the padded lanes on every load and store. Beyond 256 only the
# decode kind (multi-head latent attention's absorbed decode: 576 / 512), whose tile the
# decode tiling model sizes per arch; prefill tiles are modelled and measured up to 256.
MAX_HEAD_DIM = 256
MAX_DECODE_HEAD_DIM = 576


def check_training(spec: AttnSpec) -> None:
    """backward needs a prefill or varlen kernel, and dropout needs backward. (The gradient
    kernels implement every mask, sinks and sink tokens.)"""
    kinds = {kind.value for kind in spec.kernels}
    if spec.backward and not kinds & {"prefill", "varlen"}:
        allowed = "true only with prefill or varlen in kernels (decode has no backward)"
        raise field_error("backward", True, allowed)
    if spec.dropout and not spec.backward:
        raise field_error(
            "dropout", True, "true only with backward: true (dropout is for training)"
        )


def check_model_fields(spec: AttnSpec) -> None:
    """chunk_size exactly with mask chunked; sink_tokens only with a sliding window."""
    chunked = spec.mask.value == "chunked"
    if chunked and spec.chunk_size is None:
        raise field_error(
            "chunk_size", None, "an int in 1..2147483647 (required with mask chunked)"
        )
    if not chunked and spec.chunk_size is not None:
        raise field_error("chunk_size", spec.chunk_size, "absent unless mask is chunked")
    if spec.sink_tokens is not None and spec.mask.value != "sliding_window":
        allowed = "absent unless mask is sliding_window (the first keys a window would drop)"
        raise field_error("sink_tokens", spec.sink_tokens, allowed)


def check_head_dims(spec: AttnSpec) -> None:
    """Head dims beyond MAX_HEAD_DIM only for a decode-only spec."""
    if [kind.value for kind in spec.kernels] == ["decode"]:
        return
    for field in ("head_dim", "head_dim_v"):
        value = getattr(spec, field)
        if value is not None and value > MAX_HEAD_DIM:
            allowed = f"an int in 1..{MAX_HEAD_DIM} (up to {MAX_DECODE_HEAD_DIM} with kernels:"
            raise field_error(field, value, allowed + " [decode] only)", typed=True)


# Triton's fp8 e4m3 (float8e4nv) loads, stores and conversions need sm89 or newer.
FP8_ARCHS = ("sm89", "sm90", "sm120")


def check_kv_dtype(spec: AttnSpec) -> None:
    """kv_dtype fp8_e4m3: 16-bit queries (the cache is dequantized to their dtype for the
    dots), archs with fp8 conversions, and no absorbed MLA decode (head dims over 256)."""
    if spec.kv_dtype is None:
        return
    if spec.dtype.value not in ("bf16", "fp16"):
        raise field_error("dtype", spec.dtype.value, "bf16 or fp16 with kv_dtype fp8_e4m3")
    for arch in spec.archs:
        if arch not in FP8_ARCHS:
            raise field_error("archs", arch, f"{', '.join(FP8_ARCHS)} with kv_dtype fp8_e4m3")
    if max(spec.head_dim, spec.head_dim_v or 0) > MAX_HEAD_DIM:
        allowed = f"absent with head dims over {MAX_HEAD_DIM} (MLA decode)"
        raise field_error("kv_dtype", "fp8_e4m3", allowed)
