"""Tally what the API-level property suite finds, without stopping at the first failure.

pytest stops a Hypothesis test at its first failing example and shrinks it, so one bug hides
the others. This runs many drawn calls of each property of tests/test_api_*.py (CPU, Triton's
interpreter, each call in a forked child so that a crash is one result), groups the failures
by the kind of call and the shape of the message, and prints one line per group with a count
and the smallest example. Run it after a fix lands to see what is left:

    python tools/api_census.py [--examples 200] [--only kvcache] [--json out.json]
    python tools/api_census.py --explicit     # each kept @example of the tests: pass or FAIL
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything defines a Triton kernel
# As in tests/conftest.py: no module is built on demand, so that a call the toy modules do not
# serve is refused or falls back (the suite's expectations assume it), and nothing is cached.
os.environ["ATTNGEN_ON_DEMAND"] = "0"
os.environ["ATTNGEN_CACHE"] = tempfile.mkdtemp(prefix="attngen-census-cache-")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from tests import interpreter_bf16  # noqa: E402

interpreter_bf16.install()

from attngen.runtime.registry import use_registry  # noqa: E402
from tests import api_kv_cases, test_api_dense, test_api_kvcache, test_api_varlen  # noqa: E402
from tests.api_harness import build_api_kernels  # noqa: E402
from tests.api_memory import isolated  # noqa: E402


def _dense_key(call) -> str:
    return (
        f"{call.dtype} d{call.head_dim} softcap={call.softcap:g} alibi={call.alibi} "
        f"mistake={call.mistake} fallback={call.fallback}"
    )


# property -> (strategy, check, describe); TESTS: property -> the test keeping its @examples
TESTS = {
    "flash_attn_func": test_api_dense.test_flash_attn_func,
    "sdpa": test_api_dense.test_scaled_dot_product_attention,
    "module_attention": test_api_dense.test_module_attention,
    "packed": test_api_varlen.test_packed_sequences,
    "kvcache": test_api_kvcache.test_kvcache,
}
PROPERTIES = {
    "flash_attn_func": (
        test_api_dense.flash_calls(),
        test_api_dense.check_flash_attn_func,
        lambda c: f"{_dense_key(c[0])} causal={c[1]} window={c[2]}",
    ),
    "sdpa": (
        test_api_dense.sdpa_calls(),
        test_api_dense.check_sdpa,
        lambda c: (
            f"{_dense_key(c[0])} is_causal={c[1]} window={c[2]} align={c[3]} attn_mask={c[4]}"
        ),
    ),
    "module_attention": (
        test_api_dense.module_calls(),
        test_api_dense.check_module_attention,
        lambda c: f"module={c[0]} mistake={c[1].mistake}",
    ),
    "packed": (
        test_api_varlen.packed_cases(),
        test_api_varlen.check_packed,
        lambda c: (
            f"{c.api} {c.flavor.module or c.flavor.dtype} mistake={c.mistake} "
            f"seqused={c.use_seqused} "
            f"checked={c.checked} fallback={c.fallback}"
        ),
    ),
    "kvcache": (
        api_kv_cases.kv_cases(),
        test_api_kvcache.check_kvcache,
        lambda c: (
            f"{c.api} {'paged' if c.paged else 'contig'} "
            f"{c.flavor.decode_module(c.paged) or c.flavor.varlen}"
            f"{' one-token' if c.flavor.one_token_only else ''} Nq={c.seqlen_q}"
            f" mistake={c.mistake} checked={c.checked} fallback={c.fallback}"
        ),
    ),
}


def signature(message: str) -> str:
    """The message's first problem with numbers blanked, so that one bug is one group."""
    first = message.strip().splitlines()[-1] if "Traceback" in message else message
    first = first.split("; ")[0]
    first = re.sub(r"sequence \d+", "sequence #", first)
    first = re.sub(r"\(L=\d+\+\d+\)", "(L=#)", first)
    return re.sub(r"-?\d+(\.\d+)?(e[-+]\d+)?", "#", first)[:160]


def census(name: str, kernels, examples: int) -> dict:
    strategy, check, describe = PROPERTIES[name]
    groups: dict[tuple[str, str], list] = defaultdict(list)
    runs = [0]

    @settings(
        max_examples=examples,
        database=None,
        derandomize=True,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(case):
        runs[0] += 1
        message = _run(check, kernels, case)
        if message is not None:
            groups[(signature(message), describe(case))].append((len(repr(case)), case, message))

    draw()
    return {"runs": runs[0], "groups": groups}


def _run(check, kernels, case) -> str | None:
    """The failure's message, or None."""
    try:
        if isinstance(case, tuple):
            isolated(check, kernels, *case)
        else:
            isolated(check, kernels, case)
    except AssertionError as exc:
        return str(exc)
    return None


def explicit(name: str, kernels) -> list[dict]:
    """Every @example kept on the property's test, in source order, run once each."""
    _, check, describe = PROPERTIES[name]
    rows = []
    for example in reversed(TESTS[name].hypothesis_explicit_examples):
        case = example.args[0] if example.args else next(iter(example.kwargs.values()))
        message = _run(check, kernels, case)
        status = "pass" if message is None else "FAIL"
        found = "" if message is None else signature(message)
        print(f"{status:4s}  {describe(case)}\n      {found}")
        rows.append(
            {
                "status": status,
                "kind": describe(case),
                "example": repr(case),
                "message": (message or "")[:2000],
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=150)
    parser.add_argument("--only", choices=sorted(PROPERTIES), action="append")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--explicit",
        action="store_true",
        help="run the tests' kept @examples instead of drawing new calls",
    )
    args = parser.parse_args()
    report = {}
    with tempfile.TemporaryDirectory(prefix="attngen-census-") as folder:
        kernels = build_api_kernels(Path(folder))
        use_registry(kernels.registry)
        for name in args.only or PROPERTIES:
            if args.explicit:
                print(f"\n== {name}: kept examples")
                report[name] = explicit(name, kernels)
                continue
            result = census(name, kernels, args.examples)
            failures = sum(len(v) for v in result["groups"].values())
            print(f"\n== {name}: {failures} of {result['runs']} calls failed")
            rows = []
            for (sig, kind), found in sorted(
                result["groups"].items(), key=lambda item: -len(item[1])
            ):
                smallest = min(found, key=lambda f: f[0])
                print(f"{len(found):4d}  {kind}\n      {sig}")
                rows.append(
                    {
                        "count": len(found),
                        "kind": kind,
                        "signature": sig,
                        "example": repr(smallest[1]),
                        "message": smallest[2][:2000],
                    }
                )
            report[name] = {"runs": result["runs"], "failures": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
