"""Shared-memory / register oracle: cross-compile the generated prefill kernel, no GPU needed.

For a spec, a target and a list of TileConfigs, Triton compiles the rendered kernel for that
target (PTX -> cubin with ptxas) and reports what the compiled program really needs:

- ``shared``: dynamic shared memory Triton requests at launch (``metadata.shared``), bytes;
- ``static_shared``: shared memory ptxas reserves in the cubin itself (1024 B on sm90), bytes;
- ``regs`` and ``stack``: from ``cuobjdump --dump-resource-usage`` (ptxas's log as fallback);
- ``spill_stores`` / ``spill_loads``: bytes, from ptxas's ``-v`` log;

next to attngen.tiling's prediction. Compiled as ``attention()`` launches it on contiguous
tensors (unit head-dim strides constexpr 1, pointers and row strides 16-divisible). Nothing is
cached on disk: Triton's cache goes to a temporary directory, removed afterwards.

    python tools/smem_oracle.py SPEC.yaml --arch sm90 --config 128x64x8x3 --config 64x64x4x2
    python tools/smem_oracle.py SPEC.yaml --arch sm80 --all --json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sympy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attngen import tiling  # noqa: E402
from attngen.arch import ARCHS  # noqa: E402
from attngen.render import render_module  # noqa: E402
from attngen.spec import AttnSpec, KernelKind, load_spec_file, specs_from_data  # noqa: E402
from attngen.tiling import TileConfig, padded_head_dim  # noqa: E402

_POINTER_TYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
_UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
_kernels: dict[str, Any] = {}  # per process: spec hash -> imported kernel (memory only)


def as_spec(spec: AttnSpec | dict[str, Any]) -> AttnSpec:
    if isinstance(spec, AttnSpec):
        return spec
    specs = specs_from_data(spec)
    if len(specs) != 1:
        raise ValueError(f"expected one spec, got {len(specs)} variants")
    return specs[0]


def load_kernel(spec: AttnSpec) -> Any:
    """Render the prefill module, import it from a temporary file, return its JIT kernel."""
    key = spec.spec_hash()
    if key not in _kernels:
        derivation = tiling.derive_tiles(spec, spec.archs[0])
        if derivation.chosen is None:  # the kernel text does not depend on the config
            derivation = dataclasses.replace(derivation, chosen=TileConfig(64, 64, 4, 1))
        source = render_module(spec, KernelKind.prefill, derivation)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"oracle_{key}.py"
            path.write_text(source)
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)  # JIT functions keep their source in memory
        _kernels[key] = module._attn_fwd_kernel
    return _kernels[key]


def kernel_source(spec: AttnSpec, kernel: Any, config: TileConfig) -> Any:
    from triton.compiler import ASTSource

    constexprs: dict[str, Any] = {name: 1 for name in _UNIT_STRIDES}
    constexprs.update(STORE_LSE=True, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    if spec.num_q_heads == spec.num_kv_heads:
        constexprs["q_per_kv"] = 1  # Triton specializes an int argument equal to 1
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "Out"):
            signature[name] = _POINTER_TYPES[spec.dtype.value]
        elif name in ("Lse", "Slopes"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        row_stride = name.endswith(("m", "n")) and name.startswith("stride_")
        aligned = spec.head_dim % 16 == 0 and spec.value_head_dim % 16 == 0
        if signature[name].startswith("*") or name.endswith(("b", "h")) and name.startswith(
                "stride_") or (row_stride and aligned):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, attrs=attrs,
                     constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})


def _tool(name: str) -> str | None:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)
    return path if os.path.exists(path) else None


def _parse_ptxas_log(log: str) -> dict[str, int | None]:
    def grab(pattern: str) -> int | None:
        found = re.findall(pattern, log)
        return int(found[-1]) if found else None

    return {"regs": grab(r"Used (\d+) registers"), "stack": grab(r"(\d+) bytes stack frame"),
            "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"),
            "static_shared": grab(r"(\d+) bytes smem")}


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK and static SHARED of the kernel, per cuobjdump (empty when it is missing)."""
    tool = _tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin), handle.flush()
        text = subprocess.run([tool, "--dump-resource-usage", handle.name], check=True,
                              capture_output=True, text=True).stdout
    names = {"REG": "regs", "STACK": "stack", "SHARED": "static_shared"}
    return {names[k]: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED):(\d+)", text)}


def compile_one(spec: AttnSpec, arch: str, config: TileConfig) -> dict[str, Any]:
    """One cross-compile; a failure is recorded in ``error``, never raised."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    record: dict[str, Any] = {"shared": None, "static_shared": None, "regs": None, "stack": None,
                              "spill_stores": None, "spill_loads": None, "error": None}
    start = time.perf_counter()
    log = io.StringIO()
    try:
        source = kernel_source(spec, load_kernel(spec), config)
        target = GPUTarget("cuda", ARCHS[arch].compute_capability, 32)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v already runs; keep its log
            compiled = triton.compile(source, target=target, options=options)
        record.update(_parse_ptxas_log(log.getvalue()))
        record.update(_resource_usage(compiled.asm["cubin"]))
        record["shared"] = compiled.metadata.shared
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    record["compile_s"] = round(time.perf_counter() - start, 2)
    return record


def model_prediction(spec: AttnSpec, arch: str, config: TileConfig) -> dict[str, int]:
    t, target = tiling, ARCHS[arch]
    values = {t.BM: config.block_m, t.BN: config.block_n, t.W: config.num_warps,
              t.S: config.num_stages, t.D: padded_head_dim(spec.head_dim),
              t.DV: padded_head_dim(spec.value_head_dim), t.E: spec.dtype.itemsize}
    regs = t.regs_expression(*[target][:len(inspect.signature(t.regs_expression).parameters)])
    return {"model_smem": int(t.smem_expression(target).subs(values)),
            "model_regs": int(sympy.ceiling(regs.subs(values)))}


def _job(args: tuple[dict[str, Any], str, TileConfig]) -> dict[str, Any]:
    data, arch, config = args
    spec = as_spec(data)
    return {"spec": spec.name, "arch": arch, "dtype": spec.dtype.value,
            "head_dim": spec.head_dim, "head_dim_v": spec.value_head_dim,
            "D": padded_head_dim(spec.head_dim), "DV": padded_head_dim(spec.value_head_dim),
            "E": spec.dtype.itemsize, "mask": spec.mask.value, "window": spec.window,
            "softcap": spec.softcap,
            "alibi": spec.alibi, **config.as_dict(), **compile_one(spec, arch, config),
            **model_prediction(spec, arch, config)}


def run_oracle(jobs: list[tuple[AttnSpec | dict[str, Any], str, TileConfig]],
               processes: int = 2) -> list[dict[str, Any]]:
    """Compile every (spec, arch, config) job; one record per job, in order."""
    payload = [(as_spec(s).model_dump(mode="json"), a, c) for s, a, c in jobs]
    with tempfile.TemporaryDirectory(prefix="smem-oracle-") as cache:
        saved = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache  # read at compile time, inherited by workers
        try:
            if processes <= 1:
                return [_job(job) for job in payload]
            # fork: no re-import of the caller's __main__ (spawn would need a main guard there)
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            with context.Pool(processes) as pool:
                return pool.map(_job, payload, chunksize=1)
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved


def oracle(spec: AttnSpec | dict[str, Any], arch: str, configs: list[TileConfig],
           processes: int = 2) -> list[dict[str, Any]]:
    return run_oracle([(spec, arch, c) for c in configs], processes)


def _parse_config(text: str) -> TileConfig:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BMxBNxWARPSxSTAGES, e.g. 128x64x8x3")
    return TileConfig(*parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="spec YAML file (every variant is compiled)")
    parser.add_argument("--arch", action="append", choices=sorted(ARCHS), required=True)
    parser.add_argument("--config", action="append", type=_parse_config, default=[])
    parser.add_argument("--all", action="store_true", help="the tiler's whole candidate grid")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    configs = list(args.config)
    if args.all:
        configs += [TileConfig(m, n, w, s) for m in tiling.BLOCK_M_CHOICES
                    for n in tiling.BLOCK_N_CHOICES for w in tiling.NUM_WARPS_CHOICES
                    for s in tiling.NUM_STAGES_CHOICES]
    if not configs:
        parser.error("give --config BMxBNxWxS (repeatable) or --all")
    records = run_oracle([(spec, arch, c) for spec in load_spec_file(args.spec)
                          for arch in args.arch for c in configs], args.processes)
    if args.json:
        return print(json.dumps(records, indent=1)) or 0
    print(f"{'spec':<20} {'arch':<5} {'BMxBNxWxS':<12} {'shared':>7} {'model':>7} "
          f"{'regs':>4} {'model':>5} {'spill st/ld':>11}  error")
    for r in records:
        cfg = f"{r['BLOCK_M']}x{r['BLOCK_N']}x{r['num_warps']}x{r['num_stages']}"
        spill = f"{r['spill_stores']}/{r['spill_loads']}"
        print(f"{r['spec'][:20]:<20} {r['arch']:<5} {cfg:<12} {r['shared'] or '-':>7} "
              f"{r['model_smem']:>7} {r['regs'] or '-':>4} {r['model_regs']:>5} {spill:>11}  "
              f"{r['error'] or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
