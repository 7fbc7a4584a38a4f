"""Write attngen/tiling/model_store.json: the tiling models compiled ahead (evaluate.py).

For every model expression a derivation can ask for (`models()`: each arch, load path, dropout
and kernel of the prefill, decode and backward models; the Gluon models' capture words and
extra tiles up to the largest a spec reaches), sympy's work done once: the expression's text,
its function of the derivation's symbols (lambdify's source), its Piecewise conditions' sources
and, for the models whose worked formula the header prints (prefill, decode, backward), the
formula in force for every choice of Piecewise arms over the value grid (`GRID`). A process
then reads these instead of importing sympy (120-300 ms a process). Run after changing a
model (prefill_model.py, backward_model.py, gluon_model.py, dropout.py or the constants they
import); tests/test_model_store.py fails until the store matches sympy again.

    python tools/model_store.py            # write the store
    python tools/model_store.py --check    # exit 1 if it differs from what would be written
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sympy  # noqa: E402

from attngen.arch import ARCHS  # noqa: E402
from attngen.tiling import backward, gluon, gluon_backward, prefill, symbolic  # noqa: E402
from attngen.tiling.evaluate import STORE, Model, arm_choice, function_from  # noqa: E402

# The values a worked formula is looked up at: every tile of the prefill, decode and backward
# grids (decode's row tiles are powers of 2 up to 64), every padded head dim, every dtype size.
GRID = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (16, 32, 64, 128),
    "S": (1, 2, 3, 4),
    "W": (4, 8),
    "D": (16, 32, 64, 128, 256, 512, 1024),
    "DV": (16, 32, 64, 128, 256, 512, 1024),
    "E": (1, 2, 4),
}
MAX_CAPTURE_WORDS = 48  # gluon.capture_words: a windowed varlen spec with a few named tensors
MAX_EXTRA_TILES = 8  # gluon.extra_tiles: a window with ALiBi and three gathered reads


def models() -> Iterator[tuple[Model, tuple[str, ...], bool]]:
    """(model, the symbols its function takes, whether its worked formulas are kept)."""
    names = prefill.MODEL_NAMES
    flags = (False, True)
    for arch in ARCHS.values():
        for tma, pipelined, dropout in itertools.product(flags, flags, flags):
            if tma and not arch.has_tma:
                continue
            yield prefill.smem_model(arch, tma, pipelined, dropout), names, True
        for pipelined, dropout in itertools.product(flags, flags):
            yield prefill.regs_model(arch, pipelined, dropout), names, True
        for kernel in backward.KERNELS:
            for dropout in flags:
                yield backward.smem_model(arch, kernel, dropout), names, True
            yield backward.regs_model(arch, kernel), names, True
    for words, o_tile in itertools.product(range(MAX_CAPTURE_WORDS + 1), flags):
        yield gluon.smem_model(words, o_tile), gluon.SYMBOL_NAMES, False
    for tiles in range(MAX_EXTRA_TILES + 1):
        yield gluon.regs_model(tiles), gluon.SYMBOL_NAMES, False
    yield gluon_backward.smem_model(), gluon_backward.SYMBOL_NAMES, False
    for d256 in flags:
        yield gluon_backward.regs_model(d256), gluon_backward.SYMBOL_NAMES, False
    yield Model("prefill_model.score_expression"), ("BLOCK_M", "BLOCK_N", "S"), False


def formulas(expr: sympy.Expr, names: tuple[str, ...], conditions: list[list[str]]) -> dict:
    """choice ("i,j,..", an arm per Piecewise node) -> the formula in force, over GRID."""
    functions = [[function_from(source) for source in node] for node in conditions]
    texts: dict[str, str] = {}
    for at in itertools.product(*(GRID[name] for name in names)):
        choice = arm_choice(functions, at)
        if choice not in texts:
            texts[choice] = symbolic.active_text(expr, dict(zip(names, at, strict=True)))
    return dict(sorted(texts.items()))


def entry(model: Model, names: tuple[str, ...], worked: bool) -> dict[str, Any]:
    expr = model.expr()
    key = ",".join(names)
    conditions = symbolic.condition_sources(expr, names)
    found: dict[str, Any] = {
        "text": str(expr),
        "functions": {key: symbolic.function_source(expr, names)},
        "conditions": {key: conditions},
    }
    if worked:
        found["formulas"] = formulas(expr, names, conditions)
    return found


def store() -> dict[str, Any]:
    return {
        "sympy": sympy.__version__,
        "written_by": "tools/model_store.py",
        "models": {model.key: entry(model, names, worked) for model, names, worked in models()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    start = time.perf_counter()
    text = json.dumps(store(), indent=1, sort_keys=True) + "\n"
    took = time.perf_counter() - start
    if args.check:
        same = STORE.exists() and STORE.read_text() == text
        print(f"{STORE.relative_to(ROOT)}: {'current' if same else 'STALE'} ({took:.1f} s)")
        return 0 if same else 1
    STORE.write_text(text)
    print(f"wrote {STORE.relative_to(ROOT)}: {len(text) // 1024} KiB in {took:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
