"""Where the model benchmark's time and memory go (H200): the questions tools/bench_model.py
leaves open, answered with torch.profiler, attngen beside SDPA in one process.

1. Eager decode (transformers' dynamic and static caches, greedy, batch 8): per decode step,
   the wall time, the GPU's busy time, the host's top operators by self CPU time, and the
   count of calls that can make the host wait for the device (the synchronizes, cudaMemcpyAsync,
   .item() and bool(tensor)): a wait per
   layer serializes host and device, which is what an eager step cannot afford.
2. Prefill of 1024 tokens: the operators that allocate the most CUDA memory
   (profile_memory), to say where attngen's peak exceeds SDPA's.

Same model as tools/bench_model.py (Llama-3-8B config, random bf16 weights, 8 layers by
default).

    PYTHONPATH=. python tools/profile_model.py --out DIR [--layers 8] [--new 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import build_decode_module, decode_options, llama_config  # noqa: E402

import attngen  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def waits_of(events) -> dict[str, int]:
    """Calls that can make the host wait for the device: the synchronizes, copies (a
    device-to-host one waits) and aten::_local_scalar_dense (.item(), bool(tensor))."""
    counts: dict[str, int] = {}
    for event in events:
        if event.name in WAITS or event.name in ("cudaMemcpyAsync", "aten::_local_scalar_dense"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def decode_profile(model, impl: str, mode: str, batch: int, new: int) -> dict:
    ids = torch.randint(1, model.config.vocab_size, (batch, 128), device="cuda")

    def generate():
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                **decode_options(mode),
            )

    generate()  # compiles and builds what the steps need
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    generate()
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate()
        torch.cuda.synchronize()
    events = prof.events()
    gpu_us = sum(e.device_time for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "impl": impl,
        "mode": mode,
        "batch": batch,
        "new": new,
        "wall_ms_per_step": wall_ms / new,
        "gpu_ms_per_step": gpu_us / 1e3 / new,
        "waits": waits_of(events),
        "top_cpu": [(e.key, round(e.self_cpu_time_total / new, 1), e.count) for e in top],
    }


def prefill_memory(model, impl: str, tokens: int) -> dict:
    ids = torch.randint(1, model.config.vocab_size, (1, tokens), device="cuda")

    def forward():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    forward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True
    ) as prof:
        forward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    top = sorted(prof.key_averages(), key=lambda e: e.self_device_memory_usage, reverse=True)[:10]
    return {
        "impl": impl,
        "tokens": tokens,
        "peak_extra_mib": peak / 2**20,
        "top_allocating_ops": [
            (e.key, round(e.self_device_memory_usage / 2**20, 1), e.count) for e in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    config = llama_config(args.layers)
    attngen.load_kernels(build_decode_module(config, args.out))
    attngen.register_transformers()
    with torch.device("cuda"):
        import transformers

        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    decode, memory = [], []
    for impl in ("attngen", "sdpa"):
        model.set_attn_implementation(impl)
        for mode in ("dynamic", "static"):
            decode.append(decode_profile(model, impl, mode, args.batch, args.new))
        memory.append(prefill_memory(model, impl, 1024))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    result.update(decode=decode, prefill_memory=memory)
    (args.out / "profile_model.json").write_text(json.dumps(result, indent=1))
    for row in decode:
        print(
            f"{row['impl']:8} {row['mode']:8} B {row['batch']}: {row['wall_ms_per_step']:.2f} ms a "
            f"step, GPU busy {row['gpu_ms_per_step']:.2f} ms, host waits {row['waits']}"
        )
        for name, us, count in row["top_cpu"][:6]:
            print(f"    {name[:60]:60} {us:9.1f} us a step ({count} calls)")
    for row in memory:
        print(f"{row['impl']:8} prefill {row['tokens']}: peak +{row['peak_extra_mib']:.1f} MiB")
        for name, mib, count in row["top_allocating_ops"][:6]:
            print(f"    {name[:60]:60} {mib:9.1f} MiB ({count} calls)")


if __name__ == "__main__":
    main()
