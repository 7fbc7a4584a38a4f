"""Prefill through the public functions at model shapes, beside SDPA's backends, in one process.

What a user calls, timed as the user calls it: `attngen.flash_attn_func` (flash-attn's
[B, N, H, D] layout), `attngen.flash_attn_varlen_func` (the same batch packed, every sequence
of length N), `attngen.scaled_dot_product_attention` ([B, H, N, D]), and torch SDPA with the
cuDNN, flash and default backends on the same inputs. Each row: the median time per call of
back-to-back calls (triton.testing.do_bench: the GPU's time from each call's start to its end,
which includes the host's launch time when the host is the slower side), the ratio of cuDNN's
time to it (>= 0.8 is the target), and the peak memory the call allocates beyond its inputs
(torch.cuda.max_memory_allocated after a reset) against cuDNN's.

Shapes (fp16 / bf16 as the models run): GPT-2 (B 8, N 1024, 12 heads, D 64, causal), BERT-base
(B 32, N 512, 12 heads, D 64, no mask), Llama-3-8B (B 16, N 1024, 32 / 8 heads, D 128, causal).

    PYTHONPATH=. python tools/bench_public_prefill.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen

CASES = (
    # name, batch, seqlen, q heads, kv heads, head dim, dtype, causal
    ("gpt2", 8, 1024, 12, 12, 64, torch.float16, True),
    ("bert_base", 32, 512, 12, 12, 64, torch.float16, False),
    ("llama3_8b", 16, 1024, 32, 8, 128, torch.bfloat16, True),
)
ANCHORS = {
    "sdpa_cudnn": [SDPBackend.CUDNN_ATTENTION],
    "sdpa_flash": [SDPBackend.FLASH_ATTENTION],
    "sdpa_default": None,
}


def runners(batch, seqlen, hq, hkv, dim, dtype, causal) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seqlen + hq)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    q, k, v = (
        randn(batch, seqlen, hq, dim),
        randn(batch, seqlen, hkv, dim),
        randn(batch, seqlen, hkv, dim),
    )
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, H, N, D]
    packed = [t.reshape(batch * seqlen, t.shape[2], dim) for t in (q, k, v)]
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seqlen
    gqa = hq != hkv
    out = {
        "attngen.flash_attn_func": lambda: attngen.flash_attn_func(q, k, v, causal=causal),
        "attngen.flash_attn_varlen_func": lambda: attngen.flash_attn_varlen_func(
            *packed, cu, cu, seqlen, seqlen, causal=causal
        ),
        "attngen.scaled_dot_product_attention": lambda: attngen.scaled_dot_product_attention(
            qh, kh, vh, is_causal=causal, enable_gqa=gqa
        ),
    }
    for name, backends in ANCHORS.items():

        def run(backends=backends):
            if backends is None:
                return torch.nn.functional.scaled_dot_product_attention(
                    qh, kh, vh, is_causal=causal, enable_gqa=gqa
                )
            with sdpa_kernel(backends):
                return torch.nn.functional.scaled_dot_product_attention(
                    qh, kh, vh, is_causal=causal, enable_gqa=gqa
                )

        out[name] = run
    return out


def peak_extra(fn) -> int:
    """Bytes a call allocates beyond what is allocated before it (its output included)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


def bench_case(case) -> dict:
    name, batch, seqlen, hq, hkv, dim, dtype, causal = case
    row: dict = {"case": name, "batch": batch, "seqlen": seqlen, "heads": [hq, hkv], "dim": dim}
    row.update(dtype=str(dtype), causal=causal, ms={}, peak_bytes={}, errors={})
    for label, fn in runners(batch, seqlen, hq, hkv, dim, dtype, causal).items():
        try:
            fn()
            torch.cuda.synchronize()
            row["ms"][label] = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            row["peak_bytes"][label] = peak_extra(fn)
        except Exception as exc:  # noqa: BLE001 - a backend that refuses the case is recorded
            torch.cuda.synchronize()
            row["errors"][label] = f"{type(exc).__name__}: {exc}"[:300]
    row["dispatch"] = str(attngen.last_dispatch())[:400]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [bench_case(case) for case in CASES]
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_public_prefill.json").write_text(
        json.dumps({**meta, "rows": rows}, indent=1)
    )
    print(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}")
    print(f"{'case':10} {'call':38} {'ms':>8} {'cuDNN/it':>8} {'peak MiB':>9} {'cuDNN MiB':>9}")
    for row in rows:
        cudnn_ms = row["ms"].get("sdpa_cudnn")
        cudnn_peak = row["peak_bytes"].get("sdpa_cudnn")
        for label, ms in row["ms"].items():
            ratio = f"{cudnn_ms / ms:8.2f}" if cudnn_ms else " " * 8
            peak = row["peak_bytes"][label] / 2**20
            anchor = f"{cudnn_peak / 2**20:9.1f}" if cudnn_peak is not None else " " * 9
            print(f"{row['case']:10} {label:38} {ms:8.3f} {ratio} {peak:9.1f} {anchor}")
        for label, error in row["errors"].items():
            print(f"{row['case']:10} {label:38} {error}")


if __name__ == "__main__":
    main()
