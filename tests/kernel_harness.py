"""Helpers for tests that run generated kernels: load a module, make inputs, judge the output
(with attngen.reference.compare_to_reference, the rule of shared/RELIABILITY.md)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import tempfile
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from attngen.reference import compare_to_reference, random_inputs
from attngen.render import render_module
from attngen.spec import AttnSpec, KernelKind, module_name, specs_from_data
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.prefill import derive_tiles

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_MODULE_DIR = Path(tempfile.mkdtemp(prefix="attngen-test-modules-"))
_counter = itertools.count()


def make_spec(**fields) -> AttnSpec:
    base = dict(
        name="t",
        archs=["sm90"],
        dtype="fp16",
        head_dim=64,
        num_q_heads=4,
        num_kv_heads=2,
        mask="causal",
        causal_align="bottom_right",
        kernels=["prefill"],
    )
    base.update(fields)
    if base["mask"] == "none":
        base.pop("causal_align", None)
    return specs_from_data(base)[0]


@cache
def load_kernel(
    spec: AttnSpec,
    block_m: int | None = None,
    block_n: int | None = None,
    arch: str = "sm90",
    kind: KernelKind | str = KernelKind.prefill,
) -> ModuleType:
    """Render the spec's module of `kind` to a real .py file and import it (the JIT needs a
    file).

    block_m/block_n override the derived tiles, to put block boundaries where a test wants them.
    """
    kind = KernelKind(kind)
    derive = derive_decode_tiles if kind is KernelKind.decode else derive_tiles
    source = render_module(spec, kind, derive(spec, arch))
    name = f"{module_name(spec, kind)}_{next(_counter)}"
    path = _MODULE_DIR / f"{name}.py"
    path.write_text(source)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    if block_m is not None:
        module.CONFIG["BLOCK_M"] = block_m
    if block_n is not None:
        module.CONFIG["BLOCK_N"] = block_n
        if hasattr(module, "SEPARATE_V_CONFIG"):  # an absorbed MLA decode's other tile
            module.SEPARATE_V_CONFIG["BLOCK_N"] = block_n
    return module


def make_inputs(spec: AttnSpec, batch: int, seqlen_q: int, seqlen_k: int, *, seed: int, **kwargs):
    """q, k, v (and ALiBi slopes) from a seed; see attngen.reference.random_inputs."""
    return random_inputs(spec, batch, seqlen_q, seqlen_k, seed=seed, **kwargs)


def assert_matches_reference(
    spec: AttnSpec, out, lse, q, k, v, *, sm_scale=None, slopes=None, sinks=None
):
    """The RELIABILITY.md criterion for out and lse, plus exact NaN/inf placement."""
    problems = compare_to_reference(
        spec, out, lse, q, k, v, sm_scale=sm_scale, alibi_slopes=slopes, sinks=sinks
    )
    assert not problems, "; ".join(problems)
