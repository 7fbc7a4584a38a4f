"""attngen: specialized FlashAttention-style Triton kernels generated from a YAML spec.

The modules follow the pipeline: spec (validated and frozen; strict_yaml reads the file) ->
arch (GPU targets as data) -> tiling/ (the launch config, derived, and the code paths) ->
render (templates/ and the config become a module's text) -> build (generated/<arch>/ and its
index; files writes them). Beside it: tuning/ (measured configs that replace the heuristic's),
verify/ (the tiling model against Triton's compiler), explain and capabilities (the
derivations in words), cli (the command over all of it). runtime/ serves the generated
kernels to models; reference is the float64 attention they are tested against.

The build path (spec -> generated/) imports neither torch nor triton, so the names that run
kernels are loaded lazily, from attngen.runtime, on first access, and then kept here: a call
through `attngen.flash_attn_func` finds the function like any module attribute, instead of
paying this module's __getattr__ (an import statement) on every call.
"""

from typing import Any

from attngen.spec.names import __version__ as __version__

_RUNTIME = frozenset(
    {
        "scaled_dot_product_attention",
        "flash_attn_func",
        "flash_attn_varlen_func",
        "flash_attn_with_kvcache",
        "flash_attn_qkvpacked_func",
        "flash_attn_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func",
        "flash_attn_varlen_kvpacked_func",
        "flex_attention",
        "create_block_mask",
        "BlockMask",
        "TraceError",
        "register_transformers",
        "last_dispatch",
        "dispatch_log",
        "load_kernels",
        "set_fallback",
        "NoKernelError",
        "configure",
        "loaded_kernels",
        "warmup",
    }
)


def __getattr__(name: str) -> Any:
    if name in _RUNTIME:
        import attngen.runtime

        value = getattr(attngen.runtime, name)
    elif name == "context_parallel_attention":
        from attngen.distributed import context_parallel_attention as value
    elif name == "spec_from_config":
        from attngen.spec.hf import spec_from_config as value
    else:
        raise AttributeError(f"module 'attngen' has no attribute {name!r}")
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_RUNTIME, "spec_from_config", "context_parallel_attention"})
