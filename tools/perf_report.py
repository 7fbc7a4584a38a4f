"""Turn a bench_prefill.json into a Markdown table and a PNG chart (for docs/performance.md).

    python tools/perf_report.py docs/results/bench_prefill_2026-11-30_tuned.json \
        --png docs/results/prefill_h200.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ANCHORS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex")
TITLES = {"sdpa_cudnn": "cuDNN", "sdpa_flash": "FA2", "sdpa_efficient": "mem-eff", "flex": "Flex"}


def markdown(data: dict) -> str:
    meta, results = data["meta"], data["results"]
    head = ["case", "config", "attngen"] + [TITLES[a] for a in ANCHORS]
    head += [f"/ {TITLES[a]}" for a in ("sdpa_cudnn", "sdpa_flash", "flex")]
    lines = [
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. "
        "TFLOP/s, then attngen's ratio to each anchor.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    ratios: dict[str, list[float]] = {a: [] for a in ANCHORS}
    for r in results:
        t, c = r["tflops"], r["config"]
        ours = t["attngen"]
        cells = [
            r["label"],
            f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}",
            f"{ours:.0f}",
        ]
        cells += [f"{t[a]:.0f}" if a in t else "-" for a in ANCHORS]
        cells += [
            f"{ours / t[a]:.2f}" if a in t else "-" for a in ("sdpa_cudnn", "sdpa_flash", "flex")
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if "bench_specs" in r.get("spec_file", ""):
            for a in ANCHORS:
                if a in t:
                    ratios[a].append(ours / t[a])
    lines.append("")
    for a, values in ratios.items():
        if values:
            geo = math.exp(sum(map(math.log, values)) / len(values))
            lines.append(
                f"- geometric mean over the {len(values)} grid cells, attngen / "
                f"{TITLES[a]}: {geo:.2f}"
            )
    return "\n".join(lines) + "\n"


def chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    names = ("attngen", *ANCHORS)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(16, 6))
    for i, name in enumerate(names):
        values = [r["tflops"].get(name, 0.0) for r in results]
        ax.bar(
            [x + i * width for x in range(len(results))],
            values,
            width,
            label=TITLES.get(name, name),
        )
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(results))])
    ax.set_xticklabels([r["label"] for r in results], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s (bf16)")
    meta = data["meta"]
    ax.set_title(
        f"Prefill forward on {meta['gpu']} (torch {meta['torch']}, triton "
        f"{meta['triton']}, {meta['date']})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    data = json.loads(args.json.read_text())
    print(markdown(data))
    if args.png:
        chart(data, args.png)


if __name__ == "__main__":
    main()
