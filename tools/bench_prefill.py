"""Prefill benchmark: attngen's generated kernels against SDPA's backends and FlexAttention.

Everything runs in one process, on the same inputs, in alternation; the table reports TFLOP/s
and ratios, never a comparison with numbers measured elsewhere. FLOPs = 4 * B * H * Nq * Nk * D,
halved when causal. Usage (on a CUDA machine, from the repository root):

    PYTHONPATH=. python tools/bench_prefill.py --out results/ [--quick] [--no-flex]

attngen's modules are built as `attngen build` builds them, with the tuning database
(tuning/<arch>.json) when it has an entry for the spec: the grid's specs are
tools/bench_specs/*.yaml, the model shapes are examples/*.yaml.
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
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngen.build import plan_build
from attngen.spec import load_spec_file

GRID_HEAD_DIMS = (64, 128, 256)
GRID_SEQLENS = (1024, 4096, 16384)
TOKENS, WIDTH = 16384, 2048  # batch = TOKENS / N, heads = WIDTH / D (the FlashAttention grid)
SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


ROOT = Path(__file__).resolve().parent.parent
TUNING = ROOT / "tuning"


def load_module(spec, arch="sm90"):
    artifacts = plan_build([spec], TUNING if TUNING.is_dir() else None)
    source = next(
        a.source for a in artifacts if a.entry["arch"] == arch and a.entry["kind"] == "prefill"
    )
    folder = Path(tempfile.mkdtemp(prefix="attngen-bench-"))
    path = folder / f"{spec.name}.py"
    path.write_text(source)
    module_spec = importlib.util.spec_from_file_location(f"bench_{spec.name}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module


def grid_cases(quick: bool):
    seqlens = (1024, 4096) if quick else GRID_SEQLENS
    for head_dim in GRID_HEAD_DIMS:
        for seqlen in seqlens:
            for causal in (False, True):
                heads = WIDTH // head_dim
                kind = "causal" if causal else "full"
                yield dict(
                    label=f"D{head_dim} N{seqlen} {kind}",
                    spec_file=f"tools/bench_specs/grid_d{head_dim}_{kind}.yaml",
                    head_dim=head_dim,
                    seqlen=seqlen,
                    batch=TOKENS // seqlen,
                    q_heads=heads,
                    kv_heads=heads,
                    causal=causal,
                    window=None,
                    softcap=0.0,
                )


def model_cases():
    common = dict(seqlen=4096, batch=4, causal=True, softcap=0.0, window=None)
    yield dict(
        common,
        label="llama3-8b GQA 32/8",
        spec_file="examples/llama3_8b.yaml",
        head_dim=128,
        q_heads=32,
        kv_heads=8,
    )
    yield dict(
        common,
        label="qwen2.5-7b GQA 28/4",
        spec_file="examples/qwen2_5_7b.yaml",
        head_dim=128,
        q_heads=28,
        kv_heads=4,
    )
    yield dict(
        common,
        label="mistral-7b window 4095",
        spec_file="examples/mistral_7b.yaml",
        head_dim=128,
        q_heads=32,
        kv_heads=8,
        window=4095,
        seqlen=8192,
        batch=2,
    )
    yield dict(
        common,
        label="gemma2-9b local softcap 50",
        spec_file="examples/gemma2_9b.yaml",
        head_dim=256,
        q_heads=16,
        kv_heads=8,
        softcap=50.0,
        window=4095,
    )
    yield dict(
        common,
        label="gemma2-9b global softcap 50",
        spec_file="examples/gemma2_9b.yaml",
        variant=1,
        head_dim=256,
        q_heads=16,
        kv_heads=8,
        softcap=50.0,
    )


def spec_for(case):
    return load_spec_file(ROOT / case["spec_file"])[case.get("variant", 0)]


def flex_runner(case, q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    window, softcap = case["window"], case["softcap"]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx <= window)
        return keep

    block_mask = None
    if case["causal"] or window is not None:
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2])
    score_mod = None
    if softcap:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    gqa = q.shape[1] != k.shape[1]
    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


def sdpa_runner(backend, case, q, k, v):
    if case["window"] is not None or case["softcap"]:
        return None  # SDPA's fused backends express neither
    gqa = q.shape[1] != k.shape[1]
    if gqa and backend == "efficient":
        return None  # the mem-efficient backend refuses enable_gqa

    def run():
        with sdpa_kernel([SDPA_BACKENDS[backend]]):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=case["causal"], enable_gqa=gqa
            )

    return run


def flops(case):
    total = 4 * case["batch"] * case["q_heads"] * case["seqlen"] ** 2 * case["head_dim"]
    if case["window"] is not None:
        n, w = case["seqlen"], case["window"] + 1
        visible = sum(min(i + 1, w) for i in range(n))
        return 4 * case["batch"] * case["q_heads"] * visible * case["head_dim"]
    return total / 2 if case["causal"] else total


def bench_case(case, use_flex):
    spec = spec_for(case)
    module = load_module(spec)
    shape_q = (case["batch"], case["q_heads"], case["seqlen"], case["head_dim"])
    shape_kv = (case["batch"], case["kv_heads"], case["seqlen"], case["head_dim"])
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16)
    runners = {"attngen": lambda: module.attention(q, k, v)}
    for backend in SDPA_BACKENDS:
        runner = sdpa_runner(backend, case, q, k, v)
        if runner is not None:
            runners[f"sdpa_{backend}"] = runner
    if use_flex:
        runners["flex"] = flex_runner(case, q, k, v)
    # The config this call launches with: a module with per-length configs picks by length.
    config = getattr(module, "config_for", lambda n: module.CONFIG)(case["seqlen"])
    result = dict(case, config=config, tflops={}, ms={}, errors={})
    reference = None
    for name, runner in runners.items():
        try:
            out = runner()
            torch.cuda.synchronize()
        except Exception as exc:  # an anchor that cannot run this case is recorded, not fatal
            result["errors"][name] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        if reference is None:
            reference = out
        else:
            result.setdefault("max_abs_diff_vs_attngen", {})[name] = (
                (out.float() - reference.float()).abs().max().item()
            )
        ms = triton.testing.do_bench(runner, warmup=25, rep=100, return_mode="median")
        result["ms"][name] = ms
        result["tflops"][name] = flops(case) / ms / 1e9
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    module.attention(q, k, v)
    torch.cuda.synchronize()
    result["attngen_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
    result["output_bytes"] = q.numel() * q.element_size()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="N = 1k and 4k only")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--models-only", action="store_true", help="the example model shapes")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 1000
    torch._dynamo.config.accumulated_cache_size_limit = 1000
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    grid = [] if args.models_only else list(grid_cases(args.quick))
    for case in [*grid, *model_cases()]:
        results.append(bench_case(case, use_flex=not args.no_flex))
        print_row(results[-1], flush=True)
        # Written after every case, so a run cut short still leaves its numbers.
        (args.out / "bench_prefill.json").write_text(
            json.dumps(dict(meta=meta, results=results), indent=1)
        )
    print_summary(meta, results)


def print_row(r, flush=False):
    cells = " ".join(f"{name}={value:6.1f}" for name, value in r["tflops"].items())
    print(f"{r['label']:28s} {cells}  cfg={r['config']}", flush=flush)


def print_summary(meta, results):
    print(f"\n{meta}")
    names = ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex"]
    print(f"{'case':28s} {'attngen':>8s} " + " ".join(f"{'x' + n:>16s}" for n in names))
    ratios = {n: [] for n in names}
    for r in results:
        ours = r["tflops"].get("attngen", float("nan"))
        cells = []
        for n in names:
            if n in r["tflops"]:
                ratio = ours / r["tflops"][n]
                cells.append(f"{ratio:16.2f}")
                if "spec_file" in r and "bench_specs" in r["spec_file"]:
                    ratios[n].append(ratio)
            else:
                cells.append(f"{'-':>16s}")
        print(f"{r['label']:28s} {ours:8.1f} " + " ".join(cells))
    for n, values in ratios.items():
        if values:
            geo = math.exp(sum(math.log(x) for x in values) / len(values))
            print(f"geomean attngen / {n} over the grid: {geo:.2f} ({len(values)} cells)")


if __name__ == "__main__":
    main()
