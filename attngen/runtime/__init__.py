"""The runtime: generated kernels in real models (torch; never imported by the build path).

    kernel_cache.py  the on-demand settings, the cache's folders, building a module into
                  the cache (plain Python)
    registry.py   which generated modules exist (index.json; folders, the on-demand cache,
                  the bundled generated/), imported by file path only if its bytes and
                  constants match its index entry; configure()
    selection.py  Need, Dispatch, which module serves a Need; last_dispatch() and
                  dispatch_log(), per thread (plain Python, no torch)
    ondemand.py   the module a call needs: its spec, built into the cache (plain Python)
    devices.py    the device's arch; CPU needs Triton's interpreter, bf16 correct math there
                  (a probe kernel)
    dispatch.py   a call's Need from its tensors; the choice, cached per registry, recorded
    ops.py        the modules' entry points: direct in eager mode, torch.library ops under
                  torch.compile or autograd
    backward_ops.py  the prefill and varlen ops' autograd formulas (registered at import);
                     last_backward(), backward_runs(): which backward path ran (atomic dQ or not)
    launch.py     run_dense / run_varlen: Need, dispatch, then the module or the fallback
    plans.py      an eager call's route kept per call signature: a repeated signature runs
                  the module without the layers above (its own checks run on every call)
    arguments.py  argument conventions the public functions share (scale, flash masks);
                  shape checks in the caller's layout
    api.py        scaled_dot_product_attention, flash_attn_func, flash_attn_varlen_func
    packed.py     flash-attn's qkv/kv-packed forms of both, as views
    attn_probs.py flash-attn's S_dmask for return_attn_probs with dropout (a testing path)
    kvcache.py    flash_attn_with_kvcache (decode kind when built, else varlen over the cache)
    kvcache_options.py  its options and checks, rotary, what its plans need
    kvcache_append.py  which sequences fit their cache, the append of new keys (varlen
                  route); paged K/V for flash_attn_varlen_func
    decode_ops.py the decode kind's calls and op
    flex/         flex_attention and create_block_mask (torch's FlexAttention calls): Python
                  score_mod / mask_mod traced into expressions, modules built on demand
    hf.py, hf_cache.py  the transformers attention function ("attngen"); static-cache decode
    warmup.py     warmup(): build and compile what a spec or model needs, before its first call
    fallback.py   the torch implementation behind fallback="sdpa" (masks: attngen/masks.py,
                  the oracle's definition too), with the generated modules' argument checks

Imports go one way (tests/test_import_graph.py): kernel_cache <- registry <- selection <-
ondemand, devices <- dispatch <- ... <- the public functions.

The public names are imported here; importing the package registers the torch.library ops.
"""

from attngen.runtime import backward_ops  # noqa: F401  (registers the ops' autograd formulas)
from attngen.runtime.api import (
    flash_attn_func,
    flash_attn_varlen_func,
    scaled_dot_product_attention,
)
from attngen.runtime.backward_ops import (
    BackwardRun,
    backward_runs,
    last_backward,
    reset_backward_runs,
)
from attngen.runtime.dispatch import get_fallback, set_fallback
from attngen.runtime.flex import BlockMask, TraceError, create_block_mask, flex_attention
from attngen.runtime.hf import register_transformers
from attngen.runtime.kvcache import flash_attn_with_kvcache
from attngen.runtime.ops import reset_run_counts, run_counts
from attngen.runtime.packed import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
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
from attngen.runtime.warmup import Warmed, warmup

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
