"""Cold start of a kernel built on demand: from an empty cache to the first result.

Each measurement runs in a fresh Python process with an empty attngen cache (and, on a GPU,
an empty Triton cache, so the compile is paid), for head dims no example serves, and times
the phases of the first call's path:

    import     import torch, triton and attngen's runtime
    spec       the call's Need stated as a spec (selection.spec_for)
    derive     the tiling model's choice (the first derivation also imports sympy and
               compiles the model's expressions: `derive_first`; a second spec: `derive`)
    render     the module's text (plan_build: tuning lookup and Jinja, through its bytecode
               cache in the fresh cache, so compiled: `templates` says where it was kept,
               attngen/render/template_env.py)
    write      the module and the index written into the cache (atomic writes, locks)
    load       the module imported after its sha256 check
    first      the first kernel call: Triton's compile on a GPU, the interpreter's run on CPU
    second     the second call (compiled: the launch only)
    reuse      a second process asking for the same module: found in the cache, no render,
               and Triton's cache hit (no compile)

    python tools/ondemand_cold_start.py [--json OUT] [--dims 59 111 200] [--dtype fp16]

On the CPU it sets TRITON_INTERPRET=1 (render, write and load are what it measures); on the
H200 run it as is. The README's goal: spec + derive + render + write under 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def child(dims: list[int], dtype: str) -> dict:
    """The phases for each head dim in `dims`, in this (fresh) process."""
    start = time.perf_counter()
    import torch

    from attngen.build import plan_build, write_build
    from attngen.render.template_env import template_loading
    from attngen.runtime import registry, selection
    from attngen.runtime.registry import current_registry
    from attngen.tiling.prefill import derive_tiles

    device = "cuda" if torch.cuda.is_available() else "cpu"
    import triton  # noqa: F401  (what a kernel call imports; counted in `import`)

    timings: dict = {"import_s": time.perf_counter() - start, "device": device, "runs": []}
    for index, dim in enumerate(dims):
        run: dict = {"head_dim": dim}
        torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
        q = torch.randn(1, 256, 6, dim, device=device, dtype=torch_dtype)
        k = torch.randn(1, 256, 2, dim, device=device, dtype=torch_dtype)
        t = time.perf_counter()
        spec, kind, arch = selection.spec_for(prefill_need(q, k), (6, 2))
        run["spec_s"] = time.perf_counter() - t
        t = time.perf_counter()
        derive_tiles(spec, arch)
        run["derive_first_s" if index == 0 else "derive_s"] = time.perf_counter() - t
        t = time.perf_counter()
        (artifact,) = plan_build([spec], registry.tuning_dir())
        run["render_s"] = time.perf_counter() - t
        t = time.perf_counter()
        folder = registry.cache_folder(arch)
        write_build([artifact], folder)
        run["write_s"] = time.perf_counter() - t
        t = time.perf_counter()
        entry, built = selection.cached_module(spec, kind, arch)  # found: no second render
        loaded = current_registry()  # not `registry`: the module's name, used above and below
        loaded.add(entry, folder.resolve())
        loaded.module(entry.key)
        run["load_s"] = time.perf_counter() - t
        assert not built, "the module just written was rendered again"
        time_calls(run, q, k, device)
        run["config_source"] = artifact.entry["config_source"]
        run["spec_to_written_s"] = sum(
            run.get(k, 0.0) for k in ("spec_s", "derive_first_s", "derive_s", "render_s", "write_s")
        )
        timings["runs"].append(run)
    timings.update(renders=registry.render_count(), templates=template_loading())
    return timings


def prefill_need(q, k):
    """The Need of a causal flash_attn_func call on q, k (flash layout [B, N, H, D])."""
    from attngen.runtime.dispatch import need_for
    from attngen.spec import CausalAlign, KernelKind, Mask

    return need_for(
        KernelKind.prefill,
        q.transpose(1, 2),
        k.transpose(1, 2),
        mask=Mask.causal,
        align=CausalAlign.bottom_right,
        window=None,
        softcap=0.0,
        alibi=False,
        seqlen_q=256,
        seqlen_k=256,
        same_lengths=True,
    )


def time_calls(run: dict, q, k, device: str) -> None:
    """The first and the second flash_attn_func call on the loaded module, into `run`, and the
    module that served them."""
    import torch

    import attngen

    for phase in ("first", "second"):
        t = time.perf_counter()
        attngen.flash_attn_func(q, k, k, causal=True)
        if device == "cuda":
            torch.cuda.synchronize()
        run[f"{phase}_s"] = time.perf_counter() - t
    run["module"] = attngen.last_dispatch().module


def call_child(dim: int, dtype: str) -> dict:
    """One real first call (flash_attn_func), end to end, in this (fresh) process."""
    start = time.perf_counter()
    import torch

    import attngen
    from attngen.runtime import registry

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
    q = torch.randn(1, 256, 6, dim, device=device, dtype=torch_dtype)
    k = torch.randn(1, 256, 2, dim, device=device, dtype=torch_dtype)
    result: dict = {"import_s": time.perf_counter() - start, "head_dim": dim}
    for phase in ("first_call", "second_call"):
        t = time.perf_counter()
        attngen.flash_attn_func(q, k, k, causal=True)
        if device == "cuda":
            torch.cuda.synchronize()
        result[f"{phase}_s"] = time.perf_counter() - t
    result["source"] = attngen.last_dispatch().source
    result["renders"] = registry.render_count()
    return result


def spawn(args: list[str], env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[59, 111, 200])
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=["phases", "call"], help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child == "phases":
        print(json.dumps(child(options.dims, options.dtype)))
        return
    if options.child == "call":
        print(json.dumps(call_child(options.dims[0], options.dtype)))
        return
    call = ["--child", "call", "--dtype", options.dtype, "--dims", str(options.dims[0])]
    with tempfile.TemporaryDirectory() as phases_tmp, tempfile.TemporaryDirectory() as tmp:
        phases = spawn(
            ["--child", "phases", "--dtype", options.dtype, "--dims", *map(str, options.dims)],
            _env(phases_tmp),
        )
        cold_call = spawn(call, _env(tmp))  # empty caches: derive, render, write, compile
        reuse = spawn(call, _env(tmp))  # the same caches: no render, no compile
    result = {
        "phases": phases,
        "first_call_empty_caches": cold_call,
        "first_call_new_process_same_caches": reuse,
    }
    text = json.dumps(result, indent=1)
    if options.json:
        options.json.write_text(text + "\n")
    print(text)


def _env(tmp: str) -> dict:
    """Fresh attngen and Triton caches under `tmp`; the interpreter without a GPU."""
    env = {
        **os.environ,
        "ATTNGEN_CACHE": f"{tmp}/attngen",
        "ATTNGEN_ON_DEMAND": "1",
        "TRITON_CACHE_DIR": f"{tmp}/triton",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    import torch

    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return env


if __name__ == "__main__":
    main()
