"""One dynamic-cache decode step's attention, as transformers calls it (H200): attngen's
function against SDPA's, device time per call (each kernel's, from torch.profiler) and wall
time per call of back-to-back calls, at Llama-3-8B's attention (32 / 8 heads, D 128, bf16)
with one query token against Nk cached keys at batch 1, 8 and 64.

A DynamicCache hands the layer exactly the written keys [B, HKV, Nk, D], so Nk grows every
step. The "attngen" row calls the function with no mask, the route such a step takes where
no decode module serves it: the prefill kind (one query row per program's tile, each query
head's program reading its KV head: GQA's keys read once per query head). The "attngen
decode kind" row runs the same step on a decode-kind module (flash_attn_with_kvcache,
cache_seqlens = Nk), which reads each KV head once: the route the "attngen" mask function
gives a DynamicCache's steps (attngen/runtime/hf.py). Last, the wall time per call
of each route when the key count grows by one a call, as it does between decode steps.

    PYTHONPATH=. python tools/profile_dynamic_decode.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention

import attngen

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_graph import kernel_times  # noqa: E402  (each kernel's device time)

BATCHES = (1, 8, 64)
KEYS = (160, 1024)
CALLS = 200


def layer() -> LlamaAttention:
    config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128
    )
    config._attn_implementation = "sdpa"
    return LlamaAttention(config, layer_idx=0)


def wall_us(call) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def growing_rows(module, batch: int) -> list[dict]:
    """Wall time per call of CALLS calls whose key count grows by one each (Nk 128 onwards),
    as a DynamicCache's steps do: every call is a new shape, so no plan keyed on shapes
    serves it. Routes: the transformers function given no mask (the prefill kind), given the
    mask function's CacheLengths (a decode module), and SDPA's."""
    from attngen.runtime.hf import CacheLengths

    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    buffer = torch.randn(2, batch, 8, 128 + CALLS, 128, device="cuda", dtype=torch.bfloat16)
    keys = [buffer[:, :, :, : 128 + i] for i in range(CALLS)]
    attngen_function, sdpa = ALL_ATTENTION_FUNCTIONS["attngen"], ALL_ATTENTION_FUNCTIONS["sdpa"]
    lengths = [
        CacheLengths(torch.full((batch,), 128 + i, device="cuda", dtype=torch.int32), True)
        for i in range(CALLS)
    ]
    routes = {
        "attngen, no mask (prefill kind)": lambda kv, n: attngen_function(
            module, q, kv[0], kv[1], None, scaling=128**-0.5
        ),
        "attngen, CacheLengths (decode kind)": lambda kv, n: attngen_function(
            module, q, kv[0], kv[1], lengths[n], scaling=128**-0.5
        ),
        "sdpa": lambda kv, n: sdpa(module, q, kv[0], kv[1], None, scaling=128**-0.5),
    }
    rows = []
    for name, route in routes.items():
        for n, kv in enumerate(keys[:8]):  # compiles both int classes, fills the caches
            route(kv, n)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for n, kv in enumerate(keys):
            route(kv, n)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / CALLS * 1e6
        rows.append({"impl": name, "batch": batch, "keys": "128 + step", "wall_us": wall})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    attngen.load_kernels()
    attngen.register_transformers()
    module = layer()
    rows = []
    for batch in BATCHES:
        for keys in KEYS:
            q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, 8, keys, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            lens = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
            for impl in ("attngen", "sdpa", "attngen decode kind"):
                if impl == "attngen decode kind":  # what the step would cost on a decode module

                    def call(q=q, k=k, v=v, lens=lens):
                        heads_last = [t.transpose(1, 2) for t in (q, k, v)]
                        return attngen.flash_attn_with_kvcache(*heads_last, cache_seqlens=lens)
                else:
                    function = ALL_ATTENTION_FUNCTIONS[impl]

                    def call(function=function, q=q, k=k, v=v):
                        return function(module, q, k, v, None, scaling=128**-0.5)[0]

                call()
                kernels = kernel_times(call, CALLS)
                row = {
                    "impl": impl,
                    "batch": batch,
                    "keys": keys,
                    "wall_us": wall_us(call),
                    "device_us": sum(kernels.values()),
                    "kernels": kernels,
                }
                if impl != "sdpa":
                    row["module"] = attngen.last_dispatch().module
                rows.append(row)
    growing = [row for batch in BATCHES for row in growing_rows(module, batch)]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
        "growing": growing,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_dynamic_decode.json").write_text(json.dumps(result, indent=1))
    print(f"{'impl':<21}{'B':>4}{'Nk':>6}{'wall us':>9}{'device us':>11}  kernels")
    for row in rows:
        names = ", ".join(f"{n[:28]} {t:.1f}" for n, t in row["kernels"].items())
        print(
            f"{row['impl']:<21}{row['batch']:>4}{row['keys']:>6}{row['wall_us']:>9.1f}"
            f"{row['device_us']:>11.1f}  {names}"
        )
    print("\nkeys growing by one a call (a DynamicCache's steps): wall us per call")
    for row in growing:
        print(f"{row['impl']:<38}{row['batch']:>4}{row['wall_us']:>9.1f}")


if __name__ == "__main__":
    main()
