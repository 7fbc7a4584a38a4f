"""Helpers for tests that run generated kernels: load a module, make inputs, judge the output.

The judgement follows shared/RELIABILITY.md: the kernel's error against the float64 golden
may be at most 2x (3x with softcap) the error of the same math in the kernel's dtype, plus a
floor of two ulps of the output dtype at the output's magnitude; the mean error obeys the same
rule with factor 1.5; NaN and inf appear exactly where the golden has them.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
import tempfile
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from attngen.reference import attention_scores, lowp_reference, reference_attention
from attngen.render import render_module
from attngen.spec import AttnSpec, KernelKind, module_name, specs_from_data
from attngen.tiling import derive_tiles

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_MODULE_DIR = Path(tempfile.mkdtemp(prefix="attngen-test-modules-"))
_counter = itertools.count()
LOG2E = 1.4426950408889634


def make_spec(**fields) -> AttnSpec:
    base = dict(name="t", archs=["sm90"], dtype="fp16", head_dim=64, num_q_heads=4,
                num_kv_heads=2, mask="causal", causal_align="bottom_right", kernels=["prefill"])
    base.update(fields)
    if base["mask"] == "none":
        base.pop("causal_align", None)
    return specs_from_data(base)[0]


@cache
def load_kernel(spec: AttnSpec, block_m: int | None = None, block_n: int | None = None,
                arch: str = "sm90") -> ModuleType:
    """Render the spec's prefill module to a real .py file and import it (the JIT needs a file).

    block_m/block_n override the derived tiles, to put block boundaries where a test wants them.
    """
    source = render_module(spec, KernelKind.prefill, derive_tiles(spec, arch))
    name = f"{module_name(spec, KernelKind.prefill)}_{next(_counter)}"
    path = _MODULE_DIR / f"{name}.py"
    path.write_text(source)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    if block_m is not None:
        module.CONFIG["BLOCK_M"] = block_m
    if block_n is not None:
        module.CONFIG["BLOCK_N"] = block_n
    return module


def make_inputs(spec: AttnSpec, batch: int, seqlen_q: int, seqlen_k: int, *, seed: int,
                num_q_heads: int | None = None, num_kv_heads: int | None = None,
                scale: float = 1.0, device: str = "cpu"):
    """q, k, v (and ALiBi slopes) from a seed; `scale` multiplies q so scores grow by it."""
    gen = torch.Generator().manual_seed(seed)
    hq = num_q_heads or spec.num_q_heads
    hkv = num_kv_heads or spec.num_kv_heads
    dtype = TORCH_DTYPES[spec.dtype.value]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(device)

    q = randn(batch, hq, seqlen_q, spec.head_dim) * scale
    k = randn(batch, hkv, seqlen_k, spec.head_dim)
    v = randn(batch, hkv, seqlen_k, spec.value_head_dim)
    slopes = None
    if spec.alibi:
        slopes = (2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)).to(device)
    return q, k, v, slopes


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    mantissa = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}[dtype]
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 2.0 ** -mantissa
    return 2.0 ** (math.floor(math.log2(magnitude)) - mantissa)


def assert_matches_reference(spec: AttnSpec, out, lse, q, k, v, *, sm_scale=None, slopes=None):
    """The RELIABILITY.md criterion for out and lse, plus exact NaN/inf placement."""
    # References are computed where the inputs live (float64 on the H200 is fast).
    golden, golden_lse = reference_attention(spec, q, k, v, sm_scale=sm_scale, alibi_slopes=slopes)
    lowp, lowp_lse = lowp_reference(spec, q, k, v, sm_scale=sm_scale, alibi_slopes=slopes)
    assert out.shape == golden.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "NaN in the output where the golden has none"
    factor = 3.0 if spec.softcap else 2.0
    _check_error("out", out.double(), golden, lowp.double(), factor, out.dtype)
    assert torch.equal(torch.isinf(lse), torch.isinf(golden_lse)), "LSE -inf pattern differs"
    assert not lse.isnan().any()
    finite = torch.isfinite(golden_lse)
    if finite.any():
        # Note: the kernel's LSE passes through about five fp32 roundings in log2 units (the
        # scale x log2 e, the ALiBi bias x log2 e, the running max, log2 of the sum, the
        # division by log2 e), at the magnitude of the scores x log2 e, which can exceed
        # |LSE|. The fp32 reference rounds far less, so its error is no yardstick here: the
        # LSE floor is four fp32 ulps at max(|LSE|, largest |visible score| x log2 e), about
        # 5e-7 relative, far below what consumers of the LSE (backward, split-KV merges) resolve.
        scores = attention_scores(spec, q, k, sm_scale=sm_scale, alibi_slopes=slopes)
        visible = torch.isfinite(scores)
        largest = scores[visible].abs().max().item() * LOG2E if visible.any() else 0.0
        _check_error("lse", lse.double()[finite], golden_lse[finite], lowp_lse.double()[finite],
                     factor, torch.float32, magnitude=largest, floor_ulps=4)
    # Fully masked rows: output exactly 0.
    masked_rows = ~finite
    if masked_rows.any():
        assert torch.all(out[masked_rows] == 0)


def _check_error(what, got, golden, lowp, factor, dtype, magnitude=0.0, floor_ulps=2):
    if golden.numel() == 0:
        return
    magnitude = max(golden.abs().max().item(), magnitude)
    floor = floor_ulps * ulp(dtype, magnitude)
    err = (got - golden).abs()
    lowp_err = (lowp - golden).abs()
    max_bound = factor * lowp_err.max().item() + floor
    mean_bound = 1.5 * lowp_err.mean().item() + floor
    assert err.max().item() <= max_bound, (
        f"{what}: max error {err.max().item():.3e} > {max_bound:.3e} "
        f"(lowp {lowp_err.max().item():.3e}, floor {floor:.1e})")
    assert err.mean().item() <= mean_bound, (
        f"{what}: mean error {err.mean().item():.3e} > {mean_bound:.3e} "
        f"(lowp {lowp_err.mean().item():.3e}, floor {floor:.1e})")
