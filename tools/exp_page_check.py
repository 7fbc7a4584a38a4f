"""Experiment: what checking block-table entries costs paged decode, by where the check sits.

Variants are text edits of today's generated llama3_8b paged-16 decode module (sm90):
  prescan    today's kernel: the split's block-table entries scanned once before the loop
             (_pages_ok), the loop only masks loads of pages outside the cache;
  postscan   the same scan after the loop (its latency at the end instead of the start);
  mask_only  no NaN for a bad page, loads masked (the cost of the mask alone; not safe
             semantics, a lower bound);
against the module rendered before any bound (--baseline, see tools/bench_bounds_cost.py).
A fourth variant measured on 2026-11-30, per-key flags carried through the loop and reduced
after it, cost 1.07x / 1.05x / 1.49x / 1.11x at B1 L4096 / B8 L8192 / B64 L4096 / B8 L32768
(the flags' block-table loads were rematerialized in another layout each iteration); the
scan 1.05x / 1.03x / 1.02x / 1.06x, the masks alone 1.02x / 1.02x / 1.02x / 1.06x.
Timed from CUDA graphs, alternating; prints a table last, writes exp_page_check.json to --out.

    PYTHONPATH=. python tools/exp_page_check.py --baseline bounds_baseline --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from bench_bounds_cost import CURRENT_DECODE, decode_rows, report  # noqa: E402
from bench_decode import load_by_path  # noqa: E402

SCAN = (
    "    fits = fits & _pages_ok(BlockTable, off_b, stride_btb, stride_btp, scan_first, "
    "scan_end,\n                            scan_first < scan_end, num_pages)\n"
)
EPILOGUE = "    # -- epilogue ---"


def variants(source: str) -> dict[str, str]:
    for marker in (SCAN, EPILOGUE):
        assert marker in source, marker
    bare = source.replace(SCAN, "")
    return {
        "prescan": source,
        "postscan": bare.replace(EPILOGUE, SCAN + EPILOGUE),
        "mask_only": bare,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    old = load_by_path(args.baseline / "decode.py", "pages_baseline")
    rows = []
    for name, text in variants((ROOT / CURRENT_DECODE).read_text()).items():
        path = args.out / f"decode_{name}.py"
        path.write_text(text)
        try:
            for row in decode_rows(old, load_by_path(path, f"pages_{name}")):
                rows.append(dict(row, variant=name))
        except Exception as exc:  # noqa: BLE001 - one variant failing still reports the others
            rows.append(dict(variant=name, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    report(
        rows,
        args.out / "exp_page_check.json",
        label="variant",
        head="variant | shape | before us | variant us",
    )


if __name__ == "__main__":
    main()
