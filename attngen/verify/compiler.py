"""Cross-compile a generated kernel for any target without a GPU, and measure what it needs.

For a spec, a target, a kernel kind and a TileConfig, Triton compiles the rendered kernel
(TTIR -> PTX -> cubin with the ptxas it ships) and the record says what the program really
needs:

- ``shared``: dynamic shared memory Triton requests at launch (``metadata.shared``), bytes;
- ``static_shared``: shared memory ptxas reserves in the cubin itself (1024 B on sm90), bytes;
- ``regs`` and ``stack``: from ``cuobjdump --dump-resource-usage`` (ptxas's log as fallback);
- ``spill_stores`` / ``spill_loads``: bytes, from ptxas's ``-v`` log;
- ``mma``: the matrix instruction family in the PTX (``wgmma``, ``mma.sync``, ``tcgen05`` or
  ``fma`` when there is none), to check which code path the model assumes.

Each kernel is compiled as its entry point launches it on contiguous tensors (unit head-dim
strides constexpr 1, pointers and row strides 16-divisible). For prefill (and varlen, the
same key loop) that is ``attention()``'s kernel; for decode, the split kernel as ``decode()``
launches it with the config's row tile (BLOCK_M) and the path of several splits (DIRECT=False,
LSE stored): its combine and append kernels are tiny and are not modelled. The backward kernels
(spec `backward: true`; `kernel` "dq", "dkdv", or "dv" / "dk" for the dK/dV kernel's
one-gradient launches, BACKWARD_KERNELS) are measured from the prefill module as
``attention_backward()`` launches them (no LSE gradient; with `dropout: true`, the dropout
path, DROPOUT_ON=True): varlen's gradient kernels have the same loops.

Triton is imported lazily, only here: the build path never loads this module. Triton's on-disk
cache goes to a temporary folder, removed afterwards, so a run neither reads stale kernels nor
leaves files behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from attngen.arch import ARCHS
from attngen.render import render_module
from attngen.spec import AttnSpec, KernelKind, specs_from_data
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.prefill import TileConfig, derive_tiles, padded_head_dim
from attngen.tiling.rows import rows_aligned

# What one compile measures; a record of the data file holds these next to its key.
MEASURED_FIELDS = (
    "shared",
    "static_shared",
    "regs",
    "stack",
    "spill_stores",
    "spill_loads",
    "mma",
    "error",
    "compile_s",
)

_UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
# The JIT function whose compile is measured, per kind. verify-tiling measures varlen as
# prefill (the same key loop; varlen reads K/V through pointers, never TMA); varlen's own
# kernel compiles too, with its launch's signature (cu_seqlens, no seqused_k).
_MEASURED_KERNEL = {
    KernelKind.prefill: "_attn_fwd_kernel",
    KernelKind.varlen: "_attn_fwd_kernel",
    KernelKind.decode: "_decode_split_kernel",
}
# A config that renders the module when none is feasible: the kernel text does not depend on
# the config (it fills CONFIG and the header only).
_ANY_CONFIG = {
    KernelKind.prefill: TileConfig(64, 64, 4, 1),
    KernelKind.varlen: TileConfig(64, 64, 4, 1),
    KernelKind.decode: TileConfig(16, 64, 4, 2),
}
# The gradient kernels of a prefill module, by the name the backward tiling model gives them.
BACKWARD_KERNELS = {
    "dq": "_attn_bwd_dq_kernel",
    "dkdv": "_attn_bwd_dkdv_kernel",
    "dv": "_attn_bwd_dkdv_kernel",  # its dV-only launch (BWD_DKDV_SPLIT)
    "dk": "_attn_bwd_dkdv_kernel",  # its dK-only launch
    "dkdv_atomic": "_attn_bwd_dkdv_kernel",  # deterministic=False: adds dQ too (ATOMIC_DQ)
    "dk_atomic": "_attn_bwd_dkdv_kernel",  # the same in the dK-only launch
}
# the dK/dV kernel's GRADS per measured kernel, + 4 for ATOMIC_DQ
GRADS_OF = {"dkdv": 3, "dv": 1, "dk": 2, "dkdv_atomic": 7, "dk_atomic": 6}
_BACKWARD_UNIT_STRIDES = (*_UNIT_STRIDES, "stride_dod", "stride_dqd", "stride_dkd", "stride_dvd")
_kernels: dict[str, Any] = {}  # per process: module source hash -> module (memory only)


def load_kernel(
    spec: AttnSpec, arch: str, kind: KernelKind = KernelKind.prefill, kernel: str | None = None
) -> Any:
    """Render the `kind` module of `spec` for `arch`, import it from a temporary file, return
    the JIT kernel whose compile is measured (with `kernel`, that backward kernel of it).

    The module's text depends on the spec and the arch (its code paths and the chosen config
    in its header), not on the config compiled, so one import per spec and arch serves every
    config."""
    derive = derive_decode_tiles if kind is KernelKind.decode else derive_tiles
    derivation = derive(spec, arch)
    if derivation.chosen is None:
        derivation = dataclasses.replace(derivation, chosen=_ANY_CONFIG[kind])
    source = render_module(spec, kind, derivation)
    key = hashlib.sha256(source.encode()).hexdigest()
    if key not in _kernels:
        with tempfile.TemporaryDirectory() as tmp, _compiled_not_interpreted():
            path = Path(tmp) / f"compile_{kind.value}_{spec.spec_hash()}_{arch}.py"
            path.write_text(source)
            loader = importlib.util.spec_from_file_location(path.stem, path)
            assert loader is not None and loader.loader is not None  # a .py file has one
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)  # JIT functions keep their source in memory
        _kernels[key] = module
    name = _MEASURED_KERNEL[kind] if kernel is None else BACKWARD_KERNELS[kernel]
    return getattr(_kernels[key], name)


@contextlib.contextmanager
def _compiled_not_interpreted() -> Iterator[None]:
    """Under TRITON_INTERPRET=1 (the CPU test suite) @triton.jit makes interpreter functions,
    the module picks its interpreter code paths and code generation uses the interpreter's
    builder; none of it compiles. Imports and compiles are done without it."""
    from triton import knobs

    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


# Triton's pointer type of each dtype a spec's declared tensors may have (spec.py's list).
_TENSOR_POINTERS = {
    "int32": "*i32", "int64": "*i64", "float32": "*fp32", "bf16": "*bf16", "fp16": "*fp16",
    "bool": "*i1",
}  # fmt: skip


def _expression_arguments(spec: AttnSpec, kernel: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(constexprs, types) of the score_mod / mask_mod arguments: each declared tensor's
    pointer (its gradient's fp32, accumulated by atomics), the block lists as int32, and the
    launch without a block mask and with the tensors' gradients (a training launch)."""
    types = {f"{t.name}_ptr": _TENSOR_POINTERS[t.dtype] for t in spec.tensors}
    types.update({f"{t.name}_grad_ptr": "*fp32" for t in spec.tensors})
    lists = ("KvNum", "KvIdx", "FullNum", "FullIdx", "QNum", "QIdx", "FullQNum", "FullQIdx")
    types.update(dict.fromkeys(lists, "*i32"))
    constexprs = {"BLOCK_SPARSE": False, "TENSOR_GRADS": True}
    return {n: v for n, v in constexprs.items() if n in kernel.arg_names}, types


def kernel_source(
    spec: AttnSpec,
    kernel: Any,
    config: TileConfig,
    kind: KernelKind = KernelKind.prefill,
    backward: bool = False,
    v_from_k: bool = True,
    grads: int = 3,
) -> Any:
    """The ASTSource of one launch: signature, constexprs and divisibility as at runtime
    (`backward`: `kernel` is one of the module's gradient kernels, `grads` the dK/dV kernel's
    GRADS; `v_from_k`: an absorbed MLA decode's values are its latent keys, the path a latent
    cache takes, else a v_cache of its own)."""
    if backward:
        return _backward_source(spec, kernel, config, grads)
    if kind is KernelKind.decode:
        return _decode_source(spec, kernel, config, v_from_k)
    constexprs: dict[str, Any] = dict.fromkeys(_UNIT_STRIDES, 1)
    constexprs.update(STORE_LSE=True, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    if "USE_TMA" in kernel.arg_names:  # Hopper modules: contiguous inputs take the TMA path
        constexprs["USE_TMA"] = True
    if "DROPOUT_ON" in kernel.arg_names:  # `dropout: true`: the path a training launch takes
        constexprs["DROPOUT_ON"] = True
    if "USE_SEQUSED_K" in kernel.arg_names:  # varlen, without seqused_k (its usual launch)
        constexprs["USE_SEQUSED_K"] = False
    if spec.num_q_heads == spec.num_kv_heads:
        constexprs["q_per_kv"] = 1  # Triton specializes an int argument equal to 1
    types = dict.fromkeys(("Q", "K", "V", "Out"), spec.dtype.triton_pointer)
    types.update(Lse="*fp32", Slopes="*fp32", Sinks="*fp32")  # Sinks: with `sinks: true`
    # Dropout's seed and offset (int64 words), its keep scale; drop_threshold is an i32.
    types.update(RngState="*i64", keep_scale="fp32")
    types.update(dict.fromkeys(("CuSeqlensQ", "CuSeqlensK", "SequsedK"), "*i32"))  # varlen
    for name, width in (("k_desc", spec.head_dim), ("v_desc", spec.value_head_dim)):
        block = f"[1, 1, {config.block_n}, {padded_head_dim(width)}]"
        types[name] = f"tensordesc<{spec.dtype.value}{block}>"
    return _ast_source(spec, kernel, constexprs, types, _strides_divisible(spec))


def _strides_divisible(spec: AttnSpec) -> Callable[[str], bool]:
    """Which arguments a prefill module's kernels (forward and gradients) get 16-divisible:
    batch and head strides, and the row strides of rows_aligned dims."""
    aligned = rows_aligned(spec)

    def divisible(name: str) -> bool:
        stride = name.startswith("stride_")
        return stride and (name.endswith(("b", "h")) or (aligned and name.endswith(("m", "n"))))

    return divisible


def _decode_source(spec: AttnSpec, kernel: Any, config: TileConfig, v_from_k: bool) -> Any:
    constexprs: dict[str, Any] = dict.fromkeys(_UNIT_STRIDES, 1)
    constexprs.update(
        DIRECT=False, STORE_LSE=True, BLOCK_ROWS=config.block_m, BLOCK_N=config.block_n
    )
    if "V_FROM_K" in kernel.arg_names:  # an absorbed MLA decode: V the latent K tile, or not
        constexprs["V_FROM_K"] = v_from_k
    if "ROTARY_HALF" in kernel.arg_names:  # the launch without rotary (its code compiled out)
        constexprs.update(ROTARY_HALF=0, ROTARY_INTERLEAVED=False)
    if "TREE" in kernel.arg_names:  # the launch without tree_mask (its code compiled out)
        constexprs["TREE"] = False
    types = dict.fromkeys(("Q", "K", "V", "Out", "Cos", "Sin"), spec.dtype.triton_pointer)
    types["TreeMask"] = "*u8"
    types.update(KDescale="*fp32", VDescale="*fp32")  # `kv_dtype: fp8_e4m3`: fp8 caches
    types.update(dict.fromkeys(("K", "V"), "*fp8e4nv") if spec.kv_dtype is not None else {})
    types.update(dict.fromkeys(("SeqLens", "BlockTable"), "*i32"))
    types.update(dict.fromkeys(("Lse", "PartOut", "PartLse", "Slopes", "Sinks"), "*fp32"))

    def divisible(name: str) -> bool:  # every stride but the block table's
        return name.startswith("stride_") and not name.startswith("stride_bt")

    return _ast_source(spec, kernel, constexprs, types, divisible)


def _backward_source(spec: AttnSpec, kernel: Any, config: TileConfig, grads: int = 3) -> Any:
    """dQ or dK/dV as _backward launches them on contiguous [B, H, N, D] tensors: no dLSE,
    the dropout path when compiled in, ALiBi's GROUP_MAX from the spec's head ratio; grads + 4:
    ATOMIC_DQ (deterministic=False's dK/dV kernel, dQ an fp32 tensor). DELTA_ONLY is off."""
    q_per_kv = spec.num_q_heads // spec.num_kv_heads
    constexprs: dict[str, Any] = dict.fromkeys(_BACKWARD_UNIT_STRIDES, 1)
    constexprs.update(HAS_DLSE=False, DROPOUT_ON=True, DELTA_ONLY=False, STORE_LSE2=False)
    # GRADS (dK/dV): 3 both gradients in one launch, 1 dV, 2 dK
    constexprs.update(GRADS=grads & 3, ATOMIC_DQ=grads > 3, BLOCK_M=config.block_m)
    constexprs.update(BLOCK_N=config.block_n, GROUP_MAX=1 << (q_per_kv - 1).bit_length())
    if q_per_kv == 1:
        constexprs["q_per_kv"] = 1  # Triton specializes an int argument equal to 1
    constexprs = {name: value for name, value in constexprs.items() if name in kernel.arg_names}
    types = dict.fromkeys(
        ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV"), spec.dtype.triton_pointer
    )
    types.update(
        dict.fromkeys(("Lse", "DLse", "Delta", "Lse2", "Slopes", "Sinks", "DSinkPartial"), "*fp32")
    )  # Sinks, DSinkPartial: with `sinks: true`
    types.update(RngState="*i64", sm_scale="fp32", keep_scale="fp32")
    types.update({"DQ": "*fp32"} if grads > 3 else {})
    return _ast_source(spec, kernel, constexprs, types, _strides_divisible(spec))


def _ast_source(
    spec: AttnSpec,
    kernel: Any,
    constexprs: dict[str, Any],
    types: dict[str, str],
    divisible: Callable[[str], bool],
) -> Any:
    """The one signature builder: constexprs by name, `types` for the tensors (every other
    argument is the fp32 qk_scale or an i32; the expressions' from _expression_arguments),
    and tt.divisibility 16 on every pointer and on the arguments `divisible(name)` names."""
    from triton.compiler import ASTSource

    expression_constexprs, expression_types = _expression_arguments(spec, kernel)
    constexprs, types = {**constexprs, **expression_constexprs}, {**types, **expression_types}

    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, "fp32" if name == "qk_scale" else "i32")
        if signature[name].startswith("*") or divisible(name):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(
        fn=kernel,
        signature=signature,
        attrs=attrs,
        constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()},
    )


def _tool(name: str) -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)
    return path if os.path.exists(path) else None


def _parse_ptxas_log(log: str) -> dict[str, int | None]:
    def grab(pattern: str) -> int | None:
        found = re.findall(pattern, log)
        return int(found[-1]) if found else None

    return {
        "regs": grab(r"Used (\d+) registers"),
        "stack": grab(r"(\d+) bytes stack frame"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "static_shared": grab(r"(\d+) bytes smem"),
    }


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK and static SHARED of the kernel, per cuobjdump (empty when it is missing)."""
    tool = _tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", handle.name], check=True, capture_output=True, text=True
        ).stdout
    names = {"REG": "regs", "STACK": "stack", "SHARED": "static_shared"}
    return {names[k]: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED):(\d+)", text)}


def mma_family(ptx: str) -> str:
    """Which matrix instructions the compiler chose: the model's per-target branch."""
    for family, pattern in (
        ("tcgen05", r"\btcgen05\.mma"),
        ("wgmma", r"\bwgmma\.mma_async"),
        ("mma.sync", r"\bmma\.sync"),
    ):
        if re.search(pattern, ptx):
            return family
    return "fma"


# A decode job's fourth element: the absorbed MLA decode's path for a v_cache of its own
# (V_FROM_K off); without it, its latent cache's (V the latent key tile).
SEPARATE_V = "separate_v"


def compile_one(
    spec: AttnSpec,
    arch: str,
    config: TileConfig,
    kind: KernelKind = KernelKind.prefill,
    kernel: str | None = None,
) -> dict[str, Any]:
    """One cross-compile of the `kind` kernel (with `kernel`, that backward kernel of the
    prefill module, or for decode SEPARATE_V: the absorbed MLA decode with a v_cache of its
    own); a failure is recorded in ``error``."""
    if kind is KernelKind.decode:
        v_from_k, kernel = kernel != SEPARATE_V, None
    else:
        v_from_k = True
    grads = GRADS_OF.get(kernel or "", 3)

    def make_source() -> Any:
        jit = load_kernel(spec, arch, kind, kernel)
        return kernel_source(spec, jit, config, kind, kernel is not None, v_from_k, grads)

    return compile_source(make_source, arch, config, fp_fusion=fp_fusion(spec))


def fp_fusion(spec: AttnSpec) -> bool:
    """Whether the kernels launch with floating-point contraction (FMA fusion): fp32 modules
    do not (attngen/templates/_scores.py.jinja says why)."""
    return spec.dtype.value != "fp32"


def compile_source(
    make_source: Any, arch: str, config: TileConfig, fp_fusion: bool = True
) -> dict[str, Any]:
    """Compile the ASTSource `make_source()` builds for `arch` and measure it (the fields of
    MEASURED_FIELDS); any failure, building the source included, is recorded in ``error``,
    never raised. `fp_fusion` is the launch's enable_fp_fusion."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    record: dict[str, Any] = dict.fromkeys(MEASURED_FIELDS)
    start = time.perf_counter()
    log = io.StringIO()
    try:
        source = make_source()
        target = GPUTarget("cuda", ARCHS[arch].compute_capability, 32)
        options = {
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
            "enable_fp_fusion": fp_fusion,
        }
        with _compiled_not_interpreted(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v already runs; keep its log
            compiled = triton.compile(source, target=target, options=options)
        record.update(_parse_ptxas_log(log.getvalue()))
        record.update(_resource_usage(compiled.asm["cubin"]))
        record["shared"] = compiled.metadata.shared
        record["mma"] = mma_family(compiled.asm["ptx"])
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        first_line = (str(exc).strip().splitlines() or [""])[0]
        record["error"] = f"{type(exc).__name__}: {first_line[:300]}"
    record["compile_s"] = round(time.perf_counter() - start, 1)
    return record


# (spec, arch, config), or with a fourth element the backward kernel ("dq", "dkdv") to measure.
Job = tuple[AttnSpec, str, TileConfig] | tuple[AttnSpec, str, TileConfig, str]


def _run_job(payload: tuple[dict[str, Any], str, TileConfig, str, str | None]) -> dict[str, Any]:
    data, arch, config, kind, kernel = payload
    (spec,) = specs_from_data(data)
    # A cache per job: a hit (kernels alike, Llama 3's and 4's decode) has no ptxas log, no spills
    shared_cache = os.environ["TRITON_CACHE_DIR"]
    with tempfile.TemporaryDirectory(dir=shared_cache) as own_cache:
        os.environ["TRITON_CACHE_DIR"] = own_cache
        try:
            return compile_one(spec, arch, config, KernelKind(kind), kernel)
        finally:
            os.environ["TRITON_CACHE_DIR"] = shared_cache


def compile_iter(
    jobs: Sequence[Job], processes: int = 2, kind: KernelKind = KernelKind.prefill
) -> Iterator[dict[str, Any]]:
    """Compile every (spec, arch, config) of `kind`; yields one record per job, in order, as
    they come.

    Workers are spawned, not forked, with TRITON_INTERPRET removed from their environment:
    a process that imported triton in interpreter mode (the CPU test suite) cannot compile,
    because triton.language's own helpers are interpreter functions there. Each job carries
    its spec as data, so a worker renders and imports the kernel itself."""
    payload = [
        (spec.model_dump(mode="json"), arch, config, kind.value, next(iter(kernel), None))
        for spec, arch, config, *kernel in jobs
    ]
    if not payload:
        return
    saved = {name: os.environ.get(name) for name in ("TRITON_CACHE_DIR", "TRITON_INTERPRET")}
    with tempfile.TemporaryDirectory(prefix="attngen-compile-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # read at compile time, inherited by workers
        os.environ.pop("TRITON_INTERPRET", None)
        try:
            context = multiprocessing.get_context("spawn")
            with context.Pool(max(1, min(processes, len(payload)))) as pool:
                yield from pool.imap(_run_job, payload, chunksize=1)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def compile_many(
    jobs: Sequence[Job], processes: int = 2, kind: KernelKind = KernelKind.prefill
) -> list[dict[str, Any]]:
    """compile_iter, collected."""
    return list(compile_iter(jobs, processes, kind))
