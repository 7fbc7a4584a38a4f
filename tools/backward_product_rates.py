"""Where the backward's time goes against cuDNN's: each gradient kernel's rate per product.

The generated backward recomputes what an atomic-dQ backward (cuDNN, FlashAttention 2/3)
computes once: the dK/dV kernel forms S = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q
(four products), and the dQ kernel forms S, dP and dQ += dS K again (three), seven products
where the others do five (at D 256 the split dK/dV launches make it eight: dV's S, dV; dK's S,
dP, dK). The benchmark counts five (2.5x the forward's FLOPs), so at cuDNN's rate per product
this design reaches 5/7 of cuDNN's TFLOP/s. This tool puts numbers on that: each kernel's
TFLOP/s from the autotune's timings of the kernel alone (tuning/sm90.json, the backward grid's
N 4096 cells: B 4, H 2048 / D), against the anchors' TFLOP/s in one bench_backward run (the
same cells):

    python tools/backward_product_rates.py [--bench docs/results/bench_backward_....json]

No GPU needed: it reads the two files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "docs" / "results" / "bench_backward_split_2026-12-01.json"
TUNING = ROOT / "tuning" / "sm90.json"
PRODUCTS = {"backward_dq": 3, "backward_dkdv": 4, "backward_dv": 2, "backward_dk": 3}
HEAD_DIMS = {"d64": 64, "d128": 128, "d256": 256}


def product_tflop(head_dim: int, batch: int, heads: int, seqlen: int, causal: bool) -> float:
    """One [N, N] x [N, D] product's TFLOP, halved under a causal mask (the bench's count)."""
    flop = 2.0 * batch * heads * seqlen * seqlen * head_dim
    return flop / (2.0 if causal else 1.0) / 1e12


def kernel_rows(tuning: dict) -> dict[tuple[int, bool], list[tuple[str, int, float, float]]]:
    """(D, causal) -> [(kernel, products, ms, TFLOP/s)] for the backward grid's specs."""
    rows: dict[tuple[int, bool], list[tuple[str, int, float, float]]] = {}
    for key, entry in tuning["entries"].items():
        kernel = key.split("/")[1]
        name = entry.get("spec_name", "")
        if kernel not in PRODUCTS or not name.startswith("backward_grid_"):
            continue
        _, _, variant, mask = name.split("_")
        bucket = entry["buckets"]["train_n4096"]
        causal = mask == "causal"
        one = product_tflop(
            HEAD_DIMS[variant], bucket["batch"], bucket["heads"][0], bucket["seqlen"], causal
        )
        ms = entry["median_ms"]["train_n4096"]
        rate = PRODUCTS[kernel] * one / (ms / 1e3)
        rows.setdefault((HEAD_DIMS[variant], causal), []).append(
            (kernel, PRODUCTS[kernel], ms, rate)
        )
    return rows


def used_kernels(
    kernels: list[tuple[str, int, float, float]],
) -> list[tuple[str, int, float, float]]:
    """The launches a module runs: dQ and either the fused dK/dV or the split dV and dK."""
    names = {kernel for kernel, *_ in kernels}
    drop = "backward_dkdv" if {"backward_dv", "backward_dk"} <= names else ""
    return [row for row in kernels if row[0] != drop]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, default=BENCH)
    args = parser.parse_args()
    tuning = json.loads(TUNING.read_text())
    bench = json.loads(args.bench.read_text())
    cells = {(c["head_dim"], c["causal"]): c for c in bench["cells"] if c["seqlen"] == 4096}
    print(
        f"bench: {args.bench.name} ({bench['gpu']}, {bench['when'][:10]});",
        "kernels: tuning/sm90.json",
    )
    print(
        "| D | mask | kernel TFLOP/s (products) | per product | cuDNN | FA2 | / cuDNN per product |"
        " 5 / products x that |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (head_dim, causal), kernels in sorted(kernel_rows(tuning).items()):
        launched = used_kernels(kernels)
        products = sum(p for _, p, _, _ in launched)
        one = launched[0][3] * launched[0][2] / 1e3 / launched[0][1]  # one product's TFLOP
        total_ms = sum(ms for _, _, ms, _ in launched)
        per_product = products * one / (total_ms / 1e3)
        anchors = cells[(head_dim, causal)]["results"]
        cudnn = anchors["sdpa_cudnn"]["backward_tflops"]
        fa2 = anchors["sdpa_flash"]["backward_tflops"]
        each = ", ".join(
            f"{k.removeprefix('backward_')} {rate:.0f} ({p})" for k, p, _, rate in launched
        )
        ratio = per_product / cudnn
        print(
            f"| {head_dim} | {'causal' if causal else 'full'} | {each} | {per_product:.0f} |"
            f" {cudnn:.0f} | {fa2:.0f} | {ratio:.2f} | {5 / products * ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
