"""Gradients of attention: the float64 golden (autograd through attngen.reference's scores) and
the yardstick of shared/RELIABILITY.md for dQ, dK, dV (the same math in the kernel's dtype).

The rule: a gradient's max error against the golden at most 3x the yardstick's plus a floor of
two ulps (four for fp32) at the gradient's magnitude, the mean error 1.5x plus the floor, and
no NaN where the golden has none. With a spec's `sinks`, the sink logits [HQ] get a gradient
too (fp32, so a floor of four fp32 ulps): the golden and the yardstick return it after dv.
With score_mod / mask_mod, every function takes the expressions' tensors= (and first_b=, as
attngen.reference.attention_scores); the trainable ones get gradients, returned last as
{name: gradient} and judged by tensor_gradient_problems.

This module imports torch; the build path never imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from attngen.reference import (
    LOG2E,
    alibi_distance,
    attention_scores,
    error_problems,
    ulp,
    visible_mask,
)
from attngen.spec import AttnSpec
from attngen.spec.expression_grad import gradients
from attngen.spec.expressions import declared, parsed, validity
from attngen.spec.masks import expression_values

# A dropout mask is applied as keep * keep_scale to the probabilities (None: no dropout).
Dropout = tuple[torch.Tensor, float] | None


def _sink_leaf(spec: AttnSpec, sinks):
    """The sinks as a float64 leaf that requires grad (None without the spec's sinks)."""
    if not spec.sinks:
        return None
    if sinks is None:
        raise ValueError("sinks: required by a spec with sinks: true")
    return sinks.detach().double().requires_grad_()


def golden_backward(spec: AttnSpec, q, k, v, dout, *, sm_scale=None, alibi_slopes=None,
                    dropout: Dropout = None, dlse=None, sinks=None,
                    tensors: Mapping[str, torch.Tensor] | None = None,
                    first_b: int = 0):  # fmt: skip
    """(out, lse, dq, dk, dv) in float64, by autograd through the plain formula; with the
    spec's sinks [HQ] (their logit joins every row's normaliser), dsinks after dv; with
    trainable tensors, {name: float64 gradient} last."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks64 = _sink_leaf(spec, sinks)
    trained = [t.name for t in spec.tensors if t.trainable]
    if tensors is not None:
        tensors = {
            n: t.detach().double().requires_grad_() if n in trained else t
            for n, t in tensors.items()
        }
    scores = attention_scores(
        spec, q64, k64, sm_scale=sm_scale, alibi_slopes=alibi_slopes, tensors=tensors,
        first_b=first_b,
    )  # fmt: skip
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
    tables = [(tensors or {})[n] for n in trained]
    wrt = (*leaves, *tables)  # a score_mod may read no score, a mask no table: zeros
    found = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(wrt, found, strict=True)]
    extra = (dict(zip(trained, grads[len(leaves) :], strict=True)),) if trained else ()
    return (out.detach(), lse.detach(), *grads[: len(leaves)], *extra)


def _log2_exponent(spec: AttnSpec, q, k, sm_scale, slopes, reverse: bool, exprs=None):
    """The kernels' log2-domain scores, each step rounded to fp32 as they round it (the scale
    folded into one multiply, the softcap's tanh, the ALiBi bias in log2 units, score_mod on
    the scaled score; -inf where masked, mask_mod too), q.k summed over d ascending or
    descending; and d score / d (scaled q.k) where not 1 (softcap's 1 - tanh^2, score_mod's
    derived gradient), else None. `exprs`: tensors= and first_b= of the expressions."""
    f32 = torch.float32
    kf = k.to(f32).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    qk = torch.zeros(*q.shape[:-1], kf.shape[2], dtype=f32, device=q.device)
    dims = range(q.shape[-1] - 1, -1, -1) if reverse else range(q.shape[-1])
    for d in dims:  # an fp32 FMA chain, in one order or the other
        qk = torch.addcmul(qk, q[..., d : d + 1].to(f32), kf[..., d][..., None, :])
    factor = None
    if spec.score_mod is not None:
        s = qk * torch.tensor(sm_scale, dtype=f32)
        exponent = _expression(spec, "score_mod", s, exprs) * torch.tensor(LOG2E, dtype=f32)
        factor = _expression(spec, "score_mod", s, exprs, derivative="score")
    elif spec.softcap:
        tanh = torch.tanh(qk * torch.tensor(sm_scale / spec.softcap, dtype=f32))
        exponent = tanh * torch.tensor(spec.softcap * LOG2E, dtype=f32)
        factor = 1 - tanh * tanh
    else:
        exponent = qk * torch.tensor(sm_scale * LOG2E, dtype=f32)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if spec.alibi:
        distance = alibi_distance(spec.mask, spec.causal_align, seqlen_q, seqlen_k, q.device)
        slope_log2 = slopes.to(f32) * torch.tensor(LOG2E, dtype=f32)
        exponent = exponent - slope_log2[None, :, None, None] * distance
    visible = visible_mask(spec, seqlen_q, seqlen_k, q.device)
    if spec.mask_mod is not None:
        visible = visible & _expression(spec, "mask_mod", qk, exprs)
    return exponent.masked_fill(~visible, float("-inf")), factor


def _expression(spec: AttnSpec, field: str, score, exprs, derivative: str = "") -> torch.Tensor:
    """The field's values on the [B, H, Nq, Nk] grid of `score` (fp32 for score_mod, the
    kernels' precision), or with `derivative` its derived gradient by that read (or "score")
    as the kernels evaluate it (attngen.spec.expression_grad; reads out of range give 0)."""
    tree = parsed(spec, field)
    assert tree is not None
    if derivative:
        tree = gradients(tree, declared(spec))[derivative]
    exprs = dict(exprs or {})
    return expression_values(
        field, tree, declared(spec), exprs.get("tensors") or {}, tuple(score.shape), score,
        score.dtype, exprs.get("first_b", 0), guarded=not derivative,
    )  # fmt: skip


def kernel_like_lse2(spec: AttnSpec, q, k, sm_scale, slopes, sinks=None, exprs=None):
    """LSE * log2 e as the backward kernels read it, in fp32: the forward's LSE (q.k summed in
    the other order; with sinks, the sink's term joins the sum against the larger of the row
    max and the sink, as fold_sink does), stored in natural log; +inf where it is -inf."""
    f32 = torch.float32
    forward, _ = _log2_exponent(spec, q, k, sm_scale, slopes, reverse=False, exprs=exprs)
    if forward.shape[-1]:
        row_max = forward.amax(-1)
    else:
        row_max = torch.full(forward.shape[:-1], float("-inf"), device=forward.device)
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


def kernel_like_probs(spec: AttnSpec, q, k, sm_scale, slopes, sinks=None, exprs=None):
    """P as the backward kernels get it, in fp32: exp2(exponent - LSE * log2 e), where the LSE
    came from a forward that summed q.k in another order and stored it in natural log; and
    d score / d s (_log2_exponent).

    Note: this is the yardstick's point. P = exp(S - LSE) with |S| large carries a few fp32
    ulps at the scores' magnitude as relative error (|S| ~ 300 gives ~4e-5), from these
    roundings and from S being recomputed; a natural-domain reference computing S once has
    none of it, and its error would be no measure of the kernels'."""
    lse2 = kernel_like_lse2(spec, q, k, sm_scale, slopes, sinks, exprs)
    exponent, factor = _log2_exponent(spec, q, k, sm_scale, slopes, reverse=True, exprs=exprs)
    return torch.exp2(exponent - lse2[..., None]), factor


def lowp_backward(spec: AttnSpec, q, k, v, dout, *, sm_scale=None, alibi_slopes=None,
                  dropout: Dropout = None, dlse=None, sinks=None,
                  tensors: Mapping[str, torch.Tensor] | None = None, first_b: int = 0):  # fmt: skip
    """(out, dq, dk, dv) by the kernels' math in the kernels' precision: fp32 scores and
    softmax on inputs of the kernel's dtype, O rounded to it (delta reads it), P and dS rounded
    to it before the dots into dV, dQ and dK, fp32 accumulation, results rounded once. With
    the spec's sinks, dsinks after dv: -sum of exp2(sink log2 e - LSE log2 e) * delta, fp32.
    With trainable tensors, their gradients last ({name: fp32 sum of dS x d score_mod / d T
    over the pairs that read each element})."""
    exprs = {"tensors": tensors, "first_b": first_b}
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    dtype, f32 = q.dtype, torch.float32
    group = q.shape[1] // k.shape[1]
    if spec.sinks and sinks is None:
        raise ValueError("sinks: required by a spec with sinks: true")
    p, factor = kernel_like_probs(spec, q, k, sm_scale, alibi_slopes, sinks, exprs)
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
    trained = _tensor_sums(spec, p, ds, q.to(f32) @ kf.transpose(-1, -2) * sm_scale, exprs)
    if factor is not None:  # a key the kernels do not see (P = 0) gets no gradient
        ds = torch.where(p != 0, ds * factor, 0.0)
    ds_low = ds.to(dtype).to(f32)
    dq = ds_low @ kf * sm_scale
    dk = ds_low.transpose(-1, -2) @ q.to(f32) * sm_scale
    dv = kept.to(dtype).to(f32).transpose(-1, -2) @ dout.to(f32)

    def fold(x):  # sum the query heads of each KV group
        b, h, n, d = x.shape
        return x.view(b, h // group, group, n, d).sum(2)

    grads = (dq.to(dtype), fold(dk).to(dtype), fold(dv).to(dtype))
    if not spec.sinks:
        return (out, *grads, *trained)
    lse2 = kernel_like_lse2(spec, q, k, sm_scale, alibi_slopes, sinks)
    sink_log2 = (sinks.to(f32) * torch.tensor(LOG2E, dtype=f32))[None, :, None]
    dsinks = -(torch.exp2(sink_log2 - lse2) * delta).sum((0, 2))
    return (out, *grads, dsinks, *trained)


def tensor_rows(spec: AttnSpec, weights, score, exprs) -> dict[str, torch.Tensor]:
    """Per trainable tensor T, [rows, T.numel()] (rows: the grid's B x H x Nq): the sum over
    each row's keys of weights x d score_mod / d T[i] (at the scaled scores `score`) at the
    element i each (row, key) reads, where `weights` [B, H, Nq, Nk] are nonzero and the read
    is in range (as the dK/dV kernel adds them), in weights' dtype. Summed over rows with
    weights = dS (0 where P is): d L / d T."""
    tree = parsed(spec, "score_mod")
    assert tree is not None
    tables, shape = dict(exprs.get("tensors") or {}), tuple(weights.shape)
    rows = shape[0] * shape[1] * shape[2]
    row = torch.arange(rows, device=weights.device).view(*shape[:3], 1).expand(shape)
    trained = [t.name for t in spec.tensors if t.trainable]
    out = {n: weights.new_zeros(rows * tables[n].numel()) for n in trained}
    reads = {str(n): n for n in tree.nodes() if n.op == "load"}

    def grid(node, dtype=torch.float64):  # reads out of range give 0, as the kernels load
        return expression_values(
            "index", node, declared(spec), tables, shape, score, dtype, exprs.get("first_b", 0),
            guarded=False,
        )  # fmt: skip

    for key, derivative in gradients(tree, declared(spec)).items():
        read = reads.get(key)
        if read is None:  # "score"
            continue
        name = str(read.value)
        flat = torch.zeros(shape, dtype=torch.int64, device=weights.device)
        for index, size in zip(read.args, tables[name].shape, strict=True):
            flat = flat * size + grid(index)
        bounds = validity(read, {t.name: t for t in declared(spec)})
        keep = (weights != 0) & (grid(bounds) if bounds is not None else True)
        values = torch.where(keep, weights * grid(derivative, weights.dtype), 0.0)
        target = torch.where(keep, row * tables[name].numel() + flat, 0)
        out[name].index_add_(0, target.flatten(), values.flatten())
    return {n: o.view(rows, tables[n].numel()) for n, o in out.items()}


def _tensor_sums(spec: AttnSpec, p, ds, score, exprs) -> tuple[dict[str, torch.Tensor], ...]:
    """(the trainable tensors' gradients as the kernels sum them: fp32, {name: [shape]},), or
    () without trainable tensors."""
    if not any(t.trainable for t in spec.tensors):
        return ()
    sums = tensor_rows(spec, torch.where(p != 0, ds, 0.0), score, exprs)
    tables = exprs.get("tensors") or {}
    return ({n: r.sum(0).view(tables[n].shape) for n, r in sums.items()},)


def gradient_problems(name: str, got, golden, lowp, *, factor: float = 3.0) -> list[str]:
    """RELIABILITY.md's rule for one gradient; [] if it holds."""
    if golden.numel() == 0:
        return []
    if torch.isnan(got).any() and not torch.isnan(golden).any():
        return [f"{name}: NaN where the golden has none"]
    floor_ulps = 4 if got.dtype == torch.float32 else 2
    return error_problems(
        name, got.double(), golden, lowp.double(), factor, got.dtype, 0.0, floor_ulps
    )


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


def compare_gradients(spec: AttnSpec, grads, q, k, v, dout, *, sm_scale=None, alibi_slopes=None,
                      dropout: Dropout = None, dlse=None, sinks=None,
                      tensors: Mapping[str, torch.Tensor] | None = None,
                      first_b: int = 0) -> list[str]:  # fmt: skip
    """What is wrong with a kernel's (dq, dk, dv), or (dq, dk, dv, dsinks) with the spec's
    sinks (then `sinks` is required; with three gradients, d sinks is the caller's to judge,
    as for packed sequences, whose sum it is), then with trainable tensors {name: gradient}
    (tensor_gradient_problems); [] if nothing. Rows that see no key must have a zero dQ."""
    exprs: dict[str, Any] = {"tensors": tensors, "first_b": first_b}
    options = dict(
        sm_scale=sm_scale, alibi_slopes=alibi_slopes, dropout=dropout, dlse=dlse, sinks=sinks
    )
    golden = golden_backward(spec, q, k, v, dout, **options, **exprs)
    lowp = lowp_backward(spec, q, k, v, dout, **options, **exprs)
    expected: tuple[str, ...] = ("dq", "dk", "dv", "dsinks")[: 4 if spec.sinks else 3]
    expected += ("dtensors",) if any(t.trainable for t in spec.tensors) else ()
    if len(grads) not in (3, len(expected)):
        return [f"grads: expected {', '.join(expected)}, got {len(grads)} tensors"]
    names = expected[: len(grads)]
    problems = []
    for name, got, gold, low in zip(
        names, grads, golden[2 : 2 + len(names)], lowp[1 : 1 + len(names)], strict=True
    ):
        if name == "dtensors":
            problems += tensor_gradient_problems(
                spec, got, gold, low, (q, k, dout, golden[0], lowp[0]), sm_scale, exprs
            )
        elif got.shape != gold.shape:
            problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(gold.shape)}")
        elif name == "dsinks":
            problems += sink_gradient_problems(
                got, gold, golden[0], golden[1], lowp[0], dout, sinks
            )
        else:
            problems += gradient_problems(name, got, gold, low)
    # Rows that see no key (with sinks their LSE is the sink's, finite, so read the mask)
    visible = visible_mask(spec, q.shape[2], k.shape[2], q.device)
    if spec.score_mod is not None or spec.mask_mod is not None:
        scores = attention_scores(spec, q, k, sm_scale=sm_scale, alibi_slopes=alibi_slopes, **exprs)
        visible = torch.isfinite(scores)
    blind = (~visible.any(-1)).expand(grads[0].shape[:3])
    if blind.any() and not torch.all(grads[0][blind] == 0):
        problems.append("dq: a row that sees no key has a nonzero gradient")
    return problems


# Note: d L / d T[i] of a trainable tensor is, like d sinks, a sum over many (row, key) pairs
# of dS x d score_mod / d T[i], and dS = P (dP - delta) carries each row's delta = dO . O, so
# every element sums the rounding errors of the O rows that read it, projected on dO: one
# draw of a sum of many independent terms per element, which the kernel's O (within 2x of the
# yardstick's, by the forward rule) and the yardstick's O draw differently. The bound per
# element adds to the gradient rule (3x the yardstick's max error plus the floor, which
# covers P's fp32 rounding and the fp32 sums, the kernels' atomics in any order)
# TENSOR_GRADIENT_SIGMAS standard deviations of that sum, with the yardstick's own O errors as
# each O element's spread: sigma_i^2 = sum over rows r of (sum over r's keys that read i of
# P x d score_mod / d T[i])^2 x sum_d dO_rd^2 (O_low - O_golden)_rd^2 (tensor_rows). 6 as
# for d sinks: the forward rule's 1.5x of the kernel's O errors over the yardstick's, times
# 4 sigma. A wrong pair set or derivative is off by the gradient's own magnitude. Measured
# (a relative bias table, 2 x 4 heads x 40 x 40, 18 draws): the kernel's max error was up to
# 2.8x the yardstick's (16-bit: the plain 3x rule would be a coin toss) and up to 3.3 sigma
# per element; fp32's P rounding is 10-17 sigma for both, and the kernel within 1.4x.
TENSOR_GRADIENT_SIGMAS = 6.0


def tensor_gradient_problems(spec: AttnSpec, got, golden, lowp, arrays, sm_scale, exprs):
    """The rule for the trainable tensors' gradients ({name: gradient} each; the note above);
    `arrays`: q, k, dout, and the golden's and the yardstick's out; [] if it holds."""
    if sorted(got) != sorted(golden):
        return [f"dtensors: got {sorted(got)}, expected {sorted(golden)}"]
    sigmas = tensor_gradient_sigmas(spec, *arrays, sm_scale=sm_scale, exprs=exprs)
    return [
        problem
        for name in golden
        for problem in tensor_problems(name, got[name], golden[name], lowp[name], sigmas[name])
    ]


def tensor_gradient_sigmas(
    spec: AttnSpec, q, k, dout, golden_out, lowp_out, *, sm_scale=None, exprs
) -> dict[str, torch.Tensor]:
    """{name: sigma} of each trainable tensor's gradient (the note above), float64."""
    scores = attention_scores(spec, q, k, sm_scale=sm_scale, **exprs)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    p = torch.exp(scores - lse.where(torch.isfinite(lse), 0.0)).nan_to_num(0.0)
    kf = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = q.double() @ kf.transpose(-1, -2) * sm_scale
    spread = ((lowp_out.double() - golden_out.double()) ** 2 * dout.double() ** 2).sum(-1)
    tables = exprs.get("tensors") or {}
    return {
        name: ((rows**2) * spread.reshape(-1, 1)).sum(0).sqrt().view(tables[name].shape)
        for name, rows in tensor_rows(spec, p, s, exprs).items()
    }


def tensor_problems(name, got, golden, lowp, sigma) -> list[str]:
    """One trainable tensor's gradient against its golden, yardstick and sigma (the note)."""
    if got.shape != golden.shape:
        return [f"d{name}: shape {tuple(got.shape)}, expected {tuple(golden.shape)}"]
    if torch.isnan(got).any() and not torch.isnan(golden).any():
        return [f"d{name}: NaN where the golden has none"]
    floor = (4 if got.dtype == torch.float32 else 2) * ulp(got.dtype, golden.abs().max().item())
    err = (got.double() - golden).abs()
    bound = 3 * (lowp.double() - golden).abs().max().item() + TENSOR_GRADIENT_SIGMAS * sigma
    bound = bound + floor
    if bool((err <= bound).all()):
        return []
    i = int((err / bound).flatten().argmax())
    e, b, sd = (x.flatten()[i].item() for x in (err, bound, sigma))
    return [f"d{name}: element {i} error {e:.3e} > {b:.3e} (sigma {sd:.3e}, floor {floor:.1e})"]
