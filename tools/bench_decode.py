"""Decode benchmark on the H200: attngen's decode kernel against SDPA and FlexAttention.

One process, the same inputs, in alternation; bf16, 32 query heads / 8 KV heads, D = 128, one
query token. Cases: B=1 L=4096, B=8 L=8192, B=8 L=32768, B=64 L=4096, each with a contiguous
cache and paged caches of 16 and 64 tokens per page (pages in a shuffled order). Bytes = K and
V read once plus q and out; bandwidth is reported as a fraction of the device copy rate
measured in the same run (a large tensor copy_, bytes read + written / time). Times are the
median of triton.testing.do_bench, eagerly and replayed from a CUDA graph (what a serving
loop does; it removes the Python launch overhead, which at B=1 exceeds the kernel time).

The attngen modules are loaded from generated/ by path (importlib) when an example spec has
that layout (llama3_8b: paged 16), else rendered from the same spec with the layout changed.

    PYTHONPATH=. python tools/bench_decode.py --out results/ [--no-flex] [--quick]

Targets (docs/performance.md): B=1 L=4096 <= 15 us; B=8 L=8192/32768 and B=64 L=4096 >= 90%
of the copy rate; paged within 10% of contiguous at page >= 16.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.build import plan_build  # noqa: E402
from attngen.spec import KernelKind, KvLayout, load_spec_file  # noqa: E402

HQ, HKV, D = 32, 8, 128
CASES = ((1, 4096), (8, 8192), (8, 32768), (64, 4096))
LAYOUTS = (("contiguous", None), ("paged", 16), ("paged", 64))
TARGET_US_B1 = 15.0
TARGET_FRACTION = 0.90


def load_by_path(path: Path, name: str):
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def decode_module(layout: str, page_size: int | None):
    """generated/sm90's llama3_8b decode module when it has this layout, else a render."""
    spec = load_spec_file(ROOT / "examples" / "llama3_8b.yaml")[0]
    index = json.loads((ROOT / "generated" / "index.json").read_text())
    if spec.kv_layout.value == layout and spec.page_size == page_size:
        entry = next(
            e
            for e in index["modules"]
            if e["arch"] == "sm90" and e["kind"] == "decode" and e["spec_hash"] == spec.spec_hash()
        )
        return load_by_path(ROOT / "generated" / entry["path"], "bench_" + entry["module"]), entry[
            "path"
        ]
    spec = spec.model_copy(
        update={"kv_layout": KvLayout(layout), "page_size": page_size, "archs": ("sm90",)}
    )
    artifact = next(a for a in plan_build([spec]) if a.entry["kind"] == KernelKind.decode.value)
    path = Path(tempfile.mkdtemp(prefix="attngen-bench-")) / Path(artifact.relative_path).name
    path.write_text(artifact.source)
    return load_by_path(path, f"bench_decode_{layout}_{page_size}"), f"rendered ({path.name})"


def copy_bandwidth() -> float:
    """Device-to-device copy rate, bytes read + written per second (1 GiB each way)."""
    src = torch.empty(2**29, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def graph_runner(fn):
    """fn captured in a CUDA graph (after a warm-up that compiles), or None if capture fails."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception:  # noqa: BLE001 - an anchor that cannot be captured is timed eagerly only
        torch.cuda.synchronize()
        return None


def make_inputs(batch: int, length: int, layout: str, page_size: int | None):
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + length)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, HKV, length, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, HKV, length, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    if layout == "contiguous":
        return q, k, v, seqlens, k, v, None
    pages_per_seq = length // page_size
    order = torch.randperm(batch * pages_per_seq, device="cuda", generator=gen)
    table = order.view(batch, pages_per_seq).to(torch.int32)
    k_pages = torch.empty(
        batch * pages_per_seq, page_size, HKV, D, device="cuda", dtype=torch.bfloat16
    )
    v_pages = torch.empty_like(k_pages)
    # Page p of sequence b holds keys [p * page_size, (p + 1) * page_size).
    k_pages[table.long().view(-1)] = (
        k.view(batch, HKV, pages_per_seq, page_size, D)
        .permute(0, 2, 3, 1, 4)
        .reshape(-1, page_size, HKV, D)
    )
    v_pages[table.long().view(-1)] = (
        v.view(batch, HKV, pages_per_seq, page_size, D)
        .permute(0, 2, 3, 1, 4)
        .reshape(-1, page_size, HKV, D)
    )
    return q, k, v, seqlens, k_pages, v_pages, table


def anchors(q, k, v, use_flex: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    runners = {}
    for name, backend in (
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
    ):

        def run(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        runners[name] = run
    if use_flex:
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        runners["flex"] = lambda: compiled(q, k, v, enable_gqa=True)
    return runners


def bench_case(batch, length, bandwidth, use_flex, modules):
    bytes_moved = 2 * batch * HKV * length * D * 2 + 2 * batch * HQ * D * 2
    result = dict(
        batch=batch,
        length=length,
        bytes=bytes_moved,
        us={},
        us_graph={},
        fraction={},
        errors={},
        max_abs_diff={},
        modules={},
    )
    reference = None
    dense = None
    for layout, page_size in LAYOUTS:
        label = f"attngen_{layout}" + (f"{page_size}" if page_size else "")
        module, source = modules[(layout, page_size)]
        result["modules"][label] = source
        q, k, v, seqlens, k_cache, v_cache, table = make_inputs(batch, length, layout, page_size)
        dense = dense or (q, k, v)
        result["splits_" + label] = module._num_splits(
            batch * HKV,
            k_cache.shape[2] if table is None else table.shape[1] * page_size,
            module.CONFIG["BLOCK_N"],
            module._sm_count(q.device),
        )[0]

        def runner(m=module, q=q, kc=k_cache, vc=v_cache, s=seqlens, t=table):
            return m.decode(q, kc, vc, s, block_table=t)

        _time(result, label, runner, bytes_moved, bandwidth)
        out = runner()
        if reference is None:
            reference = out
        else:
            result["max_abs_diff"][label] = (out.float() - reference.float()).abs().max().item()
    q, k, v = dense
    for name, runner in anchors(q, k, v, use_flex).items():
        try:
            out = runner()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a backend that refuses the case is recorded
            result["errors"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        result["max_abs_diff"][name] = (out.float() - reference.float()).abs().max().item()
        _time(result, name, runner, bytes_moved, bandwidth)
    return result


def _time(result, name, runner, bytes_moved, bandwidth):
    result["us"][name] = 1e3 * triton.testing.do_bench(
        runner, warmup=25, rep=200, return_mode="median"
    )
    replay = graph_runner(runner)
    if replay is not None:
        result["us_graph"][name] = 1e3 * triton.testing.do_bench(
            replay, warmup=25, rep=200, return_mode="median"
        )
    best = min(result["us"][name], result["us_graph"].get(name, math.inf))
    result["fraction"][name] = bytes_moved / (best * 1e-6) / bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--quick", action="store_true", help="B=1 L=4096 and B=8 L=8192 only")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 1000
    torch._dynamo.config.accumulated_cache_size_limit = 1000
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
        copy_bandwidth_TBps=bandwidth / 1e12,
    )
    modules = {(layout, page): decode_module(layout, page) for layout, page in LAYOUTS}
    meta["configs"] = {
        f"{layout}{page or ''}": m.CONFIG for (layout, page), (m, _) in modules.items()
    }
    results = []
    for batch, length in CASES[:2] if args.quick else CASES:
        results.append(bench_case(batch, length, bandwidth, not args.no_flex, modules))
        print(json.dumps(results[-1]), flush=True)
        (args.out / "bench_decode.json").write_text(
            json.dumps(dict(meta=meta, results=results), indent=1)
        )
    print_summary(meta, results)


def print_summary(meta, results):
    print(f"\n{meta}")
    names = [
        "attngen_contiguous",
        "attngen_paged16",
        "attngen_paged64",
        "sdpa_cudnn",
        "sdpa_flash",
        "flex",
    ]
    print(
        f"{'case':16s} " + " ".join(f"{n:>22s}" for n in names) + "  (us eager/graph, "
        "fraction of copy rate)"
    )
    for r in results:
        cells = []
        for n in names:
            if n in r["us"]:
                graph = r["us_graph"].get(n, float("nan"))
                cells.append(f"{r['us'][n]:7.1f}/{graph:6.1f} {r['fraction'][n]:5.2f}")
            else:
                cells.append(f"{'refused' if n in r['errors'] else '-':>22s}")
        print(f"B={r['batch']:<3d} L={r['length']:<8d} " + " ".join(f"{c:>22s}" for c in cells))
    print(
        "targets: B=1 L=4096 <= 15 us; B=8 L=8192/32768 and B=64 L=4096 >= 0.90 of copy; "
        "paged16/64 within 10% of contiguous"
    )
    for r in results:
        best = {n: min(r["us"][n], r["us_graph"].get(n, math.inf)) for n in r["us"]}
        contiguous = best.get("attngen_contiguous", math.nan)
        verdicts = []
        if (r["batch"], r["length"]) == (1, 4096):
            ok = contiguous <= TARGET_US_B1
            verdicts.append(f"B1 {contiguous:.1f} us {'ok' if ok else 'MISS'}")
        else:
            fraction = r["fraction"].get("attngen_contiguous", 0.0)
            verdicts.append(
                f"fraction {fraction:.2f} {'ok' if fraction >= TARGET_FRACTION else 'MISS'}"
            )
        for page in ("attngen_paged16", "attngen_paged64"):
            ratio = best.get(page, math.nan) / contiguous
            verdicts.append(f"{page} {ratio:.2f}x {'ok' if ratio <= 1.10 else 'MISS'}")
        print(f"B={r['batch']} L={r['length']}: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
