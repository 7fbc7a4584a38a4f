"""Gradients of attention: the float64 golden (autograd through attngen.reference's scores) and
the yardstick of shared/RELIABILITY.md for dQ, dK, dV (the same math in the kernel's dtype).

The rule: a gradient's max error against the golden at most 3x the yardstick's plus a floor of
two ulps (four for fp32) at the gradient's magnitude, the mean error 1.5x plus the floor, and
no NaN where the golden has none. With a spec's `sinks`, the sink logits [HQ] get a gradient
too (fp32, so a floor of four fp32 ulps): the golden and the yardstick return it after dv.

This module imports torch; the build path never imports it.
"""

from __future__ import annotations

import math

import torch

from attngen.reference import LOG2E, alibi_distance, attention_scores, ulp, visible_mask
from attngen.spec import AttnSpec

# A dropout mask is applied as keep * keep_scale to the probabilities (None: no dropout).
Dropout = tuple[torch.Tensor, float] | None


def _sink_leaf(spec: AttnSpec, sinks):
    """The sinks as a float64 leaf that requires grad (None without the spec's sinks)."""
    if not spec.sinks:
        return None
    if sinks is None:
        raise ValueError("sinks: required by a spec with sinks: true")
    return sinks.detach().double().requires_grad_()


def golden_backward(
    spec: AttnSpec,
    q,
    k,
    v,
    dout,
    *,
    sm_scale=None,
    alibi_slopes=None,
    dropout: Dropout = None,
    dlse=None,
    sinks=None,
):
    """(out, lse, dq, dk, dv) in float64, by autograd through the plain formula; with the
    spec's sinks [HQ] (their logit joins every row's normaliser), dsinks after dv."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks64 = _sink_leaf(spec, sinks)
    scores = attention_scores(spec, q64, k64, sm_scale=sm_scale, alibi_slopes=alibi_slopes)
    lse = torch.logsumexp(scores, dim=-1)
    if sinks64 is not None:
        lse = torch.logaddexp(lse, sinks64[None, :, None].expand_as(lse))
    finite = torch.isfinite(lse)
    p = torch.where(
        finite[..., None], torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]), 0.0
    )
    if dropout is not None:
        p = p * dropout[0] * dropout[1]
    group = q.shape[1] // k.shape[1]
    out = p @ v64.repeat_interleave(group, dim=1)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(finite, lse, 0.0) * dlse.double()).sum()
    leaves = (q64, k64, v64) if sinks64 is None else (q64, k64, v64, sinks64)
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves))


def _log2_exponent(spec: AttnSpec, q, k, sm_scale, slopes, reverse: bool):
    """The kernels' log2-domain scores, each step rounded to fp32 as they round it (the scale
    folded into one multiply, the softcap's tanh, the ALiBi bias in log2 units; -inf where
    masked), q.k summed over d ascending or descending; and tanh of the softcap."""
    f32 = torch.float32
    kf = k.to(f32).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    qk = torch.zeros(*q.shape[:-1], kf.shape[2], dtype=f32)
    dims = range(q.shape[-1] - 1, -1, -1) if reverse else range(q.shape[-1])
    for d in dims:  # an fp32 FMA chain, in one order or the other
        qk = torch.addcmul(qk, q[..., d : d + 1].to(f32), kf[..., d][..., None, :])
    tanh = None
    if spec.softcap:
        tanh = torch.tanh(qk * torch.tensor(sm_scale / spec.softcap, dtype=f32))
        exponent = tanh * torch.tensor(spec.softcap * LOG2E, dtype=f32)
    else:
        exponent = qk * torch.tensor(sm_scale * LOG2E, dtype=f32)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if spec.alibi:
        distance = alibi_distance(spec.mask, spec.causal_align, seqlen_q, seqlen_k).to(f32)
        slope_log2 = slopes.to(f32) * torch.tensor(LOG2E, dtype=f32)
        exponent = exponent - slope_log2[None, :, None, None] * distance
    visible = visible_mask(spec, seqlen_q, seqlen_k)
    return exponent.masked_fill(~visible, float("-inf")), tanh


def kernel_like_lse2(spec: AttnSpec, q, k, sm_scale, slopes, sinks=None):
    """LSE * log2 e as the backward kernels read it, in fp32: the forward's LSE (q.k summed in
    the other order; with sinks, the sink's term joins the sum against the larger of the row
    max and the sink, as fold_sink does), stored in natural log; +inf where it is -inf."""
    f32 = torch.float32
    forward, _ = _log2_exponent(spec, q, k, sm_scale, slopes, reverse=False)
    if forward.shape[-1]:
        row_max = forward.amax(-1)
    else:
        row_max = torch.full(forward.shape[:-1], float("-inf"))
    sink_log2 = None
    if spec.sinks:
        sink_log2 = (sinks.to(f32) * torch.tensor(LOG2E, dtype=f32))[None, :, None]
        row_max = torch.maximum(row_max, sink_log2.expand_as(row_max))
    finite = torch.isfinite(row_max)
    m_safe = torch.where(finite, row_max, 0.0)
    total = torch.exp2(forward - m_safe[..., None]).sum(-1)
    if sink_log2 is not None:
        total = total + torch.exp2(sink_log2 - m_safe)
    lse = (m_safe + torch.log2(torch.where(finite, total, 1.0))) / torch.tensor(LOG2E, dtype=f32)
    return torch.where(finite, lse * torch.tensor(LOG2E, dtype=f32), float("inf"))


def kernel_like_probs(spec: AttnSpec, q, k, sm_scale, slopes, sinks=None):
    """P as the backward kernels get it, in fp32: exp2(exponent - LSE * log2 e), where the LSE
    came from a forward that summed q.k in another order and stored it in natural log.

    Note: this is the yardstick's point. P = exp(S - LSE) with |S| large carries a few fp32
    ulps at the scores' magnitude as relative error (|S| ~ 300 gives ~4e-5), from these
    roundings and from S being recomputed; a natural-domain reference computing S once has
    none of it, and its error would be no measure of the kernels'."""
    lse2 = kernel_like_lse2(spec, q, k, sm_scale, slopes, sinks)
    exponent, tanh = _log2_exponent(spec, q, k, sm_scale, slopes, reverse=True)
    return torch.exp2(exponent - lse2[..., None]), tanh


def lowp_backward(
    spec: AttnSpec,
    q,
    k,
    v,
    dout,
    *,
    sm_scale=None,
    alibi_slopes=None,
    dropout: Dropout = None,
    dlse=None,
    sinks=None,
):
    """(out, dq, dk, dv) by the kernels' math in the kernels' precision: fp32 scores and
    softmax on inputs of the kernel's dtype, O rounded to it (delta reads it), P and dS rounded
    to it before the dots into dV, dQ and dK, fp32 accumulation, results rounded once. With
    the spec's sinks, dsinks after dv: -sum of exp2(sink log2 e - LSE log2 e) * delta, fp32."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    dtype, f32 = q.dtype, torch.float32
    group = q.shape[1] // k.shape[1]
    if spec.sinks and sinks is None:
        raise ValueError("sinks: required by a spec with sinks: true")
    p, tanh = kernel_like_probs(spec, q, k, sm_scale, alibi_slopes, sinks)
    kept = p if dropout is None else p * dropout[0] * dropout[1]
    vf = v.to(f32).repeat_interleave(group, dim=1)
    kf = k.to(f32).repeat_interleave(group, dim=1)
    out = (kept.to(dtype).to(f32) @ vf).to(dtype)
    delta = (dout.to(f32) * out.to(f32)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(f32)
    dp = dout.to(f32) @ vf.transpose(-1, -2)
    if dropout is not None:
        dp = dp * dropout[0] * dropout[1]
    ds = p * (dp - delta[..., None])
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    ds_low = ds.to(dtype).to(f32)
    dq = ds_low @ kf * sm_scale
    dk = ds_low.transpose(-1, -2) @ q.to(f32) * sm_scale
    dv = kept.to(dtype).to(f32).transpose(-1, -2) @ dout.to(f32)

    def fold(x):  # sum the query heads of each KV group
        b, h, n, d = x.shape
        return x.view(b, h // group, group, n, d).sum(2)

    grads = (dq.to(dtype), fold(dk).to(dtype), fold(dv).to(dtype))
    if not spec.sinks:
        return (out, *grads)
    lse2 = kernel_like_lse2(spec, q, k, sm_scale, alibi_slopes, sinks)
    sink_log2 = (sinks.to(f32) * torch.tensor(LOG2E, dtype=f32))[None, :, None]
    dsinks = -(torch.exp2(sink_log2 - lse2) * delta).sum((0, 2))
    return (out, *grads, dsinks)


def gradient_problems(name: str, got, golden, lowp, *, factor: float = 3.0) -> list[str]:
    """RELIABILITY.md's rule for one gradient; [] if it holds."""
    if golden.numel() == 0:
        return []
    if torch.isnan(got).any() and not torch.isnan(golden).any():
        return [f"{name}: NaN where the golden has none"]
    floor_ulps = 4 if got.dtype == torch.float32 else 2
    floor = floor_ulps * ulp(got.dtype, golden.abs().max().item())
    err = (got.double() - golden).abs()
    lowp_err = (lowp.double() - golden).abs()
    max_bound = factor * lowp_err.max().item() + floor
    mean_bound = 1.5 * lowp_err.mean().item() + floor
    problems = []
    if not err.max().item() <= max_bound:
        problems.append(
            f"{name}: max error {err.max().item():.3e} > {max_bound:.3e} "
            f"(lowp {lowp_err.max().item():.3e}, floor {floor:.1e})"
        )
    if not err.mean().item() <= mean_bound:
        problems.append(
            f"{name}: mean error {err.mean().item():.3e} > {mean_bound:.3e} "
            f"(lowp {lowp_err.mean().item():.3e}, floor {floor:.1e})"
        )
    return problems


# Note: d sink_h = -sum over head h's rows of p_sink,r x (dO_r . O_r) sums the rounding errors
# of every O element of the head, projected on dO: each value's error is one draw of a sum of
# many independent terms, and there is one value per head (4-8 in the tests), so neither the
# yardstick's max nor its mean over heads is stable (a kernel whose O is as accurate as the
# yardstick's had 2.2x its d sinks mean error over 4 heads; per head the two were 0.5-2.6
# standard deviations of that sum). The bound is per head: SINK_GRADIENT_SIGMAS standard
# deviations of the sum with the yardstick's own O errors as the per-element spread, plus the
# floor; 6 leaves the 1.5x the forward rule allows a kernel's O errors over the yardstick's
# times 4 sigma. A wrong row set or term is off by the magnitude of d sinks, far above it.
SINK_GRADIENT_SIGMAS = 6.0


def sink_gradient_problems(got, golden, golden_out, golden_lse, lowp_out, dout, sinks) -> list[str]:
    """The rule for d sinks [HQ] (the note above); [] if it holds."""
    if torch.isnan(got).any() and not torch.isnan(golden).any():
        return ["dsinks: NaN where the golden has none"]
    finite = torch.isfinite(golden_lse)
    p_sink = torch.exp(sinks.double()[None, :, None] - golden_lse.double().where(finite, 0.0))
    p_sink = p_sink.where(finite, 0.0)
    spread = (lowp_out.double() - golden_out.double()) ** 2 * dout.double() ** 2
    sigma = ((p_sink**2)[..., None] * spread).sum((0, 2, 3)).sqrt()
    floor = 4 * ulp(torch.float32, golden.abs().max().item())
    err = (got.double() - golden).abs()
    bound = SINK_GRADIENT_SIGMAS * sigma + floor
    if bool((err <= bound).all()):
        return []
    worst = int((err / bound).argmax())
    return [
        f"dsinks: head {worst} error {err[worst].item():.3e} > {bound[worst].item():.3e} "
        f"({SINK_GRADIENT_SIGMAS:g} x sigma {sigma[worst].item():.3e} + floor {floor:.1e})"
    ]


def compare_gradients(
    spec: AttnSpec,
    grads,
    q,
    k,
    v,
    dout,
    *,
    sm_scale=None,
    alibi_slopes=None,
    dropout: Dropout = None,
    dlse=None,
    sinks=None,
) -> list[str]:
    """What is wrong with a kernel's (dq, dk, dv), or (dq, dk, dv, dsinks) with the spec's
    sinks (then `sinks` is required; with three gradients, d sinks is the caller's to judge,
    as for packed sequences, whose sum it is); [] if nothing. Rows that see no key must have
    a zero dQ."""
    options = dict(
        sm_scale=sm_scale, alibi_slopes=alibi_slopes, dropout=dropout, dlse=dlse, sinks=sinks
    )
    golden = golden_backward(spec, q, k, v, dout, **options)
    lowp = lowp_backward(spec, q, k, v, dout, **options)
    expected = ("dq", "dk", "dv", "dsinks") if spec.sinks else ("dq", "dk", "dv")
    if len(grads) not in (3, len(expected)):
        return [f"grads: expected {', '.join(expected)}, got {len(grads)} tensors"]
    names = expected[: len(grads)]
    problems = []
    for name, got, gold, low in zip(
        names, grads, golden[2 : 2 + len(names)], lowp[1 : 1 + len(names)], strict=True
    ):
        if got.shape != gold.shape:
            problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(gold.shape)}")
            continue
        if name == "dsinks":
            problems += sink_gradient_problems(
                got, gold, golden[0], golden[1], lowp[0], dout, sinks
            )
        else:
            problems += gradient_problems(name, got, gold, low)
    # Rows that see no key (with sinks their LSE is the sink's, finite, so read the mask)
    blind = ~visible_mask(spec, q.shape[2], k.shape[2]).any(-1)
    if blind.any() and not torch.all(grads[0][:, :, blind] == 0):
        problems.append("dq: a row that sees no key has a nonzero gradient")
    return problems
