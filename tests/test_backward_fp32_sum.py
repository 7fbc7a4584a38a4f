"""fp32 gradient accumulation: a two-level sum (each block's product, then one add per block).

fp32 dots are FMA loops that chain each product into the accumulator they are given, so
`dk = tl.dot(dsT, q, dk)` across the dK/dV kernel's loop sums every query row of every head
of the KV group in one sequential chain (at 1000 queries and 2 heads, 2000 terms: dK's max
error 3.6x the fp32 reference's on the H200). The backward templates give fp32 dQ, dK and dV
`_bwd_add_dot` instead; 16-bit keeps `tl.dot(a, b, acc)`, the MMA accumulating in place.

The text is checked here, and the compiler's output too: Triton folds `acc + tl.dot(a, b)`
back into `tl.dot(a, b, acc)`, so only the TTIR shows that the two levels survive. Numerics
under the interpreter (numpy dots) do not depend on the order; the fp32 CPU gradient tests
(test_backward_models.py, test_backward_dropout.py, test_backward_properties.py) run this
code path, the GPU test test_backward_gpu.py::test_gradients_at_real_sizes its numerics.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attngen.render import render_module
from attngen.spec import KernelKind, specs_from_data
from attngen.tiling.prefill import derive_tiles
from tests.kernel_harness import make_spec

ROOT = Path(__file__).resolve().parent.parent
# The gradient accumulations in place (a 16-bit module's; fp32's adds input_precision).
IN_PLACE = (
    "dq = tl.dot(ds.to(k.dtype), k, dq",
    "dv = tl.dot(pT.to(k.dtype), do, dv",
    "dk = tl.dot(dsT.to(k.dtype), q, dk",
)
TWO_LEVEL = (
    "dq = _bwd_add_dot(dq, ds.to(k.dtype), k)",
    "dv = _bwd_add_dot(dv, pT.to(k.dtype), do)",
    "dk = _bwd_add_dot(dk, dsT.to(k.dtype), q)",
)


def _spec(dtype: str, **fields: Any):
    return make_spec(
        dtype=dtype,
        head_dim=16,
        num_q_heads=2,
        num_kv_heads=1,
        backward=True,
        kernels=["prefill", "varlen"],
        **fields,
    )


def _source(spec) -> str:
    return render_module(spec, KernelKind.prefill, derive_tiles(spec, "sm90"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_fp32_sums_each_block_then_adds_it_16_bit_accumulates_in_place(dtype):
    source = _source(_spec(dtype))
    fp32 = dtype == "fp32"
    assert ("def _bwd_add_dot(acc, a, b):" in source) == fp32
    for two_level, in_place in zip(TWO_LEVEL, IN_PLACE, strict=True):
        assert (two_level in source) == fp32, two_level
        assert (in_place in source) != fp32, in_place


def test_fp32_dropout_sums_the_kept_probabilities_per_block():
    source = _source(_spec("fp32", dropout=True))
    assert "dv = _bwd_add_dot(dv, pdT.to(k.dtype), do)" in source
    assert "tl.dot(pdT.to(k.dtype), do, dv" not in source


def dot_accumulators(spec_fields: dict[str, Any], arch: str) -> dict[str, list[str]]:
    """Compile the gradient kernels of the spec's prefill module for `arch` (in a process not
    under the interpreter); per kernel, for each tt.dot of its TTIR, "zero" where it
    accumulates into a constant zero, else the accumulator it is given."""
    import triton
    from triton.backends.compiler import GPUTarget

    from attngen.arch import ARCHS
    from attngen.tiling.prefill import TileConfig
    from attngen.verify.compiler import fp_fusion, kernel_source, load_kernel

    (spec,) = specs_from_data(spec_fields)
    config = TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    options = {"num_warps": 4, "num_stages": 1, "enable_fp_fusion": fp_fusion(spec)}
    target = GPUTarget("cuda", ARCHS[arch].compute_capability, 32)
    found = {}
    for kernel in ("dq", "dkdv"):
        jit = load_kernel(spec, arch, KernelKind.prefill, kernel)
        source = kernel_source(spec, jit, config, backward=True)
        ttir = triton.compile(source, target=target, options=options).asm["ttir"]
        zeros = set(re.findall(r"(%[\w.]+) = arith\.constant dense<0\.000000e\+00>", ttir))
        accumulators = re.findall(r"tt\.dot %[\w.]+, %[\w.]+, (%[\w.]+)", ttir)
        found[kernel] = ["zero" if acc in zeros else acc for acc in accumulators]
    return found


def test_the_compiler_keeps_the_two_level_sum(tmp_path):
    """Every dot of the fp32 gradient kernels starts from zero: Q K^T and dO V^T, and dQ, dK,
    dV, whose block products are added by an FMA by 1.0 that Triton does not fold back.
    Compiled in a fresh process (one that imported triton under the interpreter, as this
    suite does, cannot compile), with Triton's cache in tmp_path."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = (
        f"import json, sys; from {__name__} import dot_accumulators; "
        "print(json.dumps(dot_accumulators(*json.loads(sys.argv[1]))))"
    )
    argument = json.dumps([_spec("fp32").model_dump(mode="json"), "sm80"])
    done = subprocess.run(
        [sys.executable, "-c", code, argument],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for kernel, accumulators in json.loads(done.stdout.splitlines()[-1]).items():
        assert len(accumulators) >= 3, kernel  # the dots of one loop at least
        assert set(accumulators) == {"zero"}, (kernel, accumulators)
