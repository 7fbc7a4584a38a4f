"""Shared setup of the API-level property tests (tests/test_api_*.py; guarded memory and
process isolation are in tests/api_memory.py).

- Toy kernels: small fp32/fp16 specs built into a temporary folder by the real build path and
  loaded as the registry, with 16 x 16 tiles so that shapes of a few dozen rows cross several
  blocks under the interpreter. One spec per dispatch situation the suite needs (see API_SPECS).
- Semantics: what a call means (mask, alignment, window, softcap, ALiBi convention) as an
  AttnSpec for attngen.reference, judged by the rule of shared/RELIABILITY.md.
- Outcomes: a call either matches the reference or raises a documented exception (ValueError,
  attngen.NoKernelError); `Expect` says which of the two a drawn call is allowed to do.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from attngen.build import plan_build, write_build
from attngen.reference import (
    attention_scores,
    compare_to_reference,
    error_problems,
    reference_attention,
)
from attngen.runtime import dispatch as dispatch_module
from attngen.runtime.dispatch import NoKernelError
from attngen.runtime.registry import Registry, current_registry, load_kernels, use_registry
from attngen.spec import AttnSpec, CausalAlign, specs_from_data

INT32_MAX = 2**31 - 1
_FP32 = dict(dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=2)
_CAUSAL = dict(mask="causal", causal_align="bottom_right")
_DECODE_CONTIG = dict(kv_layout="contiguous", max_query_tokens=4)
_DECODE_PAGED = dict(kv_layout="paged", page_size=4, max_query_tokens=4)
PAGE_SIZE = 4
MAX_QUERY_TOKENS = 4

API_SPECS = [
    # bottom-right causal fp32 (flash-attn's diagonal), every kind; paged decode separately
    dict(name="api", **_FP32, **_CAUSAL, kernels=["prefill", "varlen", "decode"], **_DECODE_CONTIG),
    dict(name="api_paged", **_FP32, **_CAUSAL, kernels=["decode"], **_DECODE_PAGED),
    # no mask: the scale folded into the exponent meets scores near 1e10
    dict(name="api_none", **_FP32, mask="none", kernels=["prefill"]),
    # SDPA's top-left is_causal with Nq != Nk
    dict(name="api_tl", **_FP32, mask="causal", causal_align="top_left", kernels=["prefill"]),
    # ALiBi without a mask: the distance convention when Nq != Nk
    dict(
        name="api_alibi",
        **_FP32,
        mask="none",
        alibi=True,
        kernels=["prefill", "varlen", "decode"],
        **_DECODE_PAGED,
    ),
    # windows with a side at the int32 limit: flash-attn's (w, -1) and (-1, w)
    dict(
        name="api_right",
        **_FP32,
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=3,
        window_right=INT32_MAX,
        kernels=["prefill", "varlen", "decode"],
        **_DECODE_CONTIG,
    ),
    dict(
        name="api_left",
        **_FP32,
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=INT32_MAX,
        window_right=3,
        kernels=["prefill", "varlen"],
    ),
    # fp16 window with softcap: also what a short fp16 causal softcap call may run on
    dict(
        name="api_win",
        dtype="fp16",
        head_dim=16,
        num_q_heads=4,
        num_kv_heads=2,
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=3,
        window_right=0,
        softcap=5.0,
        kernels=["prefill", "varlen", "decode"],
        **_DECODE_CONTIG,
    ),
    # fp16 causal without a decode kind: flash_attn_with_kvcache's varlen route, MQA-like
    dict(
        name="api_h32",
        dtype="fp16",
        head_dim=32,
        num_q_heads=4,
        num_kv_heads=1,
        **_CAUSAL,
        kernels=["prefill", "varlen"],
    ),
]
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16}
DOCUMENTED = (ValueError, NoKernelError)


# ------------------------------------------------------------------------- the registry


@dataclass
class ApiKernels:
    """The registry in use (every module imported, `tiles` applied to each CONFIG) and an empty
    one for the fallback route."""

    registry: Registry
    empty: Registry
    arch: str = "sm90"  # whose modules module_for returns
    tiles: dict | None = None

    @classmethod
    def load(
        cls, folders, empty: Registry, arch: str = "sm90", tiles: dict | None = None
    ) -> ApiKernels:
        """Import every module of `folders` anew (a module reads its environment when it is
        imported, the checked mode perhaps too)."""
        registry = load_kernels(*folders, replace=True)
        for entry in registry.entries:
            module = registry.module(entry.key)
            if tiles:
                module.CONFIG.update(tiles)
        return cls(registry, empty, arch, tiles)

    @property
    def specs(self) -> list[dict]:
        """The specs of the registry's modules, as the index records them."""
        return [entry.spec for entry in self.registry.entries]

    def module_for(self, spec_name: str, kind: str):
        """The imported module of kind `kind` built from the spec named `spec_name`."""
        entry = next(
            e
            for e in self.registry.entries
            if e.kind == kind and e.spec["name"] == spec_name and e.arch == self.arch
        )
        return self.registry.module(entry.key)

    @contextlib.contextmanager
    def fallback_only(self):
        """No generated kernel at all and fallback "sdpa": every call runs in torch."""
        use_registry(self.empty)
        saved = dispatch_module.get_fallback()
        dispatch_module.set_fallback("sdpa")
        try:
            yield
        finally:
            dispatch_module.set_fallback(saved)
            use_registry(self.registry)

    @contextlib.contextmanager
    def forced_splits(self, splits: int | None):
        """Every decode module splits its keys `splits` ways (None: the split rule)."""
        modules = [self.registry.module(e.key) for e in self.registry.entries if e.kind == "decode"]
        for module in modules:
            module.FORCE_NUM_SPLITS = splits
        try:
            yield
        finally:
            for module in modules:
                module.FORCE_NUM_SPLITS = None

    @contextlib.contextmanager
    def checked(self, on: bool):
        """With `on`: ATTNGEN_CHECKS=1 (the opt-in host validation of index tensors), read by
        the runtime and by modules imported anew under it; yields the kernels to call."""
        if not on:
            yield self
            return
        saved_env = os.environ.get("ATTNGEN_CHECKS")
        saved_modules = dict(sys.modules)
        os.environ["ATTNGEN_CHECKS"] = "1"
        try:
            fresh = ApiKernels.load(self.registry.folders, self.empty, self.arch, self.tiles)
            use_registry(fresh.registry)
            yield fresh
        finally:
            if saved_env is None:
                os.environ.pop("ATTNGEN_CHECKS", None)
            else:
                os.environ["ATTNGEN_CHECKS"] = saved_env
            for name, module in saved_modules.items():  # the re-imports replaced these
                if sys.modules.get(name) is not module:
                    sys.modules[name] = module
            use_registry(self.registry)


def empty_registry(folder: Path) -> Registry:
    """A registry without modules (what the fallback route runs against)."""
    write_build(plan_build([]), folder)
    return load_kernels(folder, replace=True)


def build_api_kernels(folder: Path) -> ApiKernels:
    specs = [s for data in API_SPECS for s in specs_from_data({"archs": ["sm90"], **data})]
    write_build(plan_build(specs), folder / "kernels")
    return ApiKernels.load(
        [folder / "kernels"], empty_registry(folder / "empty"), tiles=SMALL_TILES
    )


@functools.cache
def shared_api_kernels() -> ApiKernels:
    """Built once per process (like kernel_harness's modules, in a temporary folder)."""
    return build_api_kernels(Path(tempfile.mkdtemp(prefix="attngen-api-kernels-")))


@pytest.fixture(scope="module")
def api_kernels():
    """The toy registry in use for a test module; the previous one is restored afterwards."""
    saved = current_registry()
    kernels = shared_api_kernels()
    use_registry(kernels.registry)
    try:
        yield kernels
    finally:
        use_registry(saved)


# ---------------------------------------------------------------------------- semantics


@dataclass(frozen=True)
class Semantics:
    """What a call computes. `align` is where the diagonal sits for masks and for ALiBi's
    distance (None: top-left, i' = i); a window side None is unbounded."""

    mask: str = "none"  # none | causal | sliding_window
    align: str | None = None  # top_left | bottom_right
    window: tuple[int | None, int | None] | None = None
    softcap: float = 0.0
    alibi: bool = False

    def spec(self) -> AttnSpec:
        data = dict(
            name="ref",
            archs=["sm90"],
            dtype="fp32",
            head_dim=16,
            num_q_heads=1,
            num_kv_heads=1,
            mask=self.mask,
            softcap=self.softcap,
            alibi=self.alibi,
            kernels=["prefill"],
        )
        if self.mask != "none":
            data["causal_align"] = self.align or "top_left"
        if self.mask == "sliding_window":
            left, right = self.window
            data["window_left"] = INT32_MAX if left is None else min(left, INT32_MAX)
            data["window_right"] = INT32_MAX if right is None else min(right, INT32_MAX)
        spec = specs_from_data(data)[0]
        if self.mask == "none" and self.align == "bottom_right":
            # ALiBi's distance at aligned positions without a mask: the spec refuses an
            # alignment without a mask, the reference reads it all the same
            spec = spec.model_copy(update={"causal_align": CausalAlign.bottom_right})
        return spec


def flash_semantics(causal: bool, window_size, softcap: float, alibi: bool) -> Semantics:
    """flash-attn 2.x: bottom-right diagonal for masks and ALiBi; -1 is an unbounded side;
    causal keeps right = 0."""
    left, right = window_size
    left = None if left < 0 else left
    right = None if right < 0 else right
    if causal:
        right = 0
    if left is None and right is None:
        mask, window = "none", None
    elif left is None and right == 0:
        mask, window = "causal", None
    else:
        mask, window = "sliding_window", (left, right)
    return Semantics(mask, "bottom_right", window, float(softcap or 0.0), alibi)


def reference_problems(sem: Semantics, out, lse, q, k, v, *, scale=None, slopes=None) -> list[str]:
    """compare_to_reference in [B, H, N, D] layout; without an LSE from the call, the golden
    one stands in (only the output is judged)."""
    spec = sem.spec()
    q, k, v = (t.detach().cpu() for t in (q, k, v))
    slopes = None if slopes is None else slopes.detach().cpu().float()
    if lse is None:
        _, lse = reference_attention(spec, q, k, v, sm_scale=scale, alibi_slopes=slopes)
        lse = lse.float()
    return compare_to_reference(
        spec, out.detach().cpu(), lse.detach().cpu(), q, k, v, sm_scale=scale, alibi_slopes=slopes
    )


def dense_mask_problems(
    sem: Semantics, attn_mask, out, q, k, v, *, scale=None, slopes=None
) -> list[str]:
    """reference_problems with SDPA's attn_mask on top of the semantics: a bool mask keeps
    the True keys, a float mask is added to the scores. The rule is RELIABILITY.md's
    (attngen.reference's own comparison, applied to these references)."""
    spec = sem.spec()
    q, k, v, out = (t.detach().cpu() for t in (q, k, v, out))
    attn_mask = attn_mask.cpu()
    slopes = None if slopes is None else slopes.cpu().float()

    def masked(compute_dtype):
        scores = attention_scores(
            spec, q, k, sm_scale=scale, alibi_slopes=slopes, compute_dtype=compute_dtype
        )
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(compute_dtype)
        lse = torch.logsumexp(scores, dim=-1)
        finite = torch.isfinite(lse)
        probs = torch.where(
            finite[..., None], torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]), 0.0
        )
        if compute_dtype != torch.float64 and q.dtype != torch.float32:
            probs = probs.to(q.dtype).to(compute_dtype)
        values = v.to(compute_dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return probs @ values, finite

    golden, finite = masked(torch.float64)
    lowp, _ = masked(torch.float32)
    if out.shape != golden.shape or out.dtype != q.dtype:
        return [f"out: {tuple(out.shape)} {out.dtype}, expected {tuple(golden.shape)} {q.dtype}"]
    problems = ["out: NaN where the golden has none"] if out.isnan().any() else []
    floor_ulps = 4 if out.dtype == torch.float32 else 2
    problems += error_problems(
        "out",
        out.double(),
        golden,
        lowp.to(q.dtype).double(),
        3.0 if sem.softcap else 2.0,
        out.dtype,
        floor_ulps=floor_ulps,
    )
    if (~finite).any() and not torch.all(out[~finite] == 0):
        problems.append("out: a row that sees no key is not 0")
    return problems


def acting_mask(mask, align, window, seqlen_q, seqlen_k, same_lengths, alibi=False):
    """(mask, align, window) as it acts at these lengths, by the two equivalences the
    dispatcher documents: a window whose reach covers every key is causal (or no mask; with
    ALiBi only when aligned bottom-right: the bias distance of no mask is bottom-right's), and
    with Nq == Nk the alignments coincide."""
    top_left_bias = alibi and mask != "none" and align == "top_left"
    if mask == "sliding_window":
        left, right = window
        reach = max(seqlen_q, seqlen_k) - 1
        if left >= reach and right >= reach:
            mask, window = "none", None
        elif left >= reach and right == 0:
            mask, window = "causal", None
    if same_lengths or (mask == "none" and not top_left_bias):
        align = None
    return mask, align, window


def served(
    specs: list[dict],
    kind: str,
    dtype: torch.dtype,
    head_dim: int,
    sem: Semantics,
    seqlen_q: int,
    seqlen_k: int,
    same_lengths: bool,
) -> bool:
    """Whether a module of `specs` (index entries' specs) serves the call, by the spec's
    fields and the two mask equivalences above, so that the call must not be refused."""
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    window = (
        None if sem.window is None else tuple(INT32_MAX if w is None else w for w in sem.window)
    )
    wanted = acting_mask(sem.mask, sem.align, window, seqlen_q, seqlen_k, same_lengths, sem.alibi)
    for data in specs:
        if kind not in data["kernels"] or data["dtype"] != names.get(dtype):
            continue
        if (data["head_dim"], float(data.get("softcap") or 0.0), bool(data.get("alibi"))) != (
            head_dim,
            sem.softcap,
            sem.alibi,
        ):
            continue
        spec_window = (
            (data["window_left"], data.get("window_right") or 0)
            if (data["mask"] == "sliding_window")
            else None
        )
        have = acting_mask(
            data["mask"],
            data.get("causal_align"),
            spec_window,
            seqlen_q,
            seqlen_k,
            same_lengths,
            sem.alibi,
        )
        if have == wanted:
            return True
    return False


# ----------------------------------------------------------------------------- outcomes


def draw_mistake(names) -> st.SearchStrategy[str]:
    """Half the calls well-formed ("none"), half with one of the named mistakes."""
    wrong = sorted(set(names) - {"none"})
    return st.booleans().flatmap(lambda bad: st.sampled_from(wrong) if bad else st.just("none"))


class Expect(enum.Enum):
    SERVE = "a module serves it: must return a correct result"
    REFUSE = "invalid: must raise ValueError or NoKernelError"
    EITHER = "correct result or a documented exception"


def attempt(call, expect: Expect, names: tuple[str, ...] = ()):
    """(result, None), or (None, exception) for a documented exception. An undocumented
    exception propagates. With `names`, a refusal's message must name one of them."""
    try:
        result = call()
    except DOCUMENTED as exc:
        assert expect is not Expect.SERVE, f"refused a call a module serves: {exc!r}"
        if names:
            text = str(exc).lower()
            assert any(n.lower() in text for n in names), (
                f"the error does not name {' or '.join(names)}: {exc}"
            )
        return None, exc
    assert expect is not Expect.REFUSE, f"an invalid call returned a result ({names})"
    return result, None
