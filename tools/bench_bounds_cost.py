"""What bounding the index tensors costs the kernels: a module rendered before the kernels
bounded cache_seqlens / block-table entries / cu_seqlens against the current one, same inputs,
timed in alternation from CUDA graphs (kernel time, not host time).

    git show REV:generated/sm90/llama3_8b_decode_bf16_d128_causal_br_paged16.py > OLD/decode.py
    git show REV:generated/sm90/llama3_8b_varlen_bf16_d128_causal_br.py > OLD/varlen.py
    (the current varlen module is rendered forward-only from examples/llama3_8b.yaml)
    PYTHONPATH=. python tools/bench_bounds_cost.py --baseline OLD --out DIR

Decode: bf16, 32/8 heads, D 128, one query token, a paged cache of 16 tokens per page in a
shuffled order (the layout that checks most: each block-table entry a step loads). Varlen:
causal prefill over 8 packed sequences. Prints a table last; writes bounds_cost.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from bench_decode import graph_runner, load_by_path, make_inputs  # noqa: E402

from attngen.build import plan_build  # noqa: E402
from attngen.spec import load_spec_file  # noqa: E402
from attngen.tuning.database import DEFAULT_TUNING_DIR  # noqa: E402

CURRENT_DECODE = "generated/sm90/llama3_8b_decode_bf16_d128_causal_br_paged16.py"
DECODE_CASES = ((1, 4096), (8, 8192), (64, 4096), (8, 32768))
VARLEN_CASES = ((8, 1024), (8, 4096))


def graph_us(fn) -> float:
    replay = graph_runner(fn) or fn
    return 1e3 * triton.testing.do_bench(replay, warmup=25, rep=200, return_mode="median")


def decode_rows(old, new):
    rows = []
    for batch, length in DECODE_CASES:
        q, _, _, seqlens, k_pages, v_pages, table = make_inputs(batch, length, "paged", 16)
        runs = {
            name: functools.partial(m.decode, q, k_pages, v_pages, seqlens, block_table=table)
            for name, m in (("before", old), ("bounded", new))
        }
        diff = (runs["before"]().float() - runs["bounded"]().float()).abs().max().item()
        times = {name: [graph_us(run) for _ in range(3)] for name, run in runs.items()}
        rows.append(
            dict(
                kind="decode paged16",
                shape=f"B{batch} L{length}",
                max_abs_diff=diff,
                **{name: min(t) for name, t in times.items()},
            )
        )
    return rows


def varlen_rows(old, new):
    rows = []
    for count, length in VARLEN_CASES:
        total = count * length
        gen = torch.Generator(device="cuda").manual_seed(total)
        q = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        cu = torch.arange(0, total + 1, length, device="cuda", dtype=torch.int32)
        runs = {
            name: functools.partial(m.attention_varlen, q, k, v, cu, cu, length, length)
            for name, m in (("before", old), ("bounded", new))
        }
        first = [run() for run in runs.values()]
        first = [r[0] if isinstance(r, tuple) else r for r in first]
        diff = (first[0].float() - first[1].float()).abs().max().item()
        times = {name: [graph_us(run) for _ in range(3)] for name, run in runs.items()}
        rows.append(
            dict(
                kind="varlen causal",
                shape=f"{count} x {length}",
                max_abs_diff=diff,
                **{name: min(t) for name, t in times.items()},
            )
        )
    return rows


def current_module(kind: str, out: Path) -> Path:
    """Today's module for the baseline's spec. The example trains now, so its generated varlen
    module also carries the gradient kernels and writes the LSE; the forward-only module the
    baseline was rendered from is rendered here instead, so that only the bounds differ."""
    if kind == "decode":
        return ROOT / CURRENT_DECODE
    spec = load_spec_file(ROOT / "examples" / "llama3_8b.yaml")[0]
    spec = spec.model_copy(update={"backward": False, "archs": ("sm90",)})
    tuning = DEFAULT_TUNING_DIR if DEFAULT_TUNING_DIR.is_dir() else None
    (artifact,) = [a for a in plan_build([spec], tuning) if a.entry["kind"] == "varlen"]
    path = out / "current_varlen.py"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(artifact.source)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline",
        type=Path,
        required=True,
        help="folder with decode.py and varlen.py rendered before bounding",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for kind, bench in (("decode", decode_rows), ("varlen", varlen_rows)):
        old = load_by_path(args.baseline / f"{kind}.py", f"bounds_old_{kind}")
        new = load_by_path(current_module(kind, args.out), f"bounds_new_{kind}")
        try:
            rows += bench(old, new)
        except Exception as exc:  # noqa: BLE001 - one kind failing still reports the other
            rows.append(dict(kind=kind, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    args.out.mkdir(parents=True, exist_ok=True)
    report(
        rows,
        args.out / "bounds_cost.json",
        label="kind",
        head="kernel | shape | before us | bounded us",
    )


def report(rows: list[dict], path: Path, label: str, head: str) -> None:
    """Write rows with the run's versions to `path` (JSON), then print them as a table whose
    first column is row[label]; `head` names the columns before ratio and max abs diff."""
    meta = dict(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        triton=triton.__version__,
        gpu=torch.cuda.get_device_name(),
    )
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(meta)
    print(f"| {head} | ratio | max abs diff |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row[label]} | error: {row['error']} |")
            continue
        print(
            f"| {row[label]} | {row['shape']} | {row['before']:.1f} | {row['bounded']:.1f} "
            f"| {row['bounded'] / row['before']:.3f} | {row['max_abs_diff']:.2e} |"
        )


if __name__ == "__main__":
    main()
