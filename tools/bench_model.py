"""Model benchmark: a Llama-3-8B-shaped transformers model with attngen, SDPA and FlexAttention.

The model is built from a LlamaConfig with Llama-3-8B's shapes (hidden 4096, 32 query / 8 KV
heads, head dim 128, MLP 14336, vocab 128256) and random bf16 weights, with --layers layers
(default 8 of the real 32, so that a run fits the GPU time; attention and MLP time both scale
with layers, so per-layer figures transfer). For each attention implementation, in one process:

- prefill latency at --prefill prompt lengths (batch 1, logits of the last token only) and
  the peak memory of a warmed-up forward above what was allocated before it;
- decode throughput: greedy generate() of --new tokens after a --prompt-token prompt at batch
  sizes --batches (static lengths, no padding): new tokens per second, prefill included, for
  each --decode-modes mode: "dynamic" (transformers' DynamicCache; attngen runs the steps
  on a contiguous-cache decode module, cache_seqlens every sequence's key count), "static"
  (cache_implementation="static", eager: attngen runs the steps on that decode module with
  device-side cache_seqlens) and "graph"
  (the static cache with generate()'s torch.compile of the forward, mode "reduce-overhead":
  the decode steps are CUDA-graph replays).

The contiguous decode module the decode modes run on is built from the config into
--out/kernels first (the committed llama3_8b decode module is paged) and loaded before
generated/. A graph row's modules are those dispatched by its first, compiling call (replays
run no Python, so they count nothing).

The implementations take turns within each repeat of a case (the graph mode excepted: each
compiles once), so a drift in the host's speed reaches them alike; eager decode is host-bound.
Every attngen measurement records which generated modules ran (the ops' run counts) and
whether anything fell back (the dispatch log): a figure is only attngen's if its kernels ran.
Writes bench_model.json under --out and prints a short table last. Usage, on the H200:

    PYTHONPATH=. python tools/bench_model.py --out results/ [--layers 8] [--quick]
        [--decode-modes dynamic,static,graph]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import traceback
from pathlib import Path

import torch
import transformers

import attngen
from attngen.runtime import ops

IMPLS = ("attngen", "sdpa", "flex_attention")


def llama_config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=40960,
        rope_theta=500000.0,
        dtype="bfloat16",
    )


def timed(fn, repeats: int) -> list[float]:
    """Milliseconds of each call after a warm-up call, measured with CUDA events."""
    fn()
    return [time_once(fn) for _ in range(repeats)]


def time_once(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def interleaved(model, impls, fn, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of each impl's calls of fn, the impls taking turns within every repeat
    (after one warm-up call each), so that a drift in the host's speed (eager decode is
    host-bound: 2x between runs minutes apart) reaches every impl alike."""
    for impl in impls:
        model.set_attn_implementation(impl)
        fn()
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(repeats):
        for impl in impls:
            model.set_attn_implementation(impl)
            times[impl].append(time_once(fn))
    return times


def kernels_that_ran(run):
    """Run `run` and return what attngen dispatched and which modules it ran, with counts."""
    ops.reset_run_counts()
    with attngen.dispatch_log() as log:
        run()
    fallbacks = sorted({d.reason for d in log if d.fallback})
    counts = {Path(key).stem: n for key, n in ops.run_counts().items()}
    return {"modules": counts, "dispatches": len(log), "fallbacks": fallbacks}


def prefill_call(model, seqlen):
    ids = torch.randint(1, model.config.vocab_size, (1, seqlen), device="cuda")

    def forward():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return forward


def steady_peak(fn) -> float:
    """GiB a warmed-up call allocates at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def bench_prefill(model, impls, seqlen, repeats) -> list[dict]:
    forward = prefill_call(model, seqlen)
    times = interleaved(model, impls, forward, repeats)
    rows = []
    for impl in impls:
        model.set_attn_implementation(impl)
        row = {
            "impl": impl,
            "phase": "prefill",
            "tokens": seqlen,
            "median_ms": statistics.median(times[impl]),
            "min_ms": min(times[impl]),
            "times_ms": times[impl],
            "peak_mem_gib": steady_peak(forward),
        }
        if impl == "attngen":
            row["ran"] = kernels_that_ran(forward)
        rows.append(row)
    return rows


DECODE_MODES = ("dynamic", "static", "graph")


def decode_options(mode: str) -> dict:
    """generate()'s cache options of a decode mode (see the module docstring)."""
    if mode == "dynamic":
        return {}
    if mode == "static":
        return {"cache_implementation": "static", "disable_compile": True}
    if mode == "graph":
        compiled = transformers.CompileConfig(mode="reduce-overhead", fullgraph=False)
        return {"cache_implementation": "static", "compile_config": compiled}
    raise ValueError(f"--decode-modes: got {mode!r}; allowed: {', '.join(DECODE_MODES)}")


def generate_call(model, batch, prompt, new, mode):
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device="cuda")
    options = decode_options(mode)

    def generate():
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                **options,
            )

    return generate


def bench_decode(model, impls, batch, prompt, new, repeats, mode="dynamic") -> list[dict]:
    """Eager modes take turns (interleaved); the graph mode runs one impl after the other,
    each compiled once (switching would re-enter torch.compile's guards at every turn)."""
    generate = generate_call(model, batch, prompt, new, mode)
    if mode == "graph":
        times, ran = {}, {}
        for impl in impls:
            model.set_attn_implementation(impl)
            if impl == "attngen":
                ran[impl] = kernels_that_ran(generate)  # the compiling call
            times[impl] = timed(generate, repeats)
    else:
        times = interleaved(model, impls, generate, repeats)
        ran = {}
        if "attngen" in impls:
            model.set_attn_implementation("attngen")
            ran["attngen"] = kernels_that_ran(generate)
    rows = []
    for impl in impls:
        median = statistics.median(times[impl])
        row = {
            "impl": impl,
            "phase": f"decode-{mode}",
            "batch": batch,
            "prompt": prompt,
            "new": new,
            "median_ms": median,
            "min_ms": min(times[impl]),
            "times_ms": times[impl],
            "tokens_per_s": batch * new / median * 1e3,
        }
        if impl in ran:
            row["ran"] = ran[impl]
        rows.append(row)
    return rows


def build_decode_module(config, out: Path) -> Path:
    """The config's attention as a contiguous-cache decode module (what a transformers static
    cache step runs on), built into out/kernels; returns that folder."""
    from attngen.build import plan_build, write_build
    from attngen.spec import specs_from_data
    from attngen.spec.hf import spec_data_from_config

    data = spec_data_from_config(config, archs=["sm90"], name="bench_llama")
    data.update(kernels=["decode"], kv_layout="contiguous")
    folder = out / "kernels"
    write_build(plan_build(specs_from_data(data)), folder)
    return folder


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--prefill", default="1024,8192,32768")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-modes", default=",".join(DECODE_MODES))
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    prefill = [int(n) for n in args.prefill.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        prefill, batches, args.repeats, args.new = prefill[:2], batches[:2], 2, 16
    # FlexAttention recompiles per shape; past dynamo's cache limit it silently runs eager.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    config = llama_config(args.layers)
    modes = [mode for mode in args.decode_modes.split(",") if mode]  # "": prefill rows only
    for mode in modes:
        decode_options(mode)  # refused by name before anything runs
    if modes:
        attngen.load_kernels(build_decode_module(config, args.out))
    else:
        attngen.load_kernels()
    attngen.register_transformers()
    spec = attngen.spec_from_config(config, archs=["sm90"])[0]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    rows, errors = [], []
    impls = args.impls.split(",")
    cases = [("prefill", n) for n in prefill]
    cases += [(f"decode-{mode}", b) for mode in modes for b in batches]
    for phase, size in cases:
        try:
            if phase == "prefill":
                rows += bench_prefill(model, impls, size, args.repeats)
            else:
                mode = phase.removeprefix("decode-")
                rows += bench_decode(model, impls, size, args.prompt, args.new, args.repeats, mode)
        except Exception as exc:  # one failing case must not lose the others' figures
            errors.append(
                {
                    "impls": impls,
                    "phase": phase,
                    "size": size,
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                    "traceback": traceback.format_exc()[-4000:],
                }
            )
            torch.cuda.empty_cache()
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "layers": args.layers,
        "spec": spec.canonical(),
        "rows": rows,
        "errors": errors,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_model.json").write_text(json.dumps(result, indent=1))
    print_table(rows, errors)


def print_table(rows, errors) -> None:
    print(
        f"\n{'impl':<15}{'phase':<15}{'size':>7}{'median ms':>11}{'tok/s':>10}{'peak GiB':>10}"
        "  attngen modules (runs)"
    )
    for row in rows:
        size = row.get("tokens", row.get("batch"))
        ran = row.get("ran")
        ran_text = ""
        if ran:
            ran_text = ", ".join(f"{m} ({n})" for m, n in ran["modules"].items())
            if ran["fallbacks"]:
                ran_text += f"; FALLBACK: {ran['fallbacks']}"
        tps = f"{row['tokens_per_s']:.0f}" if "tokens_per_s" in row else ""
        peak = f"{row['peak_mem_gib']:.2f}" if "peak_mem_gib" in row else ""
        print(
            f"{row['impl']:<15}{row['phase']:<15}{size:>7}{row['median_ms']:>11.2f}{tps:>10}"
            f"{peak:>10}  {ran_text}"
        )
    for error in errors:
        print(f"ERROR {error['impls']} {error['phase']} {error['size']}: {error['error'][:200]}")


if __name__ == "__main__":
    main()
