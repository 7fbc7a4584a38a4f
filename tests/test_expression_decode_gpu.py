"""score_mod / mask_mod in the decode kernels compiled for the GPU (the H200): `pytest -m gpu`.

The CPU suite (tests/test_expression_decode.py) runs the same cases under the interpreter,
which does not compile: here each case's decode module is compiled by Triton for sm90 with
its derived tiles (bf16, D 128, GQA 4:1), at lengths that cross many key blocks and pages,
with the split rule's count and a forced one, against the float64 reference. A spec whose
expressions declare no tensors keeps decode()'s call plans: their launches equal the full
path's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.decode_harness import (
    count_plan_hits,
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
    same_bits,
)
from tests.test_expression_decode import CASES, run_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

FIELDS = dict(dtype="bf16", head_dim=128, num_q_heads=8, num_kv_heads=2, max_query_tokens=4)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize(("num_q", "splits"), [(1, None), (4, 5)])
def test_decode_expressions_on_the_gpu(case: str, layout: str, num_q: int, splits) -> None:
    params = dict(
        case=case, layout=layout, page_size=16 if layout == "paged" else None, block_n=None,
        lengths=[300, 0, 1000], num_q=num_q, num_new=num_q, splits=splits, seed=13,
        fields=dict(FIELDS, mask="causal", causal_align="bottom_right"),
    )  # fmt: skip
    problems, _, _ = run_case(params, device="cuda")
    assert not problems, "; ".join(problems)


def test_decode_without_tensors_runs_from_its_plans(monkeypatch) -> None:
    spec = make_decode_spec("paged", 16, mask="causal", causal_align="bottom_right",
                            **FIELDS, **CASES["softcap"])  # fmt: skip
    module = load_decode(spec)
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    hits = count_plan_hits(monkeypatch, module)
    cache = make_cache(spec, [70, 400], seed=14).to("cuda")
    q, _, _, _ = make_queries(spec, 2, 2, seed=14, scale=8.0)  # scores past the cap
    first = run_decode(module, cache, q.cuda())
    again = run_decode(module, cache, q.cuda())
    assert hits == [True] and all(same_bits(a, b) for a, b in zip(first, again, strict=True))
    out, lse = (t.cpu() for t in first)
    assert not decode_problems(spec, make_cache(spec, [70, 400], seed=14), out, lse, q)


@pytest.mark.parametrize("case", ["document", "relative_bias"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("splits", [None, 5])
def test_decode_block_masks_on_the_gpu(case: str, layout: str, splits) -> None:
    """decode(..., block_mask=) compiled (the derived tiles, torch's 128-blocks, GQA 4:1, 4
    tokens): blocks dropped and promoted, against the float64 reference of the meaning."""
    from tests.test_block_sparse_decode import block_mask_problems, build_case

    params = dict(
        case=case, layout=layout, page_size=16 if layout == "paged" else None, block_n=None,
        q_block=128, kv_block=128, lengths=[300, 0, 1000], num_q=4, num_new=4, splits=splits,
        broadcast=(False, False), full=True, drop=0.3, promote=0.3, index_dtype=torch.int32,
        seed=15, fields=dict(FIELDS, mask="causal", causal_align="bottom_right"),
    )  # fmt: skip
    kernel, spec, cache, q, k_new, v_new, tensors, block_mask = build_case(params)
    moved = {n: t.cuda() for n, t in (tensors or {}).items()} or None
    mask = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in block_mask)
    kernel.FORCE_NUM_SPLITS = splits
    try:
        out, lse = run_decode(kernel, cache.clone().to("cuda"), q.cuda(), k_new.cuda(),
                              v_new.cuda(), tensors=moved, block_mask=mask)  # fmt: skip
    finally:
        kernel.FORCE_NUM_SPLITS = None
    problems = block_mask_problems(params, spec, cache, out.cpu(), lse.cpu(), q, k_new, v_new,
                                   tensors, block_mask)  # fmt: skip
    assert not problems, "; ".join(problems)
