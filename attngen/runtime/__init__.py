"""The runtime: generated kernels in real models (torch; never imported by the build path).
docs/architecture.md ("Files") maps its files; imports go one way (registry <- selection
<- dispatch <- ... <- the public functions; tests/test_import_graph.py).

The public names are imported here; importing the package registers the torch.library ops.
flash-attn 2.x's packed forms are defined here: each takes views of the packed tensor (no
copy: the kernels read any strides) and calls flash_attn_func or flash_attn_varlen_func with
the same arguments, so masks, softcap, ALiBi, GQA (kvpacked), dropout, return_attn_probs
(flash-attn's S_dmask) and the errors are theirs. A packed tensor of the wrong rank or with
the wrong stack size is refused, naming it and flash-attn's layout.
"""

import torch

from attngen.runtime.api import (
    flash_attn_func,
    flash_attn_varlen_func,
    scaled_dot_product_attention,
)
from attngen.runtime.dispatch import get_fallback, set_fallback
from attngen.runtime.flex import BlockMask, TraceError, create_block_mask, flex_attention
from attngen.runtime.hf import register_transformers
from attngen.runtime.kvcache import flash_attn_with_kvcache
from attngen.runtime.launch import Warmed, warmup
from attngen.runtime.ops import (
    BackwardRun,
    backward_runs,
    last_backward,
    reset_backward_runs,
    reset_run_counts,
    run_counts,
)
from attngen.runtime.registry import (
    KernelEntry,
    LoadedKernel,
    Registry,
    RegistryError,
    configure,
    current_registry,
    load_kernels,
    loaded_kernels,
    use_registry,
)
from attngen.runtime.selection import Dispatch, Need, NoKernelError, dispatch_log, last_dispatch

__all__ = [
    "BlockMask",
    "TraceError",
    "create_block_mask",
    "flex_attention",
    "BackwardRun",
    "backward_runs",
    "last_backward",
    "reset_backward_runs",
    "Dispatch",
    "KernelEntry",
    "LoadedKernel",
    "Need",
    "NoKernelError",
    "Registry",
    "RegistryError",
    "Warmed",
    "configure",
    "loaded_kernels",
    "use_registry",
    "warmup",
    "dispatch_log",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "current_registry",
    "get_fallback",
    "last_dispatch",
    "load_kernels",
    "register_transformers",
    "reset_run_counts",
    "run_counts",
    "scaled_dot_product_attention",
    "set_fallback",
]


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):  # fmt: skip
    """flash-attn 2.x `flash_attn_qkvpacked_func`: qkv [B, N, 3, H, D] -> out [B, N, H, D]
    (with return_attn_probs: (out, lse [B, H, N], S_dmask), S_dmask as flash_attn_func's)."""
    q, k, v = _unstack("qkv", qkv, 5, 3, "[batch, seqlen, 3, nheads, headdim]")
    options = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return flash_attn_func(q, k, v, *options, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):  # fmt: skip
    """flash-attn 2.x `flash_attn_kvpacked_func`: q [B, Nq, HQ, D], kv [B, Nk, 2, HKV, D]
    -> out [B, Nq, HQ, D]; HQ a multiple of HKV (GQA)."""
    k, v = _unstack("kv", kv, 5, 2, "[batch, seqlen_k, 2, nheads_k, headdim]")
    options = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return flash_attn_func(q, k, v, *options, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):  # fmt: skip
    """flash-attn 2.x `flash_attn_varlen_qkvpacked_func`: qkv [T, 3, H, D], cu_seqlens int32
    [B + 1] for queries and keys alike -> out [T, H, D] (lse [H, T])."""
    q, k, v = _unstack("qkv", qkv, 4, 3, "[total, 3, nheads, headdim]")
    options = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    lengths = (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return flash_attn_varlen_func(q, k, v, *lengths, *options, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):  # fmt: skip
    """flash-attn 2.x `flash_attn_varlen_kvpacked_func`: q [Tq, HQ, D], kv [Tk, 2, HKV, D]
    -> out [Tq, HQ, D] (lse [HQ, Tq])."""
    k, v = _unstack("kv", kv, 4, 2, "[total_k, 2, nheads_k, headdim]")
    options = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return flash_attn_varlen_func(q, k, v, *lengths, *options, deterministic, return_attn_probs)


def _unstack(
    name: str, packed: object, rank: int, count: int, layout: str
) -> tuple[torch.Tensor, ...]:
    """The `count` tensors stacked at dim rank - 3 of `packed`, as views."""
    if (type(packed) is torch.Tensor or isinstance(packed, torch.Tensor)) and (
        packed.dim() == rank and packed.shape[rank - 3] == count
    ):
        return packed.unbind(rank - 3)
    got = list(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
    raise ValueError(f"{name}: expected a rank-{rank} tensor {layout}, got {got}")
