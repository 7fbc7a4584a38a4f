"""The nearest change to a spec that some tile config fits: the build's error for a spec an
arch cannot serve names it, and `attngen explain` prints it under a derivation with no choice.
"""

from __future__ import annotations

from attngen.spec import AttnSpec, Dtype, KernelKind
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.prefill import derive_tiles, padded_head_dim


def nearest_alternative(spec: AttnSpec, arch: str, kind: KernelKind = KernelKind.prefill) -> str:
    """When nothing fits: the closest change to the spec that does, or why none exists.

    Tried in the order a user would give ground: a smaller head dim (the model only sees the
    padded power of two, so each tier down once), then a 16-bit dtype instead of fp32. Every
    trial is a derivation, not a compile."""
    trials: list[tuple[str, AttnSpec]] = []
    padded = padded_head_dim(max(spec.head_dim, spec.value_head_dim))
    tier = padded // 2
    while tier >= 16:
        dims = {"head_dim": min(spec.head_dim, tier), "head_dim_v": min(spec.value_head_dim, tier)}
        trials.append((f"head_dim <= {tier}", spec.model_copy(update=dims)))
        tier //= 2
    if spec.dtype.itemsize == 4:
        trials.insert(0, ("dtype bf16", spec.model_copy(update={"dtype": Dtype.bf16})))
    if kind is KernelKind.decode and spec.query_tokens > 1:
        trials.insert(0, ("max_query_tokens 1", spec.model_copy(update={"max_query_tokens": 1})))
    derive = derive_decode_tiles if kind is KernelKind.decode else derive_tiles
    for change, trial in trials:
        chosen = derive(trial, arch).chosen
        if chosen is not None:
            return (
                f"{change} fits (BLOCK_M={chosen.block_m} BLOCK_N={chosen.block_n} "
                f"num_warps={chosen.num_warps} num_stages={chosen.num_stages})"
            )
    tried = "a smaller head dim" + (" or bf16" if spec.dtype.itemsize == 4 else "")
    return f"none: {tried} does not fit {arch} either"
