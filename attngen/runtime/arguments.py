"""Argument conventions the public functions share, each checked once per call, and the shape
checks in the caller's layout.

The softmax scale, the softcap, flash-attn's (causal, window_size) as a spec mask, SDPA's
causal_align, rank checks, and the refusals of features no generated kernel has. A check that
passes builds no string: messages are formatted only when a check fails.

Shape checks run in the caller's layout, before any transpose: an error names the tensor, the
layout the caller passes (flash-attn's [batch, seqlen, nheads, headdim]), what was expected and
what was given, never the [B, H, N, D] layout the kernels are called with. A call that passes
is checked once, by comparisons only; the checks that name what is wrong (and build the
message) run only when one fails.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

from attngen.spec import CausalAlign, Mask

INFINITE = 2**31 - 1  # flash-attn's -1 window side, as the spec's largest window
_UNBOUNDED = (-1, -1)


def needs_gradients(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will ask this call for gradients: grad mode is on and a tensor the
    kernels differentiate (q, k, v, sinks) requires grad. Such a call needs a module with
    gradient kernels (spec `backward: true`) from its forward on."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def softmax_scale(scale: object, q: torch.Tensor) -> float:
    """The scale q.k is multiplied by: 1/sqrt(D) for None, else a finite float > 0."""
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if (type(scale) is float or type(scale) is int) and math.isfinite(scale) and scale > 0:
        return float(scale)
    if (
        isinstance(scale, (int, float))
        and not isinstance(scale, bool)
        and (math.isfinite(scale) and scale > 0)
    ):
        return float(scale)  # a subclass (numpy float64)
    raise ValueError(f"scale: expected a finite float > 0 or None, got {scale!r}")


def softcap_value(softcap: object) -> float:
    """The call's softcap as the float a module is built with: > 0 caps the scores at
    softcap * tanh(s / softcap); None, 0 and negative values are off (0.0), as in flash-attn,
    where only softcap > 0 activates it. NaN, inf and non-numbers raise a ValueError."""
    if type(softcap) is float and softcap > 0 and softcap != math.inf:
        return softcap
    if softcap is None:
        return 0.0
    if (
        isinstance(softcap, numbers.Real)
        and not isinstance(softcap, bool)
        and math.isfinite(softcap)
    ):
        cap = float(softcap)
        return cap if cap > 0 else 0.0  # 0, negative, an int, a numpy float
    raise ValueError(
        f"softcap: expected a finite float or None, got {softcap!r} (> 0 caps the scores; "
        "None, 0 or a negative value is off, as in flash-attn)"
    )


def seqlen_bound(value: object, name: str) -> int:
    """max_seqlen_q / max_seqlen_k as a Python int (an integral numpy or 0-d tensor value is
    taken, as flash-attn does); a ValueError names anything else. The module checks >= 0."""
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ValueError(f"{name}: expected a Python int >= 0, got {value!r}")


def check_rank4(q: object, k: object, v: object) -> None:
    """q, k and v are rank-4 tensors (the error names the first that is not)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a rank-4 tensor, got {got}")


def rank4(q: object, k: object, v: object) -> bool:
    """The success path of check_rank4, without building its loop."""
    return (
        type(q) is torch.Tensor
        and type(k) is torch.Tensor
        and type(v) is torch.Tensor
        and q.dim() == 4
        and k.dim() == 4
        and v.dim() == 4
    )


def check_causal_align(value: object) -> CausalAlign:
    """SDPA's causal_align argument as the spec's alignment."""
    if value == "top_left":
        return CausalAlign.top_left
    if value == "bottom_right":
        return CausalAlign.bottom_right
    allowed = ", ".join(a.value for a in CausalAlign)
    raise ValueError(f"causal_align: got {value!r}; allowed: {allowed}")


def window_pair(window: object, name: str) -> tuple[int, int]:
    """(left, right), ints >= 0."""
    if (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)
    ):
        return int(window[0]), int(window[1])
    raise ValueError(f"{name}: got {window!r}; allowed: (left, right), ints >= 0")


def flash_mask(causal: bool, window_size: object) -> tuple[Mask, tuple[int, int] | None]:
    """flash-attn's (causal, window_size) as a spec mask; -1 is an unbounded side."""
    if type(window_size) is tuple and window_size == _UNBOUNDED:
        return (Mask.causal, None) if causal else (Mask.none, None)
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and w >= -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size: got {window_size!r}; allowed: (left, right), ints >= -1 (-1: unbounded)"
        )
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        return (Mask.causal, None) if left < 0 else (Mask.sliding_window, (left, 0))
    if left < 0 and right < 0:
        return Mask.none, None
    return Mask.sliding_window, (INFINITE if left < 0 else left, INFINITE if right < 0 else right)


def dropout_probability(dropout_p: object) -> float:
    """dropout_p as a float in [0, 1): the probability of zeroing each attention probability
    (flash-attn's and SDPA's dropout_p). A module rounds it to steps of 1/65536."""
    if type(dropout_p) is float and 0.0 <= dropout_p < 1.0:
        return dropout_p
    if (
        isinstance(dropout_p, (int, float))
        and not isinstance(dropout_p, bool)
        and (0.0 <= dropout_p < 1.0)
    ):
        return float(dropout_p)  # 0, or a subclass (numpy float64)
    raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")


def dropout_rng_state(q: torch.Tensor) -> torch.Tensor:
    """The (seed, Philox offset) of one call's dropout mask, int64 [2] on q's device: a fresh
    seed from the default generator of q's device (CUDA: torch.cuda's, as flash-attn draws its
    Philox state), so two calls draw different masks and torch.manual_seed reproduces them.
    The forward and the backward of the call use the same state, so the backward regenerates
    the forward's mask."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    return torch.cat((seed, torch.zeros_like(seed)))


def no_attn_probs(q: torch.Tensor) -> torch.Tensor:
    """flash-attn 2's S_dmask for return_attn_probs=True without dropout: an empty tensor of
    q's dtype on q's device (its forward forms the probabilities only with dropout)."""
    return q.new_empty(0)


def attn_probs_rng_state(return_attn_probs: object, dropout_p: object, q: torch.Tensor):
    """The call's Philox state when it returns S_dmask (return_attn_probs with dropout_p > 0),
    drawn here so that S_dmask reads the mask of this very state (the same draw the launch
    makes otherwise); None for every other call, whose launch draws its own (and for a q
    that is no tensor, which the launch's checks refuse). S_dmask is a testing path formed
    eagerly after the launch (attn_probs.py): refused while torch.compile traces."""
    if not (return_attn_probs and dropout_p and dropout_probability(dropout_p)):
        return None
    if torch.compiler.is_compiling():
        raise ValueError(
            "return_attn_probs: True with dropout_p > 0 forms flash-attn's S_dmask, a "
            "testing path torch.compile does not trace; call it eagerly, or pass "
            "return_attn_probs=False"
        )
    return dropout_rng_state(q) if isinstance(q, torch.Tensor) else None


def check_kvcache_shapes(
    q, k_cache, v_cache, k, v, block_table, any_cache_batch: bool = False, cache_dtype=None
) -> None:
    """flash_attn_with_kvcache's tensors: q [B, Nq, HQ, D]; caches [B, L, HKV, D] (any
    number of rows with any_cache_batch: cache_batch_idx picks them; or pages
    [num_pages, page_size, HKV, D] with block_table int32 [B, max_pages]); k/v
    [B, Nnew, HKV, D/DV]; one dtype (the caches': cache_dtype, when not falsy: fp8) and
    device; HQ a multiple of HKV."""
    args = (q, k_cache, v_cache, k, v, block_table, any_cache_batch, cache_dtype)
    if not _kvcache_shapes_ok(*args):
        _name_kvcache_problem(*args)


def _kvcache_shapes_ok(q, k_cache, v_cache, k, v, block_table, any_cache_batch, cache_dtype):
    """The success path of check_kvcache_shapes: True only when every check of
    _name_kvcache_problem passes."""
    tensor = torch.Tensor
    if not (
        type(q) is tensor
        and type(k_cache) is tensor
        and type(v_cache) is tensor
        and q.dim() == 4
        and k_cache.dim() == 4
        and v_cache.dim() == 4
    ):
        return False
    batch, _, heads_q, dim = q.shape
    outer, rows, heads_kv, dim_k = k_cache.shape
    if block_table is None:
        if outer != batch and not any_cache_batch:
            return False
    elif not (
        type(block_table) is tensor
        and block_table.dim() == 2
        and block_table.shape[0] == batch
        and block_table.dtype == torch.int32
    ):
        return False
    dtype, device = q.dtype, q.device
    if not (
        dim_k == dim
        and v_cache.shape[:3] == k_cache.shape[:3]
        and heads_kv != 0
        and heads_q % heads_kv == 0
        and k_cache.dtype == (cache_dtype or dtype)
        and v_cache.dtype == (cache_dtype or dtype)
        and k_cache.device == device
        and v_cache.device == device
    ):
        return False
    if k is None and v is None:
        return True
    return (
        type(k) is tensor
        and type(v) is tensor
        and k.dim() == 4
        and v.dim() == 4
        and k.shape[0] == batch
        and k.shape[2] == heads_kv
        and k.shape[3] == dim
        and v.shape[:3] == k.shape[:3]
        and v.shape[3] == v_cache.shape[3]
        and k.dtype == dtype
        and v.dtype == dtype
        and k.device == device
        and v.device == device
    )


def _name_kvcache_problem(
    q, k_cache, v_cache, k, v, block_table, any_cache_batch, cache_dtype
) -> None:
    """Raise the error naming the first tensor check_kvcache_shapes refuses."""
    _rank4("q", q, "[batch, seqlen_q, nheads, headdim]")
    batch, _, heads_q, dim = q.shape
    cache_layout = "[batch, seqlen_cache, nheads_k, headdim]"
    if block_table is not None:
        cache_layout = "[num_blocks, page_block_size, nheads_k, headdim]"
    _rank4("k_cache", k_cache, cache_layout)
    _rank4("v_cache", v_cache, cache_layout.replace("headdim]", "headdim_v]"))
    outer, rows, heads_kv, _ = k_cache.shape
    if block_table is not None:
        if (
            not isinstance(block_table, torch.Tensor)
            or block_table.dim() != 2
            or block_table.shape[0] != batch
            or block_table.dtype != torch.int32
        ):
            raise ValueError(
                f"block_table: expected an int32 tensor [batch={batch}, "
                f"max_num_blocks_per_seq], got {_describe(block_table)}"
            )
    elif outer != batch and not any_cache_batch:
        raise ValueError(
            f"k_cache: expected [batch={batch}, seqlen_cache, nheads_k, "
            f"headdim={dim}] (batch as q's, or pass cache_batch_idx), "
            f"got {list(k_cache.shape)}"
        )
    _expect("k_cache", k_cache, [outer, rows, heads_kv, dim], cache_layout)
    _expect(
        "v_cache",
        v_cache,
        [outer, rows, heads_kv, None],
        cache_layout.replace("headdim]", "headdim_v]"),
    )
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"nheads: q has {heads_q} heads (dim 2) and k_cache {heads_kv}; q's "
            "must be a multiple of k_cache's (grouped-query attention)"
        )
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and values, or neither")
    if k is not None:
        _rank4("k", k, "[batch, seqlen_new, nheads_k, headdim]")
        _expect("k", k, [batch, None, heads_kv, dim], "[batch, seqlen_new, nheads_k, headdim]")
        _expect(
            "v",
            v,
            [batch, k.shape[1], heads_kv, v_cache.shape[3]],
            "[batch, seqlen_new, nheads_k, headdim_v]",
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        dtype = (cache_dtype or q.dtype) if name.endswith("cache") else q.dtype
        if t is not None and (t.dtype != dtype or t.device != q.device):
            raise ValueError(
                f"{name}: expected dtype {dtype} on device {q.device} (as q), got "
                f"dtype {t.dtype} on device {t.device}"
            )


def _rank4(name, t, layout) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(f"{name}: expected a rank-4 tensor {layout}, got {_describe(t)}")


def _expect(name, t, sizes, layout) -> None:
    if any(want is not None and want != got for want, got in zip(sizes, t.shape, strict=True)):
        wanted = "[" + ", ".join("*" if n is None else str(n) for n in sizes) + "]"
        raise ValueError(f"{name}: expected {wanted} ({layout}), got {list(t.shape)}")


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{list(t.shape)} {t.dtype}"
    return type(t).__name__
