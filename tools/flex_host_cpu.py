"""attngen.flex_attention's own Python time per call, on the CPU, with the module stubbed out.

The modules of a few attention-gym calls are built on demand (under Triton's interpreter,
into a temporary cache) and run once; then each kept module's `attention` is replaced by a
stand-in that allocates the output and runs nothing, so what is timed is flex_attention's
share of the host time: tracing (or the trace cache's snapshot and lookup), the checks, the
module lookup, the dispatch record. Each call is timed with the trace cache on, and off (SIZE
0: every call traces, as before the cache). The anchor row is flash_attn_func over a stand-in
module of tools/host_overhead_cpu.py (the runtime's share of that call's host time).

Shape: B 1, H 12, N 64, D 64, fp16 (tools/host_overhead_cpu.py's).

    PYTHONPATH=. python tools/flex_host_cpu.py [--calls 2000] [--repeat 7]

Prints microseconds per call, the best of `repeat` runs of `calls` calls (thread CPU time).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import and_masks  # noqa: E402

import attngen  # noqa: E402
from attngen.runtime.flex import attention as flex_module  # noqa: E402
from attngen.runtime.flex import cache as trace_cache  # noqa: E402
from attngen.runtime.registry import configure, load_kernels  # noqa: E402
from tools.host_overhead_cpu import DIM, HEADS, SEQLEN, build_stub_folder, time_us  # noqa: E402

torch.manual_seed(0)
DOCS = torch.sort(torch.randint(0, 4, (1, SEQLEN)), dim=-1).values.to(torch.int32)
BIAS = torch.randn(HEADS, 2 * SEQLEN)
WINDOW = 16


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document(b, h, q_idx, kv_idx):
    return DOCS[b, q_idx] == DOCS[b, kv_idx]


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def relative(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + SEQLEN]


def calls() -> dict[str, object]:
    q = torch.randn(1, HEADS, SEQLEN, DIM, dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    blocks = {
        name: attngen.create_block_mask(fn, 1, None, SEQLEN, SEQLEN, "cpu")
        for name, fn in (
            ("causal", causal),
            ("document", and_masks(causal, document)),
            ("sliding", sliding),
        )
    }
    flex = attngen.flex_attention
    return {
        "flex_attention causal": lambda: flex(q, k, v, block_mask=blocks["causal"]),
        "flex_attention sliding window": lambda: flex(q, k, v, block_mask=blocks["sliding"]),
        "flex_attention document (and_masks)": lambda: flex(q, k, v, block_mask=blocks["document"]),
        "flex_attention relative bias + causal": lambda: flex(
            q, k, v, relative, block_mask=blocks["causal"]
        ),
    }


def stub_modules() -> None:
    """Each kept module's attention(): an allocated output, nothing run."""
    for module, _ in flex_module._modules.values():

        def attention(q, k, v, *, sm_scale=None, return_lse=False, tensors=None, **_):
            out = q.new_empty((*q.shape[:3], v.shape[-1]))
            return (out, q.new_empty(q.shape[:3], dtype=torch.float32)) if return_lse else out

        module.attention = attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        configure(on_demand=True, cache_dir=Path(tmp) / "cache")
        load_kernels()
        timed = calls()
        for call in timed.values():
            call()  # builds and runs the module once
        stub_modules()
        for name, call in timed.items():
            size = trace_cache.SIZE
            cached = time_us(call, args.calls, args.repeat)
            trace_cache.SIZE = 0  # every call traces
            trace_cache._traces.clear()
            try:
                rows[name] = (time_us(call, args.calls, args.repeat), cached)
            finally:
                trace_cache.SIZE = size
        load_kernels(build_stub_folder(Path(tmp) / "stubs", False), replace=True)
        q = torch.randn(1, SEQLEN, HEADS, DIM, dtype=torch.float16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        anchor = time_us(lambda: attngen.flash_attn_func(q, k, v), args.calls, args.repeat)
    print(f"Host time per call, us (torch {torch.__version__}, module stubbed out)")
    print(f"  {'call':42s}{'traced every call':>20s}{'trace cache':>14s}")
    for name, (before, after) in rows.items():
        print(f"  {name:42s}{before:20.1f}{after:14.1f}")
    print(f"  {'flash_attn_func (stand-in module)':42s}{'':20s}{anchor:14.1f}")


if __name__ == "__main__":
    main()
