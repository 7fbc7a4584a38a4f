"""The Gluon kernels compile for sm90 where a launch passes ints equal to 1 as constexprs.

Triton specialises an int argument equal to 1 into a constant of the compiled kernel: a
sequence of one query or one key, one head, MHA's group of 1. The other cross-compiles
(attngen verify-tiling --gluon, tests/test_gluon_*.py) type every int i32, so a kernel that
calls `.to()` on such a parameter (a method a constexpr lacks; `gl.cast` takes either) passes
them and fails only on the GPU (CONTRIBUTING.md). Each kernel is compiled in a spawned worker
without TRITON_INTERPRET, as verify_gluon compiles.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile

import pytest

from attngen.spec import KernelKind, specs_from_data
from attngen.tiling.gluon import derive_gluon_tiles
from attngen.tiling.gluon_backward import derive_gluon_backward
from attngen.verify import gluon as vg
from tests.kernel_harness import make_spec

ONES = ("n_q", "n_keys", "n_heads", "group", "num_m_blocks", "num_n_blocks")


def _compile_with_ones(job: tuple[dict, str]) -> str:
    """The kernel's compile error with every int of ONES it takes a constexpr 1, or ""."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    data, which = job
    (spec,) = specs_from_data(data)
    causal = spec.mask.value == "causal"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-ones-")
    with vg._compiled_not_interpreted():
        if which == "backward":
            chosen = derive_gluon_backward(spec, "sm90").chosen
            kernel = vg.gluon_kernel(spec, vg._BWD_KERNEL)
            source = vg.gluon_bwd_source(spec, kernel, chosen, causal)
        else:
            chosen = derive_gluon_tiles(spec, "sm90", KernelKind.prefill).chosen
            kernel = vg.gluon_kernel(spec)
            source = vg.gluon_source(spec, kernel, chosen, causal)
        ones = [(kernel.arg_names.index(name),) for name in ONES if name in kernel.arg_names]
        signature = {n: "constexpr" if (i,) in ones else t
                     for i, (n, t) in enumerate(source.signature.items())}  # fmt: skip
        attrs = {k: v for k, v in source.attrs.items() if k not in ones}
        constexprs = {**source.constants, **dict.fromkeys(ones, 1)}
        specialised = GluonASTSource(fn=kernel, signature=signature, attrs=attrs,
                                     constexprs=constexprs)  # fmt: skip
        try:
            triton.compile(specialised, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "maxnreg": chosen.config.maxnreg})  # fmt: skip
        except Exception as error:  # the compiler's error names the line
            return f"{type(error).__name__}: {error}"
    return ""


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_the_causal_kernels_compile_with_ints_of_one(which):
    spec = make_spec(dtype="bf16", head_dim=128, mask="causal", backward=True)
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            error = pool.apply(_compile_with_ones, ((spec.model_dump(mode="json"), which),))
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    assert error == "", error[:2000]
