"""Cold start of attngen.flex_attention: a new score_mod / mask_mod, from the call to its module
loaded, before the kernel runs (Triton's compile on a GPU, the interpreter on the CPU).

A fresh Python process with an empty attngen cache calls flex_attention with each of the
attention-gym mods below at D 64, one after another (the first pays what a process pays once:
reading the tiling models compiled ahead (attngen/tiling/model_store.json); in an empty
cache, the templates' compile into Jinja's bytecode cache too; the others are new modules in
a warm process); a second process on the same cache
does the same at D 128 (new modules, the templates' bytecode kept). Each first call's phases
are timed by wrapping the functions that do them:

    trace    the score_mod / mask_mod traced into expression trees (flex/cache.py `traced`)
    fields   the trees and captured tensors as spec fields (flex/attention.py `_fields`)
    spec     the call's Need stated as a spec (selection.spec_for)
    render   the tiling model's choice and the module's text (registry._render), of which
             derive is the tiling model's (attngen.build.derive_tiles)
    write    the module and the index written into the cache (registry._write)
    load     the module imported after its checks (import_verified)

`to_written` (trace + fields + spec + render + write) is the issue's "renders and writes its
module" figure, the budget 100 ms; `kernel` the first call's remaining time (the compile and
the run), not part of it. A repeated call's host time is tools/flex_host_cpu.py's.

    python tools/flex_cold_start.py [--json OUT] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("trace", "fields", "spec", "render", "write", "load", "derive")


def mods(device: str):
    """name -> (score_mod or None, mask_mod or None): attention-gym's set, each new."""
    import torch

    doc = torch.repeat_interleave(torch.arange(4, device=device), 64)[None]  # 4 documents
    bias = torch.randn(12, 511, device=device)  # a relative-bias table

    def document(b, h, q, kv):
        return doc[b, q] == doc[b, kv]

    def prefix_lm(b, h, q, kv):
        return (kv <= 64) | (q >= kv)

    def sliding(b, h, q, kv):
        return (q >= kv) & (q - kv <= 64)

    def relative(score, b, h, q, kv):
        return score + bias[h, q - kv + 255]

    def softcap(score, b, h, q, kv):
        return 30.0 * torch.tanh(score / 30.0)

    def alibi(score, b, h, q, kv):
        return score - (h + 1) * 0.0625 * torch.abs(q - kv)

    return {
        "document mask": (None, document),
        "prefix-LM": (None, prefix_lm),
        "sliding window": (None, sliding),
        "relative bias": (relative, None),
        "softcap": (softcap, None),
        "ALiBi": (alibi, None),
    }


def child(device: str, dim: int) -> dict:
    start = time.perf_counter()
    import torch

    import attngen
    from attngen import build
    from attngen.runtime import registry, selection
    from attngen.runtime.flex import attention as flex

    timings: dict = {"import_s": time.perf_counter() - start, "device": device, "head_dim": dim}
    timings["runs"] = []
    spent: dict[str, float] = {}
    for module, name, phase in (
        (flex, "traced", "trace"),
        (flex, "_fields", "fields"),
        (selection, "spec_for", "spec"),
        (registry, "_render", "render"),
        (registry, "_write", "write"),
        (flex, "import_verified", "load"),
        (build, "derive_tiles", "derive"),
    ):
        setattr(module, name, _timed(getattr(module, name), phase, spent))
    dtype = torch.float16 if device == "cuda" else torch.float32
    q = torch.randn(1, 12, 256, dim, device=device, dtype=dtype)
    for name, (score_mod, mask_mod) in mods(device).items():
        spent.clear()
        block_mask = None
        t = time.perf_counter()
        if mask_mod is not None:
            block_mask = attngen.create_block_mask(mask_mod, 1, None, 256, 256, device=device)
        mask_s = time.perf_counter() - t
        t = time.perf_counter()
        attngen.flex_attention(q, q, q, score_mod=score_mod, block_mask=block_mask)
        if device == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - t
        run = {"mod": name, "create_block_mask_s": mask_s, "first_call_s": total}
        run |= {f"{p}_s": spent.get(p, 0.0) for p in PHASES}
        run["to_written_s"] = sum(run[f"{p}_s"] for p in PHASES[:5])
        run["kernel_s"] = total - sum(spent[p] for p in PHASES[:6] if p in spent)
        run["built"] = attngen.last_dispatch().built
        timings["runs"].append(run)
    return timings


def _timed(function, phase: str, spent: dict[str, float]):
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - t

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=64, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(options.device, options.dim)))
        return
    import torch

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            f"process {i + 1}, D {dim}": _spawn(tmp, device, dim) for i, dim in enumerate((64, 128))
        }
    if options.json:
        options.json.write_text(json.dumps(result, indent=1) + "\n")
    for title, timings in result.items():
        print(f"{title}: {'mod':14s} {'to_written':>10s} " + " ".join(f"{p:>7s}" for p in PHASES))
        for run in timings["runs"]:
            phases = " ".join(f"{run[f'{p}_s'] * 1e3:7.1f}" for p in PHASES)
            print(f"{'':18s}{run['mod']:14s} {run['to_written_s'] * 1e3:8.1f}ms {phases}")


def _spawn(tmp: str, device: str, dim: int) -> dict:
    """child(device, dim) in a fresh process whose attngen and Triton caches are under tmp."""
    from ondemand_cold_start import _env  # tools/ is the script's sys.path[0]

    env = _env(tmp)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, __file__, "--child", "--device", device, "--dim", str(dim)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
