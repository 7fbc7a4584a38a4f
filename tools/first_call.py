"""A process's first attention call: `import attngen`, the attribute `attngen.flash_attn_func`
(which imports the runtime), its first call and its second, each timed in a fresh process.

    python tools/first_call.py [--runs 3] [--tree OTHER_CHECKOUT] [--device cpu|cuda]

On the CPU the calls run under Triton's interpreter (TRITON_INTERPRET=1 is set for the child);
the call is the bundled GPT-2 module's shape (fp16, D 64, causal, B 1, N 64, 2 heads). With
--tree, the runs alternate between this checkout and another one (its attngen first on
PYTHONPATH), so the two are measured side by side. Prints ms per phase and which of
torch._dynamo, sympy and attngen.render the process had imported by the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("import_attngen", "attribute", "first_call", "second_call")
CHILD = """
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import attngen
t2 = time.perf_counter(); call = attngen.flash_attn_func; t3 = time.perf_counter()
q = torch.randn(1, 64, 2, 64, dtype=torch.float16, device=sys.argv[1])
call(q, q, q, causal=True); t4 = time.perf_counter()
call(q, q, q, causal=True); t5 = time.perf_counter()
imported = [m for m in ("torch._dynamo", "sympy", "attngen.render") if m in sys.modules]
print(json.dumps({"import_attngen": t2 - t1, "attribute": t3 - t2, "first_call": t4 - t3,
                  "second_call": t5 - t4, "imported": imported, "attngen": attngen.__file__}))
"""


def run_once(tree: Path, device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", CHILD, device], env=env, capture_output=True,
                          text=True, check=True, cwd=tree)  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="another checkout, measured alternately")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    trees = [ROOT] + ([args.tree.resolve()] if args.tree else [])
    print("tree | import attngen | attribute | first call | second call (ms) | imported")
    for _ in range(args.runs):
        for tree in trees:
            r = run_once(tree, args.device)
            times = " | ".join(f"{1e3 * r[k]:.1f}" for k in PHASES)
            print(f"{tree} | {times} | {', '.join(r['imported']) or '-'}")


if __name__ == "__main__":
    main()
