"""The float64 oracle: attention with exactly a spec's semantics, written for clarity, not speed.

Also the "same math in low precision" reference that tolerances are measured against
(`shared/RELIABILITY.md`): the same steps with inputs in the kernel's dtype, scores and softmax
in fp32, P cast to the input dtype before P @ V, as FlashAttention kernels do.

This module imports torch; the build path never imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from attngen.spec import AttnSpec
from attngen.spec.expressions import declared, parsed
from attngen.spec.masks import alibi_distance, expression_values, visible


def visible_mask(spec: AttnSpec, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """[Nq, Nk] bool: which key j query row i may see (attngen.spec.masks.visible, the runtime's
    definition too; every key for mask none)."""
    extra = {"chunk_size": spec.chunk_size, "sink_tokens": spec.sink_tokens}
    seen = visible(spec.mask, spec.causal_align, spec.window, seqlen_q, seqlen_k, device, **extra)
    if seen is None:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    return seen


def attention_scores(spec: AttnSpec, q: torch.Tensor, k: torch.Tensor, *,
                     sm_scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
                     compute_dtype: torch.dtype = torch.float64,
                     tensors: Mapping[str, torch.Tensor] | None = None, first_b: int = 0,
                     first_q: int = 0,
                     key_mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """[B, Hq, Nq, Nk] scores after scale, softcap, ALiBi, score_mod and the masks (the spec's,
    mask_mod's and key_mask's, [B or 1, Nq, Nk] bool: decode's tree_mask over a step's own
    keys; -inf where masked). `tensors`: what the expressions read; `first_b`: the batch index
    of q's first row (a varlen sequence compared on its own), `first_q` q_idx of its first
    query (a decode step's: L_b - NQ)."""
    sequential = compute_dtype == torch.float32 and q.dtype == torch.float32
    q, k = q.to(compute_dtype), k.to(compute_dtype)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head h reads h // group
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    scores = _matmul(q, k.transpose(-1, -2), sequential) * scale
    if spec.softcap:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if spec.alibi:
        if alibi_slopes is None:
            raise ValueError("alibi_slopes: required by a spec with alibi: true")
        distance = alibi_distance(spec.mask, spec.causal_align, seqlen_q, seqlen_k, q.device).to(
            compute_dtype
        )
        scores = scores - alibi_slopes.to(compute_dtype)[None, :, None, None] * distance
    visible = visible_mask(spec, seqlen_q, seqlen_k, q.device)
    if spec.score_mod is not None or spec.mask_mod is not None:
        scores, visible = _expressions(spec, scores, visible, tensors, first_b, first_q)
    if key_mask is not None:
        visible = visible & key_mask.to(q.device)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def _expressions(spec, scores, visible, tensors, first_b, first_q):
    """score_mod on the scaled scores and mask_mod ANDed into `visible`, on index grids
    (attngen.spec.masks.expression_values: the kernel's meaning)."""
    names = [t.name for t in spec.tensors]
    if sorted(tensors or {}) != sorted(names):
        raise ValueError(f"tensors: got {sorted(tensors or {})}; allowed: exactly {names}")
    shape = tuple(scores.shape)
    for field in ("score_mod", "mask_mod"):
        tree = parsed(spec, field)
        if tree is None:
            continue
        args = (tree, declared(spec), tensors or {}, shape, scores, scores.dtype, first_b)
        values = expression_values(field, *args, first_q=first_q)
        if field == "score_mod":
            scores = values
        else:
            visible = visible & values
    return scores, visible


def reference_attention(spec: AttnSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        sm_scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None,
                        compute_dtype: torch.dtype = torch.float64,
                        tensors: Mapping[str, torch.Tensor] | None = None, first_b: int = 0,
                        first_q: int = 0,
                        key_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out [B, Hq, Nq, Dv], lse [B, Hq, Nq]) in float64 by default.

    With compute_dtype=float32 and inputs in a 16-bit dtype, this is the low-precision
    reference: q.k and softmax in fp32 on the 16-bit inputs, P rounded to the input dtype.
    Fully masked rows give output 0 and LSE -inf. With `spec.sinks`, `sinks` [Hq] is one
    more logit per head in every row's softmax (natural-log units, after scale, softcap and
    bias; it takes no value): the normaliser gains exp(sink_h), so the LSE includes it, and
    a fully masked row gives output 0 and LSE sink_h.
    """
    scores = attention_scores(
        spec, q, k, sm_scale=sm_scale, alibi_slopes=alibi_slopes, compute_dtype=compute_dtype,
        tensors=tensors, first_b=first_b, first_q=first_q, key_mask=key_mask,
    )  # fmt: skip
    v_full = v.to(compute_dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    lse = torch.logsumexp(scores, dim=-1)
    if spec.sinks:
        if sinks is None:
            raise ValueError("sinks: required by a spec with sinks: true")
        sink = sinks.to(compute_dtype)[None, :, None].expand_as(lse)
        lse = torch.logaddexp(lse, sink)  # logaddexp(-inf, s) = s: the masked rows' LSE
    # Rows with no visible key: lse is -inf; define their probabilities as 0 (output 0).
    finite = torch.isfinite(lse)
    shifted = scores - torch.where(finite, lse, 0.0)[..., None]
    probs = torch.where(finite[..., None], torch.exp(shifted), 0.0)
    if compute_dtype != torch.float64 and q.dtype != torch.float32:
        probs = probs.to(q.dtype).to(compute_dtype)
    sequential = compute_dtype == torch.float32 and q.dtype == torch.float32
    return _matmul(probs, v_full, sequential), lse


def _matmul(a: torch.Tensor, b: torch.Tensor, sequential: bool) -> torch.Tensor:
    """a @ b; `sequential` accumulates over the inner dimension one term at a time.

    Note: an fp32 kernel's IEEE dot is a chain of fp32 FMAs, one term after another; its
    rounding error grows with the inner dimension faster than a blocked BLAS matmul's. The
    low-precision reference for fp32 kernels accumulates the same way, so that it measures
    "the same math in the kernel's dtype" (for long key sequences it falls back to matmul).
    """
    if not sequential or a.shape[-1] > 4096:
        return torch.matmul(a, b)
    out = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
    for i in range(a.shape[-1]):
        out = torch.addcmul(out, a[..., :, i : i + 1], b[..., i : i + 1, :])
    return out


def lowp_reference(spec: AttnSpec, q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math in the kernel's precision; its error is the yardstick for the kernel's."""
    out, lse = reference_attention(spec, q, k, v, compute_dtype=torch.float32, **kwargs)
    return out.to(q.dtype), lse


LOG2E = 1.4426950408889634
_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of `dtype` numbers at `magnitude`."""
    mantissa = _MANTISSA_BITS[dtype]
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 2.0**-mantissa
    return 2.0 ** (math.floor(math.log2(magnitude)) - mantissa)


# Note: the kernels run softmax in the log2 domain: an fp32 kernel rounds s * log2(e) to fp32 at
# the scores' magnitude before exp2, which the fp32 reference (exp(s - lse), sequential sums)
# does not, so that reference's error is no yardstick for this part: p is off by up to about
# |s| * log2(e) * 2**-24 relative, a few output ulps. Hypothesis found a 16-key fp32 decode
# case at 7 ulps (reference 2.3 ulps) on which the prefill kernel gives bitwise the same
# output. 16-bit outputs keep the rule's two ulps: there the reference's own rounding dominates.
FP32_OUTPUT_FLOOR_ULPS = 4


def compare_to_reference(
    spec: AttnSpec, out, lse, q, k, v, *, sm_scale=None, alibi_slopes=None, sinks=None, **exprs
) -> list[str]:
    """What is wrong with a kernel's (out, lse), by the rule of shared/RELIABILITY.md; [] if
    nothing. The error against the float64 golden may be at most 2x (3x with softcap) the error
    of the same math in the kernel's dtype plus a floor of two ulps at the output's magnitude
    (four for fp32 outputs, FP32_OUTPUT_FLOOR_ULPS explains why); the mean error the same with
    factor 1.5; NaN and inf exactly where the golden has them; rows that see no key exactly
    0. References are computed where the inputs live. `exprs`: tensors= and first_b= of a spec
    with score_mod / mask_mod, key_mask= (attention_scores)."""
    floor_ulps = FP32_OUTPUT_FLOOR_ULPS if out.dtype == torch.float32 else 2
    options = {"sm_scale": sm_scale, "alibi_slopes": alibi_slopes, "sinks": sinks, **exprs}
    golden, golden_lse = reference_attention(spec, q, k, v, **options)
    lowp, lowp_lse = lowp_reference(spec, q, k, v, **options)
    if out.shape != golden.shape or out.dtype != q.dtype:
        return [
            f"out: shape {tuple(out.shape)} {out.dtype}, expected {tuple(golden.shape)} {q.dtype}"
        ]
    problems = []
    if out.isnan().any():
        problems.append("out: NaN where the golden has none")
    factor = 3.0 if spec.softcap else 2.0
    problems += error_problems(
        "out", out.double(), golden, lowp.double(), factor, out.dtype, floor_ulps=floor_ulps
    )
    if not torch.equal(torch.isinf(lse), torch.isinf(golden_lse)) or lse.isnan().any():
        problems.append("lse: the -inf (or NaN) pattern differs from the golden's")
        return problems
    finite = torch.isfinite(golden_lse)
    scores = attention_scores(spec, q, k, sm_scale=sm_scale, alibi_slopes=alibi_slopes, **exprs)
    visible = torch.isfinite(scores)
    if finite.any():
        largest = _lse_floor_magnitude(spec, q, k, scores, visible, sm_scale, sinks)
        got, want, low = (x.double()[finite] for x in (lse, golden_lse, lowp_lse))
        problems += error_problems(
            "lse", got, want, low, factor, torch.float32, magnitude=largest, floor_ulps=4
        )
    unseen = ~visible.any(-1)  # rows that see no key (with sinks their LSE is the sink's)
    if unseen.any() and not torch.all(out[unseen] == 0):
        problems.append("out: a row that sees no key is not 0")
    return problems


# Note: the kernel's LSE passes through about five fp32 roundings in log2 units (the
# scale x log2 e, the ALiBi bias x log2 e, the running max, log2 of the sum, the
# division by log2 e), at the magnitude of the scores x log2 e, which can exceed
# |LSE|. The fp32 reference rounds far less, so its error is no yardstick here: the
# LSE floor is four fp32 ulps at max(|LSE|, largest |visible score or sink| x log2 e),
# about 5e-7 relative, far below what consumers of the LSE (backward, split-KV
# merges) resolve. The scores themselves are fp32 sums of D products whose partial
# sums reach sm_scale x sum_i |q_i k_i|, which exceeds |score| by about sqrt(D) for
# random data, and tensor cores add them with truncation at that magnitude: at D 576
# (MLA decode, bf16) the H200's LSE for a one-key row was 9 ulps off at |LSE| ~ 3,
# 2 ulps at the dot's partial-sum magnitude. So that magnitude joins the floor's.
def _lse_floor_magnitude(spec, q, k, scores, visible, sm_scale, sinks) -> float:
    """The magnitude at which the LSE floor counts its ulps (the note above says why)."""
    largest = scores[visible].abs().max().item() * LOG2E if visible.any() else 0.0
    largest = max(largest, _largest_partial_sum(q, k, sm_scale) * LOG2E)
    if spec.sinks and sinks is not None and sinks.numel():
        largest = max(largest, sinks.abs().max().item() * LOG2E)
    return largest


def _largest_partial_sum(q, k, sm_scale) -> float:
    """sm_scale x the largest sum_i |q_i k_i| over (query, key) pairs: the magnitude the
    partial sums of a score's dot product can reach."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    q_abs = q.abs().double()
    k_abs = k.abs().double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return scale * torch.matmul(q_abs, k_abs.transpose(-1, -2)).max().item()


def error_problems(what, got, golden, lowp, factor, dtype, magnitude=0.0, floor_ulps=2):
    """The rule's max and mean error bounds on float64 `got` against `golden`, `lowp` the same
    math in the kernel's dtype; the floor counts ulps of `dtype` at the larger of golden's
    magnitude and `magnitude`. [] if they hold."""
    if golden.numel() == 0:
        return []
    magnitude = max(golden.abs().max().item(), magnitude)
    floor = floor_ulps * ulp(dtype, magnitude)
    err = (got - golden).abs()
    lowp_err = (lowp - golden).abs()
    max_bound = factor * lowp_err.max().item() + floor
    mean_bound = 1.5 * lowp_err.mean().item() + floor
    problems = []
    if not err.max().item() <= max_bound:
        problems.append(
            f"{what}: max error {err.max().item():.3e} > {max_bound:.3e} "
            f"(lowp {lowp_err.max().item():.3e}, floor {floor:.1e})"
        )
    if not err.mean().item() <= mean_bound:
        problems.append(
            f"{what}: mean error {err.mean().item():.3e} > {mean_bound:.3e} "
            f"(lowp {lowp_err.mean().item():.3e}, floor {floor:.1e})"
        )
    return problems


def random_inputs(spec: AttnSpec, batch: int, seqlen_q: int, seqlen_k: int, *, seed: int,
                  num_q_heads: int | None = None, num_kv_heads: int | None = None,
                  scale: float = 1.0, device: str | torch.device = "cpu"):  # fmt: skip
    """q, k, v in the spec's dtype (and ALiBi slopes when the spec has ALiBi) from a seed.

    Normal(0, 1) entries; `scale` multiplies q, so scores grow by it. Slopes are the
    geometric sequence of the ALiBi paper, 2 ** (-8 h / Hq) for h = 1..Hq.
    """
    gen = torch.Generator().manual_seed(seed)
    hq = num_q_heads or spec.num_q_heads
    hkv = num_kv_heads or spec.num_kv_heads
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[spec.dtype.value]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(device)

    q = randn(batch, hq, seqlen_q, spec.head_dim) * scale
    k = randn(batch, hkv, seqlen_k, spec.head_dim)
    v = randn(batch, hkv, seqlen_k, spec.value_head_dim)
    slopes = None
    if spec.alibi:
        slopes = (2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)).to(device)
    return q, k, v, slopes


def random_sinks(
    num_q_heads: int, *, seed: int, scale: float = 2.0, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """[Hq] fp32 sink logits from a seed: Normal(0, scale), the spread of gpt-oss's learned
    sinks relative to its scores (a sink well above a row's scores takes most of its mass)."""
    gen = torch.Generator().manual_seed(seed + 7919)
    return (torch.randn(num_q_heads, generator=gen) * scale).to(device)
