"""Tree drafts on the H200: a speculative step of 8 or 16 draft tokens verified as a tree
(decode()'s tree_mask) against the same step as a causal chain (no tree_mask).

Llama-3-8B's decode (bf16, 32 query / 8 KV heads, D 128), B 8 x L 8k / 32k, contiguous and
paged-16 caches (pages shuffled), every sequence L keys, one module per layout with
max_query_tokens 16 rendered from examples/llama3_8b.yaml. The tree is EAGLE-like: each
token's parent a random earlier token, per sequence ([B, NQ, NQ]). Times are the median of
triton.testing.do_bench replaying a CUDA graph of the call (eager too); the fraction is K and
V read once plus q and out over the best time, against the device copy rate measured in the
same run (tools/bench_decode.py's copy_bandwidth).

    PYTHONPATH=. python tools/bench_decode_tree.py --out results/ [--quick]

Target (issue "Decode at the bandwidth bound"): the tree costs what the chain costs (its mask
is read on the last key blocks only); the chain's targets are 8 tokens >= 0.85 of the copy rate
at B 8 L 8k and >= 0.95 at L 32k, 16 tokens >= 0.8 at B 8 L 32k.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.bench_decode import copy_bandwidth, graph_runner  # noqa: E402
from tools.bench_decode_fp8 import HKV, HQ, LAYOUTS, D, make_step, module_for  # noqa: E402

CASES = [(8, 8192), (8, 32768)]
TOKENS = (8, 16)


def random_trees(batch: int, tokens: int, seed: int) -> torch.Tensor:
    """[B, NQ, NQ] bool on the GPU: each token's ancestors and itself."""
    gen = torch.Generator().manual_seed(seed)
    trees = torch.eye(tokens, dtype=torch.bool).repeat(batch, 1, 1)
    for b in range(batch):
        for i in range(1, tokens):
            trees[b, i] |= trees[b, int(torch.randint(0, i, (), generator=gen))]
    return trees.cuda()


def time_call(module, step, tree) -> dict:
    """us eager and replayed from a CUDA graph (median of do_bench) of one decode step."""
    q, k_cache, v_cache, seqlens, table = step

    def run():
        return module.decode(q, k_cache, v_cache, seqlens, block_table=table, tree_mask=tree)

    eager = 1e3 * triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    replay = graph_runner(run)
    graph = None
    if replay is not None:
        graph = 1e3 * triton.testing.do_bench(replay, warmup=25, rep=200, return_mode="median")
    return {"us": eager, "us_graph": graph}


def bench_case(batch, length, tokens, bandwidth, modules) -> dict:
    result: dict = {"batch": batch, "length": length, "tokens": tokens, "cells": {}}
    tree = random_trees(batch, tokens, seed=tokens)
    moved = 2 * batch * HKV * length * D * 2 + 2 * batch * HQ * tokens * D * 2
    for (layout, page_size), module in modules.items():
        step = make_step(batch, length, layout, page_size, False, tokens)[:5]
        for label, mask in (("chain", None), ("tree", tree)):
            cell = time_call(module, step, mask)
            best = min(t for t in (cell["us"], cell["us_graph"]) if t is not None)
            cell.update(bytes=moved, us_best=best, fraction=moved / (best * 1e-6) / bandwidth,
                        splits=module.LAST_NUM_SPLITS)  # fmt: skip
            result["cells"][f"{layout}{page_size or ''}_{label}"] = cell
        del step
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="L 8k only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
        copy_bandwidth_TBps=bandwidth / 1e12,
    )
    modules = {(layout, page): module_for(layout, page, False, 16) for layout, page in LAYOUTS}
    results = []
    for batch, length in CASES[:1] if args.quick else CASES:
        for tokens in TOKENS:
            results.append(bench_case(batch, length, tokens, bandwidth, modules))
            print(json.dumps(results[-1]), flush=True)
            text = json.dumps(dict(meta=meta, results=results), indent=1)
            (args.out / "bench_decode_tree.json").write_text(text)
    print_summary(meta, results)


def print_summary(meta, results) -> None:
    print(f"\n{meta}\n(best of eager and graph, us; fraction of the copy rate; tree / chain)")
    for r in results:
        cells = []
        for layout, page in LAYOUTS:
            name = f"{layout}{page or ''}"
            chain, tree = r["cells"][f"{name}_chain"], r["cells"][f"{name}_tree"]
            cells.append(
                f"{name}: chain {chain['us_best']:7.1f} ({chain['fraction']:.2f}) tree "
                f"{tree['us_best']:7.1f} ({tree['fraction']:.2f}) "
                f"{tree['us_best'] / chain['us_best']:.2f}x"
            )
        print(f"B={r['batch']:<3d} L={r['length']:<6d} NQ={r['tokens']:<2d} " + " | ".join(cells))


if __name__ == "__main__":
    main()
