"""Cross-compile the decode kernels for any target, no GPU: what their chosen configs really need.

The decode split kernel is compiled as `decode()` launches it on contiguous caches (unit
head-dim strides, 16-divisible pointers and row strides), with the row tile of the config
(BLOCK_M) and the spec's largest split count's path (DIRECT=False, LSE stored). The record has
the fields of attngen.verify.compiler.compile_one (shared, regs, spills, mma); the combine and
append kernels are tiny and are not modelled. Triton is imported lazily (the build path never loads
this module); tests/test_decode_tiling.py holds every example's chosen config to the model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import multiprocessing
import os
import tempfile
from pathlib import Path
from typing import Any

from attngen.render import render_module
from attngen.spec import AttnSpec, KernelKind, specs_from_data
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.prefill import TileConfig
from attngen.verify.compiler import (
    _compiled_not_interpreted,
    compile_source,
)

_POINTER_TYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
_UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
_INT_POINTERS = ("SeqLens", "BlockTable")
_FP32_POINTERS = ("Lse", "PartOut", "PartLse", "Slopes")


def _load_split_kernel(spec: AttnSpec, arch: str) -> Any:
    derivation = derive_decode_tiles(spec, arch)
    if derivation.chosen is None:  # the kernel text does not depend on the config
        derivation = dataclasses.replace(derivation, chosen=TileConfig(16, 64, 4, 2))
    source = render_module(spec, KernelKind.decode, derivation)
    with tempfile.TemporaryDirectory() as tmp, _compiled_not_interpreted():
        path = Path(tmp) / f"decode_oracle_{spec.spec_hash()}.py"
        path.write_text(source)
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    return module._decode_split_kernel


def decode_kernel_source(spec: AttnSpec, kernel: Any, config: TileConfig) -> Any:
    from triton.compiler import ASTSource

    constexprs: dict[str, Any] = {name: 1 for name in _UNIT_STRIDES}
    constexprs.update(DIRECT=False, STORE_LSE=True, BLOCK_ROWS=config.block_m,
                      BLOCK_N=config.block_n)
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "Out"):
            signature[name] = _POINTER_TYPES[spec.dtype.value]
        elif name in _INT_POINTERS:
            signature[name] = "*i32"
        elif name in _FP32_POINTERS:
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        if signature[name].startswith("*") or (name.startswith("stride_")
                                               and not name.startswith("stride_bt")):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, attrs=attrs,
                     constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})


def compile_decode(spec: AttnSpec, arch: str, config: TileConfig) -> dict[str, Any]:
    """One cross-compile of the split kernel; a failure is recorded in `error`."""
    return compile_source(
        lambda: decode_kernel_source(spec, _load_split_kernel(spec, arch), config), arch, config)


def _run_job(payload: tuple[dict[str, Any], str, TileConfig]) -> dict[str, Any]:
    data, arch, config = payload
    (spec,) = specs_from_data(data)
    return compile_decode(spec, arch, config)


def compile_decode_many(jobs: list[tuple[AttnSpec, str, TileConfig]],
                        processes: int = 2) -> list[dict[str, Any]]:
    """Compile in spawned workers without TRITON_INTERPRET (see compiler.compile_iter)."""
    payload = [(spec.model_dump(mode="json"), arch, config) for spec, arch, config in jobs]
    saved = {name: os.environ.get(name) for name in ("TRITON_CACHE_DIR", "TRITON_INTERPRET")}
    with tempfile.TemporaryDirectory(prefix="attngen-decode-oracle-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        os.environ.pop("TRITON_INTERPRET", None)
        try:
            context = multiprocessing.get_context("spawn")
            with context.Pool(max(1, min(processes, len(payload)))) as pool:
                return pool.map(_run_job, payload, chunksize=1)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
