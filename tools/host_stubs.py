"""The repository's generated modules with their launches stubbed out, for measuring host
time on the CPU (tools/host_overhead_cpu.py): the cached launcher on, as on a GPU, and
`kernel[grid]` answered by a compiled kernel whose launcher does nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from attngen.runtime.registry import load_kernels
from attngen.tiling.code_paths import POINTER_LOADS_UP_TO

ROOT = Path(__file__).resolve().parent.parent


class _StubCompiled:
    function = packed_metadata = None

    def run(self, *args):
        pass


class _StubKernel:
    """A generated module's @triton.jit kernel with the launch stubbed out: `kernel[grid]`
    returns a compiled kernel whose launcher does nothing (the module's cached launcher
    calls that launcher directly from the second call of a specialization)."""

    def __init__(self, real):
        import inspect

        import triton.language as tl

        self.fn, self.pre_run_hooks = real.fn, []
        self.params = [
            SimpleNamespace(name=n, is_constexpr=p.annotation is tl.constexpr)
            for n, p in inspect.signature(real.fn).parameters.items()
        ]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _StubCompiled()


def stub_module(module) -> object:
    """`module` with its cached launcher on (as on a GPU) and its launches stubbed out."""
    if hasattr(module, "_FAST_LAUNCH"):
        module._FAST_LAUNCH = True
        module._DRIVER[:] = [lambda: -1, lambda device: 0]
    if hasattr(module, "POINTER_LOADS_UP_TO"):  # 0 under the interpreter: as on a GPU
        module.POINTER_LOADS_UP_TO = POINTER_LOADS_UP_TO
    for name in (
        "_attn_fwd_kernel",
        "_append_kernel",
        "_decode_split_kernel",
        "_decode_combine_kernel",
        "_attn_bwd_dq_kernel",
        "_attn_bwd_dkdv_kernel",
    ):
        if hasattr(module, name):
            setattr(module, name, _StubKernel(getattr(module, name)))
    return module


def stubbed_registry(folder: Path):
    """The modules of `folder` as the registry in use, each stubbed (stub_module); bf16 is let
    through on the interpreter (no kernel computes anything here)."""
    from attngen.runtime import dispatch

    dispatch._bf16_ok = True
    registry = load_kernels(folder, replace=True)
    for entry in registry.entries:
        stub_module(registry.module(entry.key))
    return registry


def stubbed_generated_modules() -> dict[str, object]:
    """The repository's generated modules (sm90) as the registry, each module the calls below
    reach stubbed (stub_module)."""
    from attngen.runtime import dispatch

    dispatch._bf16_ok = True
    registry = load_kernels(ROOT / "generated", replace=True)
    found = {}
    for kind, name_part in (
        ("prefill", "bert_base"),
        ("prefill", "gpt2"),
        ("prefill", "llama3_8b"),
        ("varlen", "llama3_8b"),
        ("decode", "qwen2_5_7b"),
        ("decode", "llama3_8b"),
    ):
        key = next(
            e.key
            for e in registry.entries
            if e.arch == "sm90" and e.kind == kind and name_part in e.module
        )
        found[f"{kind} {name_part}"] = stub_module(registry.module(key))
    return found
