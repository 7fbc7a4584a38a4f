"""score_mod / mask_mod in the warp-specialized forward and dK/dV backward on the H200:
`pytest -m gpu`.

Served without ATTNGEN_GLUON_VARIANTS since this file passed whole on one tree: each case of
tests/test_expression_kernels.py through
attention() at D 64 and 128, without a block mask and with one (exact, disturbed as Flex's
meaning allows, hostile lists), against the float64 reference, forward_path() and
backward_path() saying the Gluon kernels ran. Run it once under compute-sanitizer too (the
hostile lists must not fault).
"""

from __future__ import annotations

import pytest
import torch

from attngen.reference import compare_to_reference
from attngen.reference.backward import compare_gradients
from tests.kernel_harness import load_kernel, make_inputs, make_spec
from tests.test_block_sparse import (
    disturb,
    exact_block_mask,
    flex_meaning_problems,
    hostile_block_mask,
    mask_mod_values,
)
from tests.test_expression_kernels import CASES, case_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


def _spec(case: str, causal: bool, head_dim: int, backward: bool = False):
    mask = dict(mask="causal", causal_align="top_left") if causal else dict(mask="none")
    return make_spec(name="gflex", dtype="bf16", head_dim=head_dim, backward=backward, **mask,
                     **CASES[case])  # fmt: skip


def _gluon_module(spec):
    """The spec's module with the Gluon kernels on every launch: small launches (at most
    POINTER_LOADS_UP_TO pairs) otherwise take the tile-level forward for host time (the first
    GPU run of this file failed 41 of 49 cases on that, not on a result), and causal calls
    with few keys the tile-level backward (GLUON_BWD_SHORT_CAUSAL_KEYS)."""
    module = load_kernel(spec)
    module.POINTER_LOADS_UP_TO = module.GLUON_BWD_SHORT_CAUSAL_KEYS = 0
    return module


def _case(case: str, causal: bool, head_dim: int, seed: int, backward: bool = False):
    """(spec, its Gluon module, q, k, v, tensors, mask_mod's values): B 2, Nq 700, Nk 1000;
    softcap's scores past the cap."""
    spec = _spec(case, causal, head_dim, backward)
    scale = 8.0 if case == "softcap" else 1.0
    q, k, v, _ = make_inputs(spec, 2, 700, 1000, seed=seed, scale=scale)
    tensors = case_tensors(case, 2, 1000, seed)
    values = mask_mod_values(spec, tensors, 2, 700, 1000)
    return spec, _gluon_module(spec), q, k, v, tensors, values


def _on_gpu(tensors, block_mask):
    """The call's tensors= and block_mask= on the GPU (None stays None)."""
    if block_mask is not None:
        block_mask = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in block_mask)
    return {"tensors": {n: t.cuda() for n, t in tensors.items()} or None, "block_mask": block_mask}


def _run(kernel, q, k, v, tensors, block_mask=None):
    """(out, lse) on the CPU from the module's Gluon kernel (asserted) on the GPU."""
    out, lse = kernel.attention(q.cuda(), k.cuda(), v.cuda(), return_lse=True,
                                **_on_gpu(tensors, block_mask))  # fmt: skip
    assert kernel.forward_path() == kernel.GLUON_PATH, kernel.forward_path()
    return out.cpu(), lse.cpu()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_expressions_without_a_block_mask(case: str, causal: bool, head_dim: int) -> None:
    spec, kernel, q, k, v, tensors, _ = _case(case, causal, head_dim, 31)
    out, lse = _run(kernel, q, k, v, tensors)
    problems = compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_expressions_with_a_block_mask(case: str, causal: bool, head_dim: int) -> None:
    """The exact block mask of mask_mod (and the causal mask), then one with dropped and
    promoted blocks (Flex's meaning: unlisted blocks are out, full ones skip mask_mod)."""
    spec, kernel, q, k, v, tensors, values = _case(case, causal, head_dim, 32)
    out, lse = _run(kernel, q, k, v, tensors, exact_block_mask(values, 128, 128))
    problems = compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert not problems, "exact: " + "; ".join(problems)
    if not causal:  # flex_meaning_problems' reference has no built-in mask
        gen = torch.Generator().manual_seed(32)
        block_mask = disturb(exact_block_mask(values, 128, 128, gen=gen), gen, 0.3, 0.3)
        out, lse = _run(kernel, q, k, v, tensors, block_mask)
        problems = flex_meaning_problems(case, "bf16", False, out, lse, q, k, v, tensors,
                                         block_mask)  # fmt: skip
        assert not problems, "disturbed: " + "; ".join(problems)


def test_hostile_lists() -> None:
    """Negative, huge and duplicate indices and counts past the row: no fault, and without
    duplicates the result the clamping rule gives."""
    spec = _spec("document", False, 128)
    kernel = _gluon_module(spec)
    q, k, v, _ = make_inputs(spec, 1, 512, 512, seed=33)
    tensors = case_tensors("document", 1, 512, 33)
    block_mask = hostile_block_mask()
    out, lse = _run(kernel, q, k, v, tensors, block_mask)
    problems = flex_meaning_problems("document", "bf16", False, out, lse, q, k, v, tensors,
                                     block_mask)  # fmt: skip
    assert not problems, "; ".join(problems)


def _gradients(kernel, q, k, v, tensors, block_mask, deterministic):
    """dq, dk, dv on the CPU from the module's Gluon dK/dV kernel (asserted) on the GPU, and
    dO (a seeded draw)."""
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(5))
    out = kernel.attention(*leaves, **_on_gpu(tensors, block_mask), deterministic=deterministic)
    out.backward(dout.to(q.dtype).cuda())
    assert kernel.backward_path().startswith(kernel.GLUON_BACKWARD_PATH), kernel.backward_path()
    return [t.grad.cpu() for t in leaves], dout.to(q.dtype)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_expression_gradients(case: str, causal: bool, head_dim: int) -> None:
    """Without a block mask (the every-block lists) and dQ by TMA reduce-adds, then with the
    exact block mask and deterministic=True (the Gluon kernel without dQ)."""
    spec, kernel, q, k, v, tensors, values = _case(case, causal, head_dim, 34, backward=True)
    for block_mask, deterministic in ((None, False),
                                      (exact_block_mask(values, 128, 128), True)):  # fmt: skip
        grads, dout = _gradients(kernel, q, k, v, tensors, block_mask, deterministic)
        problems = compare_gradients(spec, grads, q, k, v, dout, tensors=tensors)
        assert not problems, f"block mask {block_mask is not None}: " + "; ".join(problems)
