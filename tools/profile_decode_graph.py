"""Where a graph-captured decode step's time goes (H200): each kernel's duration against the
replay's wall time, for attngen's decode (the rule's split count and forced 1 / 2 / 4 / 8 /
16 / 32 splits) and SDPA cuDNN, at B=1 L=4096 and B=8 L=8192 (contiguous cache, the
bench_decode cases). A replay's time minus its kernels' time is launch gaps; the kernels' time
against the bytes read says how far each one is from the copy rate.

    PYTHONPATH=. python tools/profile_decode_graph.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import copy_bandwidth, decode_module, graph_runner, make_inputs  # noqa: E402

CASES = ((1, 4096), (8, 8192))
SPLITS = (None, 1, 2, 4, 8, 16, 32)
REPLAYS = 50


def _kernel_name(name: str) -> str:
    """A kernel's name, short: torch's elementwise kernels keep their functor (a copy, a fill
    or a cast tells which tensor operation launched it), others their first 60 characters."""
    name = name.removeprefix("void ").replace("at::native::", "")
    return name[:140] if "elementwise_kernel" in name else name[:60]


def kernel_times(replay, repeats: int = REPLAYS) -> dict[str, float]:
    """Mean device time per replay (or call) of each kernel name, in us."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[_kernel_name(event.name)] += event.device_time / repeats
    return dict(totals)


def measure(label: str, fn, bytes_moved: int, bandwidth: float) -> dict:
    replay = graph_runner(fn)
    if replay is None:
        return {"case": label, "error": "graph capture failed"}
    wall = 1e3 * triton.testing.do_bench(replay, warmup=25, rep=200, return_mode="median")
    kernels = kernel_times(replay)
    busy = sum(kernels.values())
    return {
        "case": label,
        "replay_us": wall,
        "kernels_us": kernels,
        "kernel_sum_us": busy,
        "gap_us": wall - busy,
        "fraction_of_copy_rate": bytes_moved / (wall * 1e-6) / bandwidth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    module, _ = decode_module("contiguous", None)
    rows = []
    for batch, length in CASES:
        q, k, v, seqlens, k_cache, v_cache, _ = make_inputs(batch, length, "contiguous", None)
        bytes_moved = 2 * k.numel() * 2 + 2 * q.numel() * 2
        for splits in SPLITS:
            module.FORCE_NUM_SPLITS = splits

            def step(q=q, kc=k_cache, vc=v_cache, s=seqlens):
                return module.decode(q, kc, vc, s)

            step()
            label = f"B={batch} L={length} attngen splits={splits or 'rule'}"
            row = measure(label, step, bytes_moved, bandwidth)
            row["splits"] = module.LAST_NUM_SPLITS
            rows.append(row)
        module.FORCE_NUM_SPLITS = None
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q=q, k=k, v=v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        rows.append(measure(f"B={batch} L={length} sdpa cudnn", cudnn, bytes_moved, bandwidth))
    (args.out / "profile_decode_graph.json").write_text(json.dumps(rows, indent=1))
    print(f"{'case':44} {'replay us':>9} {'kernels':>8} {'gap':>6} {'copy frac':>9}  kernels")
    for row in rows:
        if "error" in row:
            print(f"{row['case']:44} {row['error']}")
            continue
        parts = ", ".join(f"{name[:28]} {us:.1f}" for name, us in row["kernels_us"].items())
        print(
            f"{row['case']:44} {row['replay_us']:9.1f} {row['kernel_sum_us']:8.1f} "
            f"{row['gap_us']:6.1f} {row['fraction_of_copy_rate']:9.2f}  {parts}"
        )


if __name__ == "__main__":
    main()
