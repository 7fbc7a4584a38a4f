"""Which files a public call passes through on its way to the kernel launch, on the CPU.

The repository's generated modules are loaded with their launches stubbed out (as
tools/host_overhead_cpu.py does), each call is made twice (the first fills the route cache
and the module's call plans), and the second is traced with sys.setprofile: every Python
frame entered, by file. Counted are attngen's files and the generated module's, not torch,
triton or the standard library; the launch itself is the stub. The issue's targets: a planned
flash_attn_func call through at most 3 files, flash_attn_with_kvcache through at most 12.

    python tools/call_path.py [--verbose]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors are served under the interpreter
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools.host_overhead_cpu import generated_module_calls  # noqa: E402

CALLS = (
    "flash_attn_func (bert)",
    "flash_attn_func causal (gpt2)",
    "scaled_dot_product_attention (bert)",
    "flash_attn_varlen_func causal (llama3)",
    "flash_attn_with_kvcache (qwen, L 64)",
    "flash_attn_with_kvcache paged (llama3)",
    "transformers attention causal (gpt2)",
)


def files_entered(call) -> Counter[str]:
    """file -> frames entered in it by one call (attngen and generated modules only)."""
    entered: Counter[str] = Counter()

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if f"{os.sep}attngen{os.sep}" in name or f"{os.sep}generated{os.sep}" in name:
                entered[str(Path(name).resolve().relative_to(ROOT))] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="list the files of each call")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls = generated_module_calls()
    print("files a planned call passes through (launch stubbed), frames entered")
    for name in CALLS:
        calls[name]()  # the route, the plans
        entered = files_entered(calls[name])
        print(f"  {name:42s}{len(entered):4d} files{sum(entered.values()):6d} frames")
        for file, count in entered.most_common() if args.verbose else ():
            print(f"      {count:4d}  {file}")


if __name__ == "__main__":
    main()
