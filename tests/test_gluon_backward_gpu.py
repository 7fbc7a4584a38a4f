"""The warp-specialized (Gluon) dK/dV backward of tools/gluon_backward.py on the H200:
`pytest -m gpu`.

dQ, dK, dV against the float64 reference (RELIABILITY.md's rule, attngen.reference_backward)
at small sizes and at sizes spanning many key and query blocks, causal in both alignments
(rows that see no key: dQ 0) and not, GQA (the group's query heads summed in the kernel), bf16
and fp16, D 64 and 128; dK and dV bitwise repeatable; arguments refused by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

# (B, Nq, Nk, HQ, HKV, D, mask, align, dtype)
SMALL = [
    (1, 1, 1, 2, 2, 64, "none", None, "bf16"),
    (1, 1, 1, 2, 2, 128, "causal", "bottom_right", "fp16"),
    (2, 63, 65, 4, 2, 64, "none", None, "bf16"),
    (2, 129, 129, 3, 3, 64, "causal", "bottom_right", "fp16"),
    (2, 127, 127, 4, 2, 128, "causal", "bottom_right", "bf16"),
    (1, 100, 300, 2, 2, 128, "causal", "bottom_right", "bf16"),
    (1, 100, 300, 2, 2, 128, "causal", "top_left", "fp16"),
    (1, 300, 100, 2, 2, 64, "causal", "bottom_right", "bf16"),
    (1, 300, 100, 2, 2, 64, "causal", "top_left", "fp16"),
]
GRID = [
    (1, 1000, 1000, 14, 2, 128, "causal", "bottom_right", "bf16"),
    (1, 1000, 1000, 7, 1, 128, "none", None, "fp16"),
    (2, 1024, 1024, 8, 8, 64, "causal", "bottom_right", "bf16"),
    (1, 2048, 2048, 4, 1, 64, "none", None, "bf16"),
    (1, 777, 2049, 4, 2, 128, "causal", "top_left", "bf16"),
]


def _ids(case):
    b, nq, nk, hq, hkv, d, mask, align, dtype = case
    return f"{dtype}-d{d}-{mask}{'-' + align if align else ''}-{hq}:{hkv}-b{b}-{nq}x{nk}"


@pytest.mark.parametrize("case", SMALL + GRID, ids=_ids)
def test_gradients_match_the_float64_reference(case):
    import gluon_backward_check as check

    result = check.check_case(case, seed=7)
    assert result["ok"], result["problems"]
    assert result["deterministic_dkdv"], "dK/dV are not bitwise repeatable"


def test_dq_of_rows_that_see_no_key_is_zero():
    import gluon_backward as gb
    import gluon_backward_check as check

    case = (1, 300, 100, 2, 2, 128, "causal", "bottom_right", "bf16")  # rows < 200 see no key
    q, k, v, dout, out, lse = check.inputs(case, seed=3)
    dq, dk, dv = gb.gluon_backward(q, k, v, out, lse, dout, causal=True)
    assert torch.isinf(lse[:, :, :200]).all()
    assert torch.all(dq[:, :200] == 0)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(q=lambda t: t.float()), "q.dtype"),
        (dict(q=lambda t: t.transpose(1, 2)), "q must be contiguous"),
        (dict(lse=lambda t: t[..., :-1]), "lse"),
        (dict(scale=lambda s: -1.0), "scale=-1.0"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, name):
    import gluon_backward as gb
    import gluon_backward_check as check

    q, k, v, dout, out, lse = check.inputs((1, 64, 64, 2, 2, 64, "none", None, "bf16"))
    args = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=0.125)
    for key, fn in change.items():
        args[key] = fn(args[key])
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        gb.gluon_backward(**args)
