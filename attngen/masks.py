"""Which keys a query sees, and how far it is from each for ALiBi: the one definition of
the spec's masks and of ALiBi's distance convention, in torch.

Used by the torch fallback (attngen/runtime/fallback.py) and by the float64 oracle
(attngen/reference.py), so that the kernels' tests and the runtime's fallback cannot disagree
on what a mask means. It lives outside attngen.runtime because importing any runtime module
runs the runtime package (the registry, the dispatcher, Triton): the oracle, which the tests,
the verifier and the tuner import, needs torch and the spec only. Not on the build path
(spec -> generated/), which imports no torch.
"""

from __future__ import annotations

import torch

from attngen.spec import CausalAlign, Mask


def visible(
    mask: Mask | str,
    align: CausalAlign | str | None,
    window: tuple[int, int] | None,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str | None = None,
    *,
    chunk_size: int | None = None,
    sink_tokens: int | None = None,
) -> torch.Tensor | None:
    """[Nq, Nk] bool, True where query row i may see key j; None for mask none (every key).

    Positions are compared at i' = i + (Nk - Nq) under bottom_right alignment (the KV-cache
    diagonal), i' = i under top_left. causal: j <= i'. sliding_window (left, right):
    i' - left <= j <= i' + right; with sink_tokens k the first k keys ignore the left side
    (j < k and j <= i' + right: StreamingLLM's always-visible first tokens). chunked
    (chunk_size C): j <= i' and j // C == i' // C (causal inside each chunk of C aligned
    positions, Llama 4's chunked attention)."""
    if mask == Mask.none:
        return None
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    if align == CausalAlign.bottom_right:
        i = i + (seqlen_k - seqlen_q)
    if mask == Mask.causal:
        return j <= i
    if mask == Mask.chunked:
        if chunk_size is None or chunk_size < 1:
            raise ValueError(
                f"chunk_size: got {chunk_size!r}; allowed: an int >= 1 with mask chunked"
            )
        return (j <= i) & (
            torch.div(j, chunk_size, rounding_mode="floor")
            == torch.div(i, chunk_size, rounding_mode="floor")
        )
    if mask != Mask.sliding_window or window is None:
        raise ValueError(
            f"mask: got {mask!r} with window {window!r}; allowed: none, causal, "
            "sliding_window with (left, right), chunked with chunk_size"
        )
    left, right = window
    seen = (j >= i - left) & (j <= i + right)
    if sink_tokens:
        seen = seen | ((j < sink_tokens) & (j <= i + right))
    return seen


def alibi_distance(
    mask: Mask | str,
    align: CausalAlign | str | None,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[Nq, Nk] |i' - j|, the distance ALiBi's bias is proportional to. With a mask, i'
    follows its alignment; without one, i' = i + (Nk - Nq): bottom-right, flash-attn's
    convention (the queries are the last Nq positions of the keys' sequence)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    bottom_right = mask == Mask.none or align == CausalAlign.bottom_right
    return (i + (seqlen_k - seqlen_q if bottom_right else 0) - j).abs()
