"""Argument conventions the public functions share, each checked once per call.

The softmax scale, the softcap, flash-attn's (causal, window_size) as a spec mask, SDPA's
causal_align, rank checks, and the refusals of features no generated kernel has. A check that
passes builds no string: messages are formatted only when a check fails.
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
