"""flash-attn 2's `S_dmask`: what flash_attn_func and flash_attn_varlen_func return third with
return_attn_probs=True and dropout_p > 0, so that flash-attn's dropout tests can read the
dropout pattern and judge the output and gradients against it.

A testing path, as in flash-attn: formed after the call's kernels ran, in torch (fp32 scores,
memory O(B * HQ * Nq * Nk), several such tensors at once) plus one Triton launch for the keep
mask. The convention is flash-attn 2's forward's (its tests read it with
convert_flash_attn_S_to_softmax, normalize_flash_attn_S and `S_dmask >= 0`):

- shape [B, HQ, round128(Nq), round128(Nk)] (varlen: max_seqlen_q/k rounded), q's dtype; the
  rounded margin and, in varlen, the rows and keys past a sequence's lengths are 0;
- values exp(s - m): s the score as the kernels form it (scale, softcap, ALiBi; -inf where
  the mask hides the key), m the row's running maximum when flash-attn's forward reaches the
  key's block (blocks of flash_block_n(D) keys, visited from the last one back, so m is the
  maximum over the keys of this block and every later one); 0 where m is -inf;
- a dropped entry is negated: torch.signbit(S_dmask) is exactly the drop pattern (a dropped 0
  is -0.0, which `S_dmask >= 0` counts as kept, as flash-attn's own S_dmask does).

The keep mask is drawn by the serving module's own `_dropout_keep`, the helper its forward and
both backward kernels call, from the call's Philox state: the mask the kernels used.
Without dropout flash-attn returns an empty tensor there (no_attn_probs, arguments.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attngen.runtime.arguments import seqlen_bound, softmax_scale
from attngen.runtime.dispatch import Call, eager_only
from attngen.runtime.fallback import sequence_fits
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import last_dispatch
from attngen.spec import CausalAlign
from attngen.spec.masks import alibi_distance, visible

_ROUND = 128  # flash-attn 2 rounds S_dmask's sequence dims up to a multiple of 128
_KEEP_BLOCK = 64  # the keep kernel's tile (a multiple of the helper's 8 keys per Philox call)


def flash_block_n(head_dim: int) -> int:
    """The key-block width of flash-attn 2's forward with dropout at head dim `head_dim` (its
    tests' _get_block_size_n(device, head_dim, is_dropout=True, causal), the same on sm80,
    sm8x and sm90): the blocks S_dmask's running maxima step over. Head dims past flash-attn's
    256 keep its widest rows' 64."""
    if head_dim <= 32:
        return 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32
    return 64


_EAGER = "flash-attn's S_dmask is a testing path formed eagerly"


def _options(call: Call) -> tuple:
    return call.mask, call.window, call.softcap, call.alibi_slopes, call.dropout_p


@eager_only(_EAGER)
def dense_dmask(q, k, rng_state, call: Call):
    """S_dmask [B, HQ, round128(Nq), round128(Nk)] of flash_attn_func's call: q [B, Nq, HQ, D],
    k [B, Nk, HKV, D] as given, rng_state the call's Philox state, call its options (launch.py)."""
    mask, window, softcap, alibi_slopes, dropout_p = _options(call)
    scale = softmax_scale(call.scale, q)
    batch, seqlen_q, heads = q.shape[:3]
    seqlen_k = k.shape[1]
    with torch.no_grad():
        dmask = _zeros(q, batch, heads, seqlen_q, seqlen_k)
        keep = _keep_mask(rng_state, dropout_p, batch * heads, seqlen_q, seqlen_k, q.device)
        scores = _scores(
            q, k, mask=mask, window=window, softcap=softcap, slopes=alibi_slopes, scale=scale
        )
        probs = _block_probs(scores, flash_block_n(q.shape[-1]))
        keep = keep.view(batch, heads, seqlen_q, seqlen_k)
        dmask[:, :, :seqlen_q, :seqlen_k] = torch.where(keep, probs, -probs)
    return dmask


@eager_only(_EAGER)
def varlen_dmask(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, shape, rng_state, call: Call):
    """S_dmask [B, HQ, round128(max_seqlen_q), round128(max_seqlen_k)] of
    flash_attn_varlen_func's call: sequence b at [b, :, :len_q, :len_k], drawn as batch b (a
    sequence longer than max_seqlen_q/k, which the kernel may give NaN, cut to the shape); a
    sequence that leaves the packed tensors (NaN from the kernel) is NaN. shape:
    (max_seqlen_q, max_seqlen_k) as the caller gave them. Reads the index tensors on the
    host."""
    mask, window, softcap, alibi_slopes, dropout_p = _options(call)
    scale = softmax_scale(call.scale, q)
    shape = (seqlen_bound(shape[0], "max_seqlen_q"), seqlen_bound(shape[1], "max_seqlen_k"))
    batch, heads = cu_seqlens_q.shape[0] - 1, q.shape[1]
    spans = _spans(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k)
    with torch.no_grad():
        dmask = _zeros(q, batch, heads, *shape)
        longest_q = min(
            max((q1 - q0 for q0, q1, _, _ in spans.values()), default=0), dmask.shape[2]
        )
        longest_k = min(
            max((k1 - k0 for _, _, k0, k1 in spans.values()), default=0), dmask.shape[3]
        )
        keep = _keep_mask(rng_state, dropout_p, batch * heads, longest_q, longest_k, q.device)
        keep = keep.view(batch, heads, longest_q, longest_k)
        for b in range(batch):
            if b not in spans:
                dmask[b] = float("nan")
                continue
            q0, q1, k0, k1 = spans[b]
            slopes = alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[b]
            scores = _scores(
                q[None, q0:q1],
                k[None, k0:k1],
                mask=mask,
                window=window,
                softcap=softcap,
                slopes=slopes,
                scale=scale,
            )
            probs = _block_probs(scores[0], flash_block_n(q.shape[-1]))
            rows, width = min(q1 - q0, dmask.shape[-2]), min(k1 - k0, dmask.shape[-1])
            probs = probs[:, :rows, :width]
            dmask[b, :, :rows, :width] = torch.where(keep[b, :, :rows, :width], probs, -probs)
    return dmask


def _spans(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k) -> dict[int, tuple[int, ...]]:
    """{b: (first query row, end, first key row, end)} of the sequences inside the packed
    tensors (the others the kernel gives NaN), read on the host."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    spans: dict[int, tuple[int, ...]] = {}
    for b in range(len(starts_q) - 1):
        if sequence_fits(b, (q.shape[0], k.shape[0], starts_q, starts_k, q.shape[0], used)):
            length_k = used[b] if used is not None else starts_k[b + 1] - starts_k[b]
            spans[b] = (starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b] + length_k)
    return spans


def _zeros(q, batch, heads, seqlen_q, seqlen_k):
    rounded_q = -(-seqlen_q // _ROUND) * _ROUND
    rounded_k = -(-seqlen_k // _ROUND) * _ROUND
    return q.new_zeros((batch, heads, rounded_q, rounded_k))


def _scores(q, k, *, mask, window, softcap, slopes, scale):
    """[B, HQ, Nq, Nk] fp32 scores of q [B, Nq, HQ, D] and k [B, Nk, HKV, D], formed as the
    kernels form them: q.k * scale, softcap, minus slope * |i' - j| (ALiBi at flash-attn's
    bottom-right positions), -inf where the mask hides the key (masks.py's definitions)."""
    q = q.detach().float().transpose(1, 2)
    k = k.detach().float().transpose(1, 2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head h reads h // group
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    align = CausalAlign.bottom_right
    if slopes is not None:
        distance = alibi_distance(mask, align, seqlen_q, seqlen_k, q.device).float()
        slopes = slopes.float()
        slopes = slopes[:, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        scores = scores - slopes * distance
    seen = visible(mask, align, window, seqlen_q, seqlen_k, q.device)
    return scores if seen is None else scores.masked_fill(~seen, float("-inf"))


def _block_probs(scores, block_n: int):
    """exp(s - m) of scores [..., Nk], m the maximum over the key's block of block_n keys and
    every later block (flash-attn's running maximum, its key loop running from the last block
    back); 0 where m is -inf (a row that sees none of those keys)."""
    seqlen_k = scores.shape[-1]
    blocks = -(-seqlen_k // block_n)
    padded = torch.nn.functional.pad(scores, (0, blocks * block_n - seqlen_k), value=-torch.inf)
    block_max = padded.unflatten(-1, (blocks, block_n)).amax(-1)
    running = block_max.flip(-1).cummax(-1).values.flip(-1)
    running = running.repeat_interleave(block_n, dim=-1)[..., :seqlen_k]
    running = torch.where(torch.isinf(running), 0.0, running)  # -inf: every score here is -inf
    return torch.exp(scores - running)


def _keep_mask(rng_state, dropout_p, batch_heads, seqlen_q, seqlen_k, device):
    """[batch_heads, Nq, Nk] bool: which scores the serving module's kernels kept, for
    batch * HQ + head in [0, batch_heads), rows and keys from 0 (varlen: within a sequence)."""
    dispatch = last_dispatch()
    module = current_registry().module(dispatch.key) if dispatch and dispatch.key else None
    if module is None or not hasattr(module, "_dropout_keep"):  # dropout: true specs only
        served = dispatch.module if dispatch and dispatch.module else "the torch fallback"
        raise ValueError(
            "return_attn_probs: True with dropout_p > 0 reads the mask of a module built with "
            f"dropout: true; the call ran on {served}"
        )
    helper, threshold = module._dropout_keep, round(dropout_p * 2**module._DROP_BITS)
    keep = torch.empty((batch_heads, seqlen_q, seqlen_k), dtype=torch.int8, device=device)
    if keep.numel():
        grid = (batch_heads, triton.cdiv(seqlen_q, _KEEP_BLOCK), triton.cdiv(seqlen_k, _KEEP_BLOCK))
        _keep_kernel[grid](
            keep, rng_state, seqlen_q, seqlen_k, threshold, DROPOUT_KEEP=helper, BLOCK=_KEEP_BLOCK
        )
    return keep.bool()


@triton.jit
def _keep_kernel(
    Keep,
    RngState,
    seqlen_q,
    seqlen_k,
    drop_threshold,
    DROPOUT_KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Keep[batch_head, row, key] = 1 where DROPOUT_KEEP (a module's _dropout_keep) keeps the
    score: one BLOCK x BLOCK tile of one batch * HQ + head per program."""
    batch_head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key_start = tl.program_id(2) * BLOCK
    keys = key_start + tl.arange(0, BLOCK)
    seed = tl.load(RngState)
    philox_offset = tl.load(RngState + 1)
    keep = DROPOUT_KEEP(seed, philox_offset, batch_head, rows, key_start, drop_threshold, BLOCK)
    offsets = (batch_head.to(tl.int64) * seqlen_q + rows[:, None]) * seqlen_k + keys[None, :]
    inside = (rows[:, None] < seqlen_q) & (keys[None, :] < seqlen_k)
    tl.store(Keep + offsets, keep.to(tl.int8), mask=inside)
