"""Experiment (H200): which decode launch configs and split counts read the KV cache fastest?

Sweeps BLOCK_N, num_warps, num_stages and the split count (the derived one, half, double) of
the llama3_8b decode module (contiguous and paged 16) on bench_decode's cases, timed from CUDA
graph replays as tools/bench_decode.py times them; prints the best per case and writes JSON.
    PYTHONPATH=. python tools/exp_decode.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import (  # noqa: E402  (a sibling script, not a package)
    HKV,
    copy_bandwidth,
    decode_module,
    graph_runner,
    make_inputs,
)

CASES = ((1, 4096), (8, 8192), (64, 4096))
CONFIGS = list(itertools.product((64, 128), (4, 8), (1, 2, 3, 4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for layout, page in (("contiguous", None), ("paged", 16)):
        module, _ = decode_module(layout, page)
        default = dict(module.CONFIG)
        for batch, length in CASES:
            q, _, _, seqlens, k_cache, v_cache, table = make_inputs(batch, length, layout, page)
            moved = 2 * batch * HKV * length * 128 * 2
            span = k_cache.shape[2] if table is None else table.shape[1] * page
            for block_n, warps, stages in CONFIGS:
                module.CONFIG.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
                module.FORCE_NUM_SPLITS = None
                derived = module._num_splits(
                    batch * HKV, span, block_n, module._sm_count(q.device)
                )[0]
                for splits in sorted({derived, max(1, derived // 2), derived * 2}):
                    module.FORCE_NUM_SPLITS = splits
                    replay = graph_runner(
                        lambda m=module, a=(q, k_cache, v_cache, seqlens), t=table: m.decode(
                            *a, block_table=t
                        )
                    )
                    if replay is None:
                        continue
                    us = 1e3 * triton.testing.do_bench(
                        replay, warmup=10, rep=60, return_mode="median"
                    )
                    rows.append(
                        dict(
                            layout=layout,
                            page=page,
                            batch=batch,
                            length=length,
                            block_n=block_n,
                            warps=warps,
                            stages=stages,
                            splits=splits,
                            derived_splits=derived,
                            us=us,
                            fraction=moved / (us * 1e-6) / bandwidth,
                        )
                    )
            module.FORCE_NUM_SPLITS = None
            module.CONFIG.update(default)
            (args.out / "exp_decode.json").write_text(
                json.dumps(dict(gpu=torch.cuda.get_device_name(), bandwidth=bandwidth, rows=rows))
            )
    print_summary(rows)


def print_summary(rows: list[dict]) -> None:
    """Per (layout, batch, length): the default config's time against the sweep's best."""
    for (layout, batch, length), group in itertools.groupby(
        rows, key=lambda r: (r["layout"], r["batch"], r["length"])
    ):
        group = list(group)
        best = min(group, key=lambda r: r["us"])
        base = next(
            (
                r
                for r in group
                if (r["block_n"], r["warps"], r["stages"]) == (64, 4, 3)
                and r["splits"] == r["derived_splits"]
            ),
            None,
        )
        print(
            f"{layout:10s} B={batch:3d} L={length:6d} default "
            f"{base['us'] if base else float('nan'):7.1f} us | best {best['us']:7.1f} us "
            f"({best['fraction']:.2f} of copy) BN={best['block_n']} w{best['warps']} "
            f"s{best['stages']} splits {best['splits']} (derived {best['derived_splits']})"
        )


if __name__ == "__main__":
    main()
