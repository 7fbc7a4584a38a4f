"""score_mod and mask_mod: the whitelist parser, types, rendering, gradients, spec fields."""

from __future__ import annotations

import ast
import math

import numpy as np
import pytest

from attngen.spec import KernelKind, SpecError, specs_from_data
from attngen.spec.expression_grad import gradients
from attngen.spec.expressions import (
    ExprError,
    Tensor,
    evaluate,
    evaluate_mod,
    parse,
    render,
    render_mod,
)
from attngen.spec.names import module_name

DOC = Tensor("doc", "int32", ("B", "N"))
BIAS = Tensor("bias", "float32", ("H", 4095), trainable=True)
SMALL_BIAS = Tensor("bias", "float32", ("H", 15), trainable=True)
TENSORS = (DOC, BIAS)


@pytest.mark.parametrize(
    ("field", "text", "normalized", "kind"),
    [
        (
            "mask_mod",
            "doc[b, q_idx] == doc[b, kv_idx] and q_idx >= kv_idx",
            "((doc[b, q_idx] == doc[b, kv_idx]) and (q_idx >= kv_idx))",
            "bool",
        ),
        (
            "score_mod",
            "score + bias[h, q_idx - kv_idx + 2047]",
            "(score + bias[h, ((q_idx - kv_idx) + 2047)])",
            "float",
        ),
        ("score_mod", "30*tanh(score/30)", "(30 * tanh((score / 30)))", "float"),
        (
            "mask_mod",
            "0 <= q_idx - kv_idx < 128",
            "((0 <= (q_idx - kv_idx)) and ((q_idx - kv_idx) < 128))",
            "bool",
        ),
        ("score_mod", "q_idx - kv_idx", "(q_idx - kv_idx)", "int"),  # widened to a float score
        (
            "score_mod",
            "where(q_idx // 64 == kv_idx % 64, score, -score)",
            "where(((q_idx // 64) == (kv_idx % 64)), score, (-score))",
            "float",
        ),
        ("score_mod", "score * exp(-1.0)", f"(score * {math.exp(-1.0)!r})", "float"),
    ],
)
def test_the_parser_accepts_the_language(field: str, text: str, normalized: str, kind: str) -> None:
    tree = parse(field, text, TENSORS)
    assert (str(tree), tree.type) == (normalized, kind)
    assert parse(field, " ".join(text.split(" ")) + "  ", TENSORS) == tree
    assert str(parse(field, normalized, TENSORS)) == normalized  # the normalized form reparses


HOSTILE = [
    ("__import__('os').system('x')", "'.system' is not allowed"),
    ("__import__('os')", "'__import__' is not allowed"),
    ("score.__class__", "'.__class__' is not allowed"),
    ("open('f')", "'open' is not allowed"),
    ("(lambda: 1)()", "'lambda: 1' is not allowed"),
    ("'score'", "'score' is not allowed (literals"),
    ("[score for score in b]", "is not allowed"),
    ("exp(*[score])", "exp takes positional arguments only"),
    ("max(score, b=1)", "max takes positional arguments only"),
    ("abs(" * 40 + "score" + ")" * 40, "nested deeper than 32"),
    ("+".join(["b"] * 300), "over 256 nodes"),
    ("score" + " " * 2000, "characters; allowed: at most 1024"),
    ("rel[h, q_idx]", "'rel' is not allowed"),
    ("score + bias[h]", "bias has rank 2, indexed with 1"),
    ("score + bias[h, 1.5]", "bias's index 1.5 is a float"),
    ("score + bias[h, q_idx:kv_idx]", "not slices"),
    ("score > 0", "(score > 0) is a bool; score_mod must be a float"),
    ("score // 2", "'//' needs an int and a positive int literal"),
    ("q_idx % 0", "'% 0' needs a positive divisor"),
    ("q_idx % kv_idx", "'%' needs an int and a positive int literal"),
    ("score + 10**40", "'**' is not allowed"),
    ("score @ score", "'@' is not allowed"),
    ("~b + score", "'~' is not allowed"),
    ("b in b", "'in' is not allowed"),
    ("(x := 1)", "'(x := 1)' is not allowed"),
    ("f'{score}'", "is not allowed"),
    ("...", "Ellipsis is not allowed"),
    ("1j", "1j is not allowed"),
    ("globals()", "'globals' is not allowed"),
    ("-" * 100 + "score", "nested deeper than 32"),
    ("(" * 300 + "score" + ")" * 300, "not an expression (too many nested parentheses)"),
    ("score + 99999999999", "99999999999 is not allowed (literals"),
    ("score * 1e999", "inf is not allowed"),
    ("score + log(0.0)", "log(0.0) is a constant without a finite value"),
    ("where(score, 1.0, 2.0)", "where's condition must be a bool"),
    ("score + (q_idx >= kv_idx)", "'add' needs numbers"),
    ("score if q_idx else 1.0", "is not allowed"),
    ("score; import os", "not an expression"),
    ("score\x00", "not an expression"),
]


@pytest.mark.parametrize(("text", "message"), HOSTILE)
def test_hostile_expressions_are_refused_naming_field_and_token(text: str, message: str) -> None:
    with pytest.raises(ExprError) as caught:
        parse("score_mod", text, TENSORS)
    line = str(caught.value)
    assert line.startswith("score_mod: ") and "\n" not in line
    assert message in line


def test_mask_mod_has_no_score_and_must_be_a_bool() -> None:
    with pytest.raises(ExprError, match=r"^mask_mod: 'score' is not allowed \(names: b, h, q_idx"):
        parse("mask_mod", "score > 0", TENSORS)
    with pytest.raises(ExprError, match="mask_mod must be a bool"):
        parse("mask_mod", "q_idx - kv_idx", TENSORS)
    with pytest.raises(ExprError, match="'and' needs bools"):
        parse("mask_mod", "q_idx and kv_idx", TENSORS)


def test_rendering_is_exact_and_parses() -> None:
    softcap = parse("score_mod", "30 * tanh(score / 30)")
    assert render_mod("score_mod", softcap, ()) == "(30.0 * _tanh((qk / 30.0)))"
    alibi = parse("score_mod", "score - 0.5 * abs(q_idx - kv_idx)")
    assert render_mod("score_mod", alibi, ()) == (
        "(qk - (0.5 * tl.abs((offs_m[:, None] - key_pos[None, :])).to(tl.float32)))"
    )
    distance = parse("score_mod", "q_idx - kv_idx")  # an int score_mod is widened
    assert render_mod("score_mod", distance, ()) == (
        "(offs_m[:, None] - key_pos[None, :]).to(tl.float32)"
    )
    chunk = parse("mask_mod", "q_idx // 64 == kv_idx // 64 and not q_idx < kv_idx")
    assert render_mod("mask_mod", chunk, ()) == (
        "((((offs_m[:, None] - ((offs_m[:, None] % 64) + 64) % 64) // 64) == "
        "((key_pos[None, :] - ((key_pos[None, :] % 64) + 64) % 64) // 64)) & "
        "((offs_m[:, None] < key_pos[None, :]) == 0))"
    )
    table = Tensor("t", "bf16", (8,))
    rel = parse("score_mod", "score + t[q_idx - kv_idx]", (table,))
    inside = (
        "(((offs_m[:, None] - key_pos[None, :]) >= 0) & ((offs_m[:, None] - key_pos[None, :]) < 8))"
    )
    assert render_mod("score_mod", rel, (table,)) == (
        f"tl.where({inside}, (qk + tl.load(t_ptr + ((offs_m[:, None] - key_pos[None, :])) * "
        f"t_stride0, mask={inside}, other=0.0).to(tl.float32)), float('-inf'))"
    )
    for field, text in (("mask_mod", HOSTILE_FREE_MASK), ("score_mod", HOSTILE_FREE_SCORE)):
        source = render_mod(field, parse(field, text, TENSORS), TENSORS)
        ast.parse(source, mode="eval")
        assert source == render_mod(field, parse(field, text, TENSORS), TENSORS)


HOSTILE_FREE_MASK = "doc[b, q_idx] == doc[b, kv_idx] and (q_idx >= kv_idx or not q_idx % 7 == 1)"
HOSTILE_FREE_SCORE = (
    "where(h < 2, min(score, 5.0), max(abs(score), sqrt(2.0))) + log(1.0 + exp(score))"
)


def test_out_of_range_reads_mask_the_key() -> None:
    """A read outside the declared shape reads nothing: mask_mod False, score_mod -inf; a read
    in where's untaken branch does not count."""
    doc = np.array([[0, 0, 1, 1]], dtype=np.int32)
    env = {"b": 0, "h": 0, "B": 1, "N": 4, "doc": doc}
    mask = parse("mask_mod", "doc[b, q_idx] == doc[b, kv_idx]", (DOC,))
    assert evaluate_mod("mask_mod", mask, {**env, "q_idx": 0, "kv_idx": 1}, (DOC,)) is True
    assert evaluate_mod("mask_mod", mask, {**env, "q_idx": 1, "kv_idx": 2}, (DOC,)) is False
    assert evaluate_mod("mask_mod", mask, {**env, "q_idx": 3, "kv_idx": 4}, (DOC,)) is False
    table = Tensor("t", "float32", (4,))
    guarded = parse("score_mod", "where(q_idx < 4, score + t[q_idx], score)", (table,))
    unguarded = parse("score_mod", "score + t[q_idx]", (table,))
    tenv = {"score": 1.0, "b": 0, "h": 0, "kv_idx": 0, "t": np.arange(4.0)}
    assert evaluate_mod("score_mod", guarded, {**tenv, "q_idx": 9}, (table,)) == 1.0
    assert evaluate_mod("score_mod", guarded, {**tenv, "q_idx": 3}, (table,)) == 4.0
    assert evaluate_mod("score_mod", unguarded, {**tenv, "q_idx": 9}, (table,)) == -math.inf
    rendered = render_mod("score_mod", unguarded, (table,))
    assert "mask=" in rendered and rendered.endswith(", float('-inf'))")


class _CInt(int):
    """An int with C's (Triton's) truncating // and %, to run rendered index arithmetic."""

    def __add__(self, other: int) -> _CInt:  # type: ignore[override]
        return _CInt(int(self) + int(other))

    def __sub__(self, other: int) -> _CInt:  # type: ignore[override]
        return _CInt(int(self) - int(other))

    def __floordiv__(self, other: int) -> _CInt:  # type: ignore[override]
        return _CInt(int(math.trunc(int(self) / int(other))))

    def __mod__(self, other: int) -> _CInt:  # type: ignore[override]
        return _CInt(int(math.fmod(int(self), int(other))))

    def __getitem__(self, _: object) -> _CInt:  # offs_m[:, None] is the row's position
        return self


def test_floor_division_and_modulo_follow_python() -> None:
    """The language's // and % floor (Python's and torch's); the rendered text gets the same
    values from Triton's truncating // and %."""
    tree = parse("score_mod", "(q_idx - kv_idx) // 4 * 10 + (q_idx - kv_idx) % 4")
    text = render(tree, ())
    for q, k in [(0, 3), (5, 0), (0, 0), (2, 9), (0, 8)]:
        expected = (q - k) // 4 * 10 + (q - k) % 4
        assert evaluate(tree, {"q_idx": q, "kv_idx": k}) == expected
        kernel = eval(text, {"offs_m": _CInt(q), "key_pos": _CInt(k)})  # noqa: S307 (our own render)
        assert kernel == expected, (q, k, text)
    assert _CInt(-3) // 4 == 0 and _CInt(-3) % 4 == -3  # the helper truncates, as Triton does


GRADIENT_CASES = [
    "30*tanh(score/30)",
    "score - 0.5*abs(q_idx - kv_idx)",
    "score + bias[h, q_idx - kv_idx + 7]",
    "where(q_idx >= kv_idx, score, score*2)",
    "max(score, 0.1 * score) * bias[h, 3] + sqrt(score * score + 1.0)",
    "log(1.0 + exp(score)) * bias[h, kv_idx] * bias[h, kv_idx]",
]


@pytest.mark.parametrize("text", GRADIENT_CASES)
def test_derived_gradients_match_finite_differences(text: str) -> None:
    tensors = (SMALL_BIAS,)
    tree = parse("score_mod", text, tensors)
    grads = gradients(tree, tensors)
    rng = np.random.default_rng(0)
    bias = rng.standard_normal((2, 15))
    step = 1e-6
    for score, q_idx, kv_idx in [(0.7, 3, 1), (-2.3, 1, 3), (12.0, 5, 5), (-0.4, 2, 6)]:
        env = {"score": score, "b": 0, "h": 1, "q_idx": q_idx, "kv_idx": kv_idx, "bias": bias}
        env |= {"H": 2}

        def at(env: dict = env, **change: object) -> float:
            return float(evaluate(tree, {**env, **change}))

        numeric = (at(score=score + step) - at(score=score - step)) / (2 * step)
        assert evaluate(grads["score"], env) == pytest.approx(numeric, rel=1e-6, abs=1e-7)
        for read, grad in grads.items():
            if read == "score":
                continue
            load = parse("score_mod", read, tensors)
            index = tuple(evaluate(i, env) for i in load.args)
            up, down = bias.copy(), bias.copy()
            up[index] += step
            down[index] -= step
            numeric = (at(bias=up) - at(bias=down)) / (2 * step)
            assert evaluate(grad, env) == pytest.approx(numeric, rel=1e-6, abs=1e-7), read
    assert set(grads) - {"score"} == {str(n) for n in tree.nodes() if n.op == "load"}


def test_gradients_render_from_the_tree() -> None:
    softcap = parse("score_mod", "30*tanh(score/30)")
    (grad,) = gradients(softcap, ()).values()
    source = render(grad, ())
    ast.parse(source, mode="eval")
    assert "_tanh(" in source and "qk" in source
    causal_scale = parse("score_mod", "where(q_idx >= kv_idx, score, score*2)")
    assert render(gradients(causal_scale, ())["score"], ()) == (
        "tl.where((offs_m[:, None] >= key_pos[None, :]), 1.0, 2.0)"
    )


BASE = {
    "name": "flex",
    "archs": ["sm90"],
    "dtype": "bf16",
    "head_dim": 64,
    "num_q_heads": 8,
    "num_kv_heads": 8,
    "mask": "none",
    "kernels": ["prefill"],
}
DOC_FIELDS = {
    "mask_mod": "doc[b, q_idx] == doc[b, kv_idx] and q_idx >= kv_idx",
    "tensors": [{"name": "doc", "dtype": "int32", "shape": ["B", "N"]}],
}


def test_spec_fields_round_trip_and_name_the_module_by_the_tree() -> None:
    (spec,) = specs_from_data({**BASE, **DOC_FIELDS})
    (spaced,) = specs_from_data(
        {**BASE, **DOC_FIELDS, "mask_mod": "(doc[b,q_idx]==doc[b,kv_idx])  and (q_idx>=kv_idx)"}
    )
    (plain,) = specs_from_data(BASE)
    canonical = spec.canonical()
    assert canonical["mask_mod"] == "((doc[b, q_idx] == doc[b, kv_idx]) and (q_idx >= kv_idx))"
    assert canonical["tensors"] == [
        {"name": "doc", "dtype": "int32", "shape": ["B", "N"], "trainable": False}
    ]
    assert spec.spec_hash() == spaced.spec_hash() != plain.spec_hash()
    name = module_name(spec, KernelKind.prefill)
    assert name == module_name(spaced, KernelKind.prefill)
    assert (
        name.startswith("flex_prefill_bf16_d64_mm")
        and len(name) == len(module_name(plain, KernelKind.prefill)) + len("_mm") + 8
    )
    assert "score_mod" not in plain.canonical() and "tensors" not in plain.canonical()
    (again,) = specs_from_data({**BASE, **{k: v for k, v in canonical.items() if k in DOC_FIELDS}})
    assert again.spec_hash() == spec.spec_hash()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mask_mod": "os.system('x')"}, "mask_mod: '.system' is not allowed"),
        ({"score_mod": "score + t[q_idx]"}, "score_mod: 't' is not allowed"),
        (
            {
                "mask_mod": "q_idx >= 0",
                "tensors": [{"name": "doc", "dtype": "int32", "shape": ["B"]}],
            },
            "tensors: got 'doc'; allowed: tensors that score_mod or mask_mod reads",
        ),
        (
            {
                "mask_mod": "where[q_idx] >= 0",
                "tensors": [{"name": "where", "dtype": "int32", "shape": ["N"]}],
            },
            "tensors: got 'where'; allowed: unique names other than",
        ),
        (
            {
                "mask_mod": "doc[q_idx] >= 0",
                "tensors": [{"name": "doc", "dtype": "int8", "shape": ["N"]}],
            },
            "tensors.0.dtype: got 'int8'",
        ),
        (
            {
                "mask_mod": "doc[q_idx] >= 0",
                "tensors": [{"name": "doc", "dtype": "int32", "shape": ["n"]}],
            },
            "tensors.0.shape.0",
        ),
        (
            {
                "score_mod": "score + w[h]",
                "tensors": [{"name": "w", "dtype": "float32", "shape": ["H"], "trainable": True}],
            },
            "trainable only for a float tensor that score_mod reads, with backward: true",
        ),
        (
            {"score_mod": "score", "softcap": 30},
            "score_mod: got 'score'; allowed: absent with softcap",
        ),
        ({"score_mod": 3}, "score_mod: got 3 (int); allowed: an expression string"),
    ],
)
def test_spec_refuses_bad_expression_fields(fields: dict, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        specs_from_data({**BASE, **fields})
    assert message in str(caught.value)


def test_explain_shows_the_tree_its_kernel_text_and_gradients() -> None:
    from attngen.cli.explain import explain_lines

    fields = {
        "score_mod": "score + bias[h, q_idx - kv_idx + 2047]",
        "tensors": [{"name": "bias", "dtype": "float32", "shape": ["H", 4095], "trainable": True}],
        "backward": True,
    }
    (spec,) = specs_from_data({**BASE, **fields})
    lines = explain_lines([spec])
    assert lines[:5] == [
        "flex: tensor bias: float32 [H, 4095] (trainable)",
        "flex: score_mod = (score + bias[h, ((q_idx - kv_idx) + 2047)])  (float)",
        "   kernel: "
        + render_mod("score_mod", parse("score_mod", fields["score_mod"], (BIAS,)), (BIAS,)),
        "   d score_mod / d score = 1.0  (multiplies dS)",
        "   d score_mod / d bias[h, ((q_idx - kv_idx) + 2047)] = 1.0  (multiplies dS)",
    ]


class _Tile(np.ndarray):
    """A numpy array with Triton's `.to(dtype)`, to run rendered kernel text on a tile."""

    def to(self, _dtype: object) -> _Tile:
        return self.astype(np.float64).view(_Tile)


class _FakeTl:
    """The triton.language calls the renderer emits, in float64 numpy; a pointer is an offset
    into the flattened tensor, and a masked-off lane reads nothing (index 0 stands in)."""

    float32 = "float32"
    where, minimum, maximum = (
        staticmethod(np.where),
        staticmethod(np.minimum),
        staticmethod(np.maximum),
    )
    abs, exp, log, sqrt = (
        staticmethod(np.abs),
        staticmethod(np.exp),
        staticmethod(np.log),
        staticmethod(np.sqrt),
    )

    def __init__(self, flat: np.ndarray):
        self.flat = flat

    def load(self, offsets: np.ndarray, mask: np.ndarray, other: float) -> np.ndarray:
        safe = np.where(mask, offsets, 0)
        return np.where(mask, self.flat[safe], other).view(_Tile)


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("score_mod", "score + bias[h, q_idx - kv_idx + 3]"),
        (
            "score_mod",
            "where(q_idx >= kv_idx, 30 * tanh(score / 30), min(score, -1.0) - abs(q_idx - kv_idx))",
        ),
        ("score_mod", "log(1.0 + exp(score)) * bias[h, kv_idx] + sqrt(q_idx + 1) / 2"),
        ("mask_mod", "bias[h, q_idx] > bias[h, kv_idx] or (q_idx % 3 == 1 and not kv_idx > 4)"),
    ],
)
def test_rendered_text_computes_what_the_evaluator_does(field: str, text: str) -> None:
    """The kernel text, run on a [rows, cols] tile with numpy standing in for Triton, equals
    the float64 evaluator position by position, out-of-range reads included."""
    table = Tensor("bias", "float32", ("H", 7))
    tree = parse(field, text, (table,))
    rng = np.random.default_rng(1)
    bias = rng.standard_normal((2, 7))
    rows, cols = np.arange(6), np.arange(9)
    score = rng.standard_normal((6, 9)) * 40
    scope = {
        "tl": _FakeTl(bias.ravel()),
        "_tanh": np.tanh,
        "qk": score.view(_Tile),
        "off_b": np.array(0).view(_Tile),
        "off_h": np.array(1).view(_Tile),
        "offs_m": rows.view(_Tile),
        "key_pos": cols.view(_Tile),
        "dim_H": 2,
        "bias_ptr": 0,
        "bias_stride0": 7,
        "bias_stride1": 1,
    }
    with np.errstate(all="ignore"):
        kernel = np.broadcast_to(eval(render_mod(field, tree, (table,)), scope), score.shape)  # noqa: S307
    for i in rows:
        for j in cols:
            env = {"score": float(score[i, j]), "b": 0, "h": 1, "q_idx": int(i), "kv_idx": int(j)}
            expected = evaluate_mod(field, tree, {**env, "H": 2, "bias": bias}, (table,))
            assert kernel[i, j] == pytest.approx(expected, rel=1e-12), (i, j)
