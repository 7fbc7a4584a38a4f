"""Training-step benchmark: a Llama-3-8B-shaped transformers model, attngen against SDPA and
FlexAttention, tokens per second of forward + loss + backward.

The model is built from a LlamaConfig with Llama-3-8B's shapes (hidden 4096, 32 query / 8 KV
heads, head dim 128, MLP 14336, vocab 128256) and random bf16 weights, with --layers layers
(default 2 and 4 of the real 32). A step is `model(input_ids, labels).loss.backward()` at
batch 1 and --seqlens tokens (no optimizer: its time does not depend on the attention). The
implementations take turns within each repeat (after a warm-up step each, which compiles
Flex), so a drift in the host's or the GPU's speed reaches them alike; the median of
--repeats steps is reported with the peak memory of a warmed-up step above what was
allocated before it. attngen's rows record which modules ran (the dispatch log) and refuse
a fallback: a figure is only attngen's if its gradient kernels ran.

    PYTHONPATH=. python tools/bench_train_step.py --out DIR [--layers 2,4] [--seqlens 4096,16384]

Writes bench_train_step.json under --out and prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
import transformers

import attngen

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import llama_config, steady_peak, time_once  # noqa: E402

IMPLS = ("attngen", "sdpa", "flex_attention")


def llama(layers: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(llama_config(layers)).to(torch.bfloat16).train()


def step_call(model, seqlen: int):
    ids = torch.randint(1, model.config.vocab_size, (1, seqlen), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def attngen_ran(model, step) -> dict:
    """The modules attngen dispatched in one step; raises when anything fell back."""
    model.set_attn_implementation("attngen")
    with attngen.dispatch_log() as log:
        step()
    fallbacks = sorted({d.reason for d in log if d.fallback})
    if fallbacks:
        raise RuntimeError(f"attngen fell back: {fallbacks}")
    return {"modules": sorted({d.module for d in log}), "dispatches": len(log)}


def bench_case(model, impls, seqlen: int, repeats: int) -> list[dict]:
    step = step_call(model, seqlen)
    for impl in impls:
        model.set_attn_implementation(impl)
        step()
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(repeats):
        for impl in impls:
            model.set_attn_implementation(impl)
            times[impl].append(time_once(step))
    rows = []
    for impl in impls:
        model.set_attn_implementation(impl)
        median = statistics.median(times[impl])
        row = {
            "impl": impl,
            "layers": model.config.num_hidden_layers,
            "seqlen": seqlen,
            "median_ms": median,
            "min_ms": min(times[impl]),
            "times_ms": times[impl],
            "tokens_per_s": seqlen / median * 1e3,
            "peak_mem_gib": steady_peak(step),
        }
        if impl == "attngen":
            row["ran"] = attngen_ran(model, step)
        rows.append(row)
    model.zero_grad(set_to_none=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", default="2,4")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # FlexAttention recompiles per shape; past dynamo's cache limit it silently runs eager.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    attngen.load_kernels()
    attngen.register_transformers()
    impls = args.impls.split(",")
    rows, errors = [], []
    for layers in (int(n) for n in args.layers.split(",")):
        model = llama(layers)
        for seqlen in (int(n) for n in args.seqlens.split(",")):
            try:
                rows += bench_case(model, impls, seqlen, args.repeats)
            except Exception as exc:  # one failing case must not lose the others' figures
                errors.append(
                    {
                        "layers": layers,
                        "seqlen": seqlen,
                        "error": f"{type(exc).__name__}: {exc}"[:2000],
                        "traceback": traceback.format_exc()[-4000:],
                    }
                )
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
        "errors": errors,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_train_step.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'impl':<16}{'layers':>7}{'seqlen':>8}{'median ms':>11}{'tok/s':>9}{'peak GiB':>10}")
    for row in rows:
        print(
            f"{row['impl']:<16}{row['layers']:>7}{row['seqlen']:>8}{row['median_ms']:>11.1f}"
            f"{row['tokens_per_s']:>9.0f}{row['peak_mem_gib']:>10.2f}"
        )
    for error in errors:
        print(f"ERROR layers {error['layers']} seqlen {error['seqlen']}: {error['error'][:200]}")


if __name__ == "__main__":
    main()
