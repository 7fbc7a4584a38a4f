"""One cell's sm90 prefill module run a few times, for Nsight Compute to profile a kernel of it.

Builds the cell's module as tools/ab_templates.py does (the package's templates, or those of
`--alt DIR` in their place), then calls the forward (and with --backward, the backward with
deterministic=False) three times on [B, H, N, D] bf16 inputs, B = 16384 / N, H = 2048 / D.
On a CUDA machine, from the repository root, e.g.:

    ncu --clock-control none -k regex:_gluon_attn_bwd -s 1 -c 1 --set full \
        --import-source yes -o OUT/bwd python3 tools/ncu_cell.py --d 128 --n 8192 --backward

then `ncu -i OUT/bwd.ncu-rep --page source --csv --print-source sass` gives each SASS
instruction's samples and stall reasons. Prints the module's forward_path()/backward_path().
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_templates import _build  # noqa: E402

from tests.kernel_harness import make_spec  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--alt", type=Path, default=None)
    args = parser.parse_args(argv)
    batch, heads = max(1, 16384 // args.n), 2048 // args.d
    spec = make_spec(name=f"ncu_d{args.d}", head_dim=args.d, num_q_heads=heads,
                     num_kv_heads=heads, mask="causal" if args.causal else "none",
                     backward=args.backward, dtype="bf16")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        module = _build(spec, Path(tmp) / "m", args.alt and args.alt.resolve())
        q, k, v, dout = (torch.randn(batch, heads, args.n, args.d, device="cuda",
                                     dtype=torch.bfloat16) for _ in range(4))  # fmt: skip
        for _ in range(3):
            out, lse = module.attention(q, k, v, return_lse=True)
            if args.backward:
                module.attention_backward(dout, q, k, v, out, lse, deterministic=False)
        torch.cuda.synchronize()
        print(module.forward_path(), module.backward_path() if args.backward else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
