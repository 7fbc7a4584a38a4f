"""The tracer (attngen/runtime/flex/trace.py): Python score_mod / mask_mod functions become
the spec's expression tree, whose meaning (expressions.evaluate_mod, and the vectorized
blocks.evaluate_mod) equals torch's evaluation of the function; what the language cannot say
is refused, naming the function and the operation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import _vmap_for_bhqkv, and_masks, create_mask, or_masks

from attngen.runtime.flex import blocks
from attngen.runtime.flex.trace import Capture, TraceError, trace
from attngen.spec import expressions

B, H, Q, K = 2, 3, 9, 11
torch.manual_seed(0)
doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3], dtype=torch.int32)
doc_b = torch.tensor([[0] * 4 + [1] * 7, [0] * 8 + [1] * 3])
prefix_len = torch.tensor([2, 6])
bias = torch.randn(H, Q + K)
slopes = torch.tensor([0.5, 0.25, 0.125])
keep_heads = torch.tensor([True, False, True])
gate = torch.tensor(0.75)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 3)


def document(b, h, q_idx, kv_idx):
    return doc[q_idx] == doc[kv_idx]


def document_batched(b, h, q_idx, kv_idx):
    return doc_b[b][q_idx] == doc_b[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= prefix_len[b]) | (q_idx >= kv_idx)


def natten(b, h, q_idx, kv_idx):
    return (torch.abs(q_idx // 3 - kv_idx // 3) <= 1) & ((q_idx % 3 - kv_idx % 3).abs() <= 1)


def heads_and_not(b, h, q_idx, kv_idx):
    return keep_heads[h] | ~(q_idx < kv_idx)


def out_of_range(b, h, q_idx, kv_idx):  # reads past doc for q_idx + 5 >= 11: masked
    return doc[q_idx + 5] >= 1


MASKS = [causal, sliding, document, document_batched, prefix_lm, natten, heads_and_not]
MASKS += [and_masks(causal, document), or_masks(sliding, prefix_lm)]


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + bias[h, q_idx - kv_idx + K]


def softcap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def alibi_exp2(score, b, h, q_idx, kv_idx):
    return score + torch.exp2(-((h + 1) * 8.0 / H)) * (kv_idx - q_idx)


def masked_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score * gate, -float("inf")) + 1.0


def mixed(score, b, h, q_idx, kv_idx):
    d = torch.maximum(q_idx - kv_idx, torch.minimum(kv_idx, q_idx + 2))
    return torch.where(d > 1, torch.sqrt(torch.abs(score) + 1) - torch.log(d + 1.0), score * 2)


def integer_score(score, b, h, q_idx, kv_idx):
    return q_idx - kv_idx


SCORES = [relative_bias, softcap, alibi, alibi_exp2, masked_score, mixed, integer_score]


def _grids():
    return (torch.arange(n) for n in (B, H, Q, K))


def _python_env(tensors, b, h, q, k, score=None):
    env = {"b": b, "h": h, "q_idx": q, "kv_idx": k, "score": score}
    for decl, value in tensors.items():
        array = value.reshape(-1) if value.dim() == 0 else value
        env[decl.name] = array.numpy()
        env |= dict(zip(decl.shape, array.shape, strict=True))
    return env


def _check_scalar_meaning(field, tree, keep, capture, expected, scores=None):
    """expressions.evaluate_mod at every (b, h, q, k) equals `expected` (torch's)."""
    decls = capture.declarations()
    tensors = {d: capture.found[key][1] for key, (d, _) in capture.found.items()}
    for b, h, q, k in np.ndindex(B, H, Q, K):
        score = None if scores is None else float(scores[b, h, q, k])
        env = _python_env(tensors, b, h, q, k, score)
        got = expressions.evaluate_mod(field, tree, env, decls)
        if keep is not None and not expressions.evaluate_mod("mask_mod", keep, env, decls):
            got = -math.inf
        want = expected[b, h, q, k].item()
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (b, h, q, k, got, want)


@pytest.mark.parametrize("mask_mod", MASKS, ids=lambda f: f.__name__)
def test_a_traced_mask_means_what_torch_computes(mask_mod) -> None:
    capture = Capture()
    tree, keep = trace(mask_mod, "mask_mod", capture)
    assert keep is None and tree.type == "bool"
    assert expressions.parse("mask_mod", str(tree), capture.declarations()) == tree
    expected = create_mask(mask_mod, B, H, Q, K, device="cpu")
    _check_scalar_meaning("mask_mod", tree, None, capture, expected)
    env = blocks.tensor_env(capture.declarations(), capture.values())
    b, h, q, k = _grids()
    grid = {"b": b[:, None, None, None], "h": h[None, :, None, None]}
    grid |= {"q_idx": q[None, None, :, None], "kv_idx": k[None, None, None, :]}
    got = blocks.evaluate_mod("mask_mod", tree, env | grid, capture.declarations())
    assert torch.equal(got.expand(B, H, Q, K), expected)


@pytest.mark.parametrize("score_mod", SCORES, ids=lambda f: f.__name__)
def test_a_traced_score_means_what_torch_computes(score_mod) -> None:
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    capture = Capture()
    tree, keep = trace(score_mod, "score_mod", capture)
    assert tree.type in ("float", "int")
    assert expressions.parse("score_mod", str(tree), capture.declarations()) == tree
    scores = torch.randn(B, H, Q, K) * 3
    with TransformGetItemToIndex():
        expected = _vmap_for_bhqkv(score_mod, prefix=(0,))(scores, *_grids()).float()
    _check_scalar_meaning("score_mod", tree, keep, capture, expected, scores)


def test_score_mod_masking_with_minus_inf_becomes_a_mask() -> None:
    capture = Capture()
    tree, keep = trace(masked_score, "score_mod", capture)
    assert str(tree) == "((score * t0[0]) + 1.0)" or str(tree) == "((score * gate[0]) + 1.0)"
    assert str(keep) == "(q_idx >= kv_idx)"


def test_captured_tensors_are_declared_by_their_variable_names() -> None:
    table = torch.randn(4, 8, requires_grad=True)
    lengths = torch.tensor([3, 4], dtype=torch.int32)

    def mod(score, b, h, q_idx, kv_idx, scale=torch.tensor(2.0)):  # noqa: B008 - a default
        return score * scale + table[h, kv_idx] + lengths[b] + doc[q_idx]

    capture = Capture()
    tree, _ = trace(mod, "score_mod", capture)
    decls = {d.name: d for d in capture.declarations()}
    assert set(decls) == {"scale", "table", "lengths", "doc"}
    assert decls["table"] == expressions.Tensor("table", "float32", ("TABLE_0", "TABLE_1"), True)
    assert decls["lengths"].dtype == "int32" and not decls["lengths"].trainable
    assert decls["scale"].shape == ("SCALE_0",) and capture.values()["scale"].shape == (1,)
    assert "scale[0]" in str(tree)


def test_unnamed_and_reserved_tensors_get_t_names_and_distinct_dims() -> None:
    score = torch.ones(5, dtype=torch.int32)  # a reserved name
    abcdefghijklmnopq_x = torch.ones(5, dtype=torch.int32)
    abcdefghijklmnopq_y = torch.ones(5, dtype=torch.int32)

    def mask(b, h, q_idx, kv_idx):
        return (score[q_idx] + abcdefghijklmnopq_x[q_idx] + abcdefghijklmnopq_y[kv_idx]) > 0

    capture = Capture()
    trace(mask, "mask_mod", capture)
    decls = capture.declarations()
    assert [d.name for d in decls] == ["t0", "abcdefghijklmnopq_x", "abcdefghijklmnopq_y"]
    dims = [d.shape[0] for d in decls]
    assert len(set(dims)) == 3 and all(len(d) <= 16 for d in dims), dims


def test_one_tensor_read_by_both_functions_is_declared_once() -> None:
    capture = Capture()
    trace(document, "mask_mod", capture)
    trace(lambda s, b, h, q, k: s + doc[k], "score_mod", capture)
    assert [d.name for d in capture.declarations()] == ["doc"]


def test_torch_noop_mask_is_no_mask() -> None:
    from torch.nn.attention.flex_attention import noop_mask

    assert trace(noop_mask, "mask_mod", Capture()) == (None, None)


float_doc = torch.rand(11)
wide = torch.zeros(2, 2, 2, 2, 2)
doubles = torch.zeros(4, dtype=torch.float64)


def _if(b, h, q, k):
    return True if q > k else False


REFUSED = [
    (_if, "mask_mod", "data-dependent control flow"),
    (lambda b, h, q, k: q > k and k > 0, "mask_mod", "Python bool"),
    (lambda b, h, q, k: torch.sigmoid(q) > 0, "mask_mod", "torch.sigmoid is not in the language"),
    (lambda s, b, h, q, k: s**2, "score_mod", "'**'"),
    (lambda b, h, q, k: q & k, "mask_mod", "'&' of q_idx, kv_idx"),
    (lambda b, h, q, k: ~q > 0, "mask_mod", "'~'"),
    (lambda b, h, q, k: doc[q // k] > 0, "mask_mod", "'//'"),
    (lambda b, h, q, k: float_doc[q * 0.5] > 0, "mask_mod", "a float; allowed: ints"),
    (lambda b, h, q, k: doc[q, k] > 0, "mask_mod", "indexed with 2 indices"),
    (lambda b, h, q, k: doc[q:k] > 0, "mask_mod", "traced value as a Python index"),
    (lambda b, h, q, k: doc[-1 + 0 * 0] > q, "mask_mod", None),  # a constant read: allowed
    (lambda b, h, q, k: doc[q] > doc, "mask_mod", "not indexed"),
    (lambda b, h, q, k: doc_b[b] > 0, "mask_mod", "indexes 1 of its tensor's 2 dims"),
    (lambda b, h, q, k: wide[b, h, q, k, 0] > 0, "mask_mod", "at most 4 dims"),
    (lambda b, h, q, k: doubles[q] > 0, "mask_mod", "dtype torch.float64"),
    (lambda b, h, q, k: q - k, "mask_mod", "must return a bool"),
    (lambda s, b, h, q, k: q > k, "score_mod", "must return a float"),
    (lambda s, b, h, q, k: torch.where(q > k, s, -math.inf) * 2, "score_mod", "'mul' of a score"),
    (lambda b, h, q, k: torch.where(q > k, True, -math.inf), "mask_mod", "-inf in torch.where"),
    (lambda s, b, h, q, k: s + 2**40, "score_mod", "1099511627776"),
    (lambda s, b, h, q, k: s + math.inf, "score_mod", "inf"),
    (lambda s, b, h, q, k: s.shape, "score_mod", "method .shape()"),
    (lambda b, h, q, k: q.item() > 0, "mask_mod", "method .item()"),
    (lambda b, h, q, k: 1 / 0, "mask_mod", "ZeroDivisionError"),
    ("not a function", "mask_mod", "allowed: a Python function"),
]


@pytest.mark.parametrize(("fn", "field", "words"), REFUSED)
def test_what_the_language_cannot_say_is_refused_by_name(fn, field, words) -> None:
    if words is None:
        trace(fn, field, Capture())
        return
    with pytest.raises(TraceError) as info:
        trace(fn, field, Capture())
    message = str(info.value)
    assert message.startswith(field), message
    assert words in message, message
    if callable(fn):
        assert getattr(fn, "__qualname__", "") in message, message


def test_a_deep_composition_is_refused_by_the_parsers_limits() -> None:
    def deep(b, h, q, k):
        x = q
        for _ in range(40):
            x = x + 1
        return x > k

    with pytest.raises(TraceError, match="nested deeper than"):
        trace(deep, "mask_mod", Capture())


def test_out_of_range_reads_mask_the_key() -> None:
    capture = Capture()
    tree, _ = trace(out_of_range, "mask_mod", capture)
    env = blocks.tensor_env(capture.declarations(), capture.values())
    q = torch.arange(Q)[:, None]
    grid = {"b": torch.tensor(0), "h": torch.tensor(0), "q_idx": q, "kv_idx": torch.arange(K)}
    got = blocks.evaluate_mod("mask_mod", tree, env | grid, capture.declarations())
    padded = torch.cat([doc, torch.full((5,), -1, dtype=doc.dtype)])
    assert torch.equal(got.expand(Q, K), (padded[torch.arange(Q) + 5] >= 1)[:, None].expand(Q, K))


def test_the_text_of_a_deep_tree_is_linear_in_its_size() -> None:
    # Expr.__str__ printed each operand twice (4x per level): a 31-deep spec expression,
    # within the parser's limits, took 4**31 steps in canonical().
    tree = expressions.parse("mask_mod", "q_idx" + " + 1" * 31 + " > kv_idx")
    assert str(tree).count("+ 1") == 31
