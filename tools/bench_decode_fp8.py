"""fp8 KV cache decode on the H200: attngen's decode step over an fp8 e4m3 cache (kv_dtype:
fp8_e4m3, per-(sequence, KV head) descales) against the same step over a bf16 cache.

Llama-3-8B's decode (bf16 q, 32 query / 8 KV heads, D 128), one query token (and, with
--tokens 8, eight: a speculative or chunked-prefill step), B 1/8/64 x L 4k/8k/32k, contiguous
and paged-16 caches (pages in a shuffled order), every sequence L keys. Both modules are
rendered from examples/llama3_8b.yaml with the layout (and kv_dtype) changed. Times are the
median of triton.testing.do_bench replaying a CUDA graph of the call (eager too); bytes are
K and V read once in the cache's dtype plus q and out, as a fraction of the device copy rate
measured in the same run (tools/bench_decode.py's copy_bandwidth).

    PYTHONPATH=. python tools/bench_decode_fp8.py --out results/ [--quick] [--tokens 8]

Target (issue "Decode at the bandwidth bound"): at L >= 8k an fp8 step takes <= 0.6x the
bf16 step's time (half the bytes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.build import plan_build  # noqa: E402
from attngen.spec import KernelKind, KvDtype, KvLayout, load_spec_file  # noqa: E402
from tools.bench_decode import copy_bandwidth, graph_runner, load_by_path  # noqa: E402

HQ, HKV, D = 32, 8, 128
CASES = [(b, n) for b in (1, 8, 64) for n in (4096, 8192, 32768)]
LAYOUTS = (("contiguous", None), ("paged", 16))
TARGET_RATIO = 0.6


def module_for(layout: str, page_size: int | None, fp8: bool, tokens: int):
    """llama3_8b's decode module with this cache, rendered to a temporary file."""
    spec = load_spec_file(ROOT / "examples" / "llama3_8b.yaml")[0]
    spec = spec.model_copy(
        update={
            "kv_layout": KvLayout(layout),
            "page_size": page_size,
            "archs": ("sm90",),
            "kernels": (KernelKind.decode,),
            "max_query_tokens": tokens,
            "kv_dtype": KvDtype.fp8_e4m3 if fp8 else None,
            "backward": False,
        }
    )
    artifact = next(a for a in plan_build([spec]) if a.entry["kind"] == KernelKind.decode.value)
    path = Path(tempfile.mkdtemp(prefix="attngen-bench-fp8-")) / Path(artifact.relative_path).name
    path.write_text(artifact.source)
    return load_by_path(path, f"bench_fp8_{layout}{page_size or ''}_{fp8}_{tokens}")


def make_step(batch: int, length: int, layout: str, page_size: int | None, fp8: bool, tokens):
    """(q, k_cache, v_cache, cache_seqlens, block_table, descales): random caches in the
    layout, every sequence `length` keys."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + length)
    q = torch.randn(batch, HQ, tokens, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    if layout == "contiguous":
        shape, table = (batch, HKV, length, D), None
    else:
        pages = batch * (length // page_size)
        order = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)
        shape, table = (pages, page_size, HKV, D), order.view(batch, -1)
    caches = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv"]
    descales = {}
    if fp8:
        caches = [c.to(torch.float8_e4m3fn) for c in caches]
        descales = {
            name: torch.rand(batch, HKV, device="cuda", generator=gen) + 0.5
            for name in ("k_descale", "v_descale")
        }
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    return q, *caches, seqlens, table, descales


def time_step(module, step) -> dict:
    """us eager and replayed from a CUDA graph (median of do_bench)."""
    q, k_cache, v_cache, seqlens, table, descales = step

    def run():
        return module.decode(q, k_cache, v_cache, seqlens, block_table=table, **descales)

    eager = 1e3 * triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    replay = graph_runner(run)
    graph = None
    if replay is not None:
        graph = 1e3 * triton.testing.do_bench(replay, warmup=25, rep=200, return_mode="median")
    return {"us": eager, "us_graph": graph}


def bench_case(batch, length, tokens, bandwidth, modules) -> dict:
    result: dict = {"batch": batch, "length": length, "tokens": tokens, "cells": {}}
    for (layout, page_size, fp8), module in modules.items():
        label = f"{layout}{page_size or ''}_{'fp8' if fp8 else 'bf16'}"
        step = make_step(batch, length, layout, page_size, fp8, tokens)
        cell = time_step(module, step)
        element = 1 if fp8 else 2
        moved = 2 * batch * HKV * length * D * element + 2 * batch * HQ * tokens * D * 2
        best = min(t for t in (cell["us"], cell["us_graph"]) if t is not None)
        cell.update(
            bytes=moved, fraction=moved / (best * 1e-6) / bandwidth, splits=module.LAST_NUM_SPLITS
        )
        result["cells"][label] = cell
        del step
        torch.cuda.empty_cache()
    for layout, page_size in LAYOUTS:
        name = f"{layout}{page_size or ''}"
        fp8, bf16 = result["cells"][f"{name}_fp8"], result["cells"][f"{name}_bf16"]
        result[f"ratio_{name}"] = _best(fp8) / _best(bf16)
    return result


def _best(cell) -> float:
    return min(t for t in (cell["us"], cell["us_graph"]) if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="B 1 and 8 at L 8k only")
    parser.add_argument("--tokens", type=int, default=1, help="query tokens per step (1..16)")
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
    modules = {
        (layout, page, fp8): module_for(layout, page, fp8, args.tokens)
        for layout, page in LAYOUTS
        for fp8 in (False, True)
    }
    cases = [(1, 8192), (8, 8192)] if args.quick else CASES
    results = []
    for batch, length in cases:
        results.append(bench_case(batch, length, args.tokens, bandwidth, modules))
        print(json.dumps(results[-1]), flush=True)
        name = f"bench_decode_fp8_q{args.tokens}.json"
        (args.out / name).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print_summary(meta, results)


def print_summary(meta, results) -> None:
    print(f"\n{meta}\n(best of eager and graph, us; fraction of the copy rate; fp8 / bf16 time)")
    for r in results:
        cells = []
        for layout, page in LAYOUTS:
            name = f"{layout}{page or ''}"
            fp8, bf16 = r["cells"][f"{name}_fp8"], r["cells"][f"{name}_bf16"]
            ratio = r[f"ratio_{name}"]
            verdict = "" if r["length"] < 8192 else (" ok" if ratio <= TARGET_RATIO else " MISS")
            cells.append(
                f"{name}: bf16 {_best(bf16):7.1f} ({bf16['fraction']:.2f}) fp8 {_best(fp8):7.1f} "
                f"({fp8['fraction']:.2f}) {ratio:.2f}x{verdict}"
            )
        print(f"B={r['batch']:<3d} L={r['length']:<6d} NQ={r['tokens']}  " + " | ".join(cells))
    print(f"target: fp8 <= {TARGET_RATIO}x bf16 at L >= 8k")


if __name__ == "__main__":
    main()
