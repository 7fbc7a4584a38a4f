"""The Gluon kernels against the compiler: every sm90 prefill module with a warp-specialized
forward (attngen/tiling/gluon.py) is rendered, its `_gluon_attn_fwd_kernel` cross-compiled for
sm90 as attention() launches it (contiguous [B, N, H, D] descriptors, the LSE stored), and the
cubin's numbers compared with the model's; so is the `_gluon_attn_bwd_kernel` of a module with
the Gluon dK/dV backward (attngen/tiling/gluon_backward.py), as _gluon_bwd_run launches it:

- shared memory: the compiler's request equals smem_expression at the chosen config (exact);
- spills: none (no local-memory stack, no spill stores);
- setmaxnreg: the partitions are set to the derived consumer and producer registers.

`attngen verify-tiling --gluon` runs it; triton is imported lazily, as in compiler.py.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import re
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from attngen.spec import AttnSpec, KernelKind, specs_from_data
from attngen.tiling.gluon import GLUON_ARCH, GluonCandidate, derive_gluon_tiles
from attngen.tiling.gluon_backward import HEAVY_FIRST, BwdCandidate, derive_gluon_backward
from attngen.verify.compiler import (
    _compiled_not_interpreted,
    _expression_arguments,
    _parse_ptxas_log,
    _resource_usage,
    load_kernel,
)

_KERNEL = "_gluon_attn_fwd_kernel"
_INTS = ("n_q", "n_keys", "n_heads", "group", "diag", "num_m_blocks", "stride_slopes_b",
         "total_q", "total_k", "stride_om", "stride_oh", "stride_lse_h")  # fmt: skip
_VARLEN_POINTERS = ("CuSeqlensQ", "CuSeqlensK", "SequsedK")
_BWD_KERNEL = "_gluon_attn_bwd_kernel"
_BWD_INTS = ("n_q", "n_keys", "n_heads", "group", "n_pad", "diag", "num_n_blocks", "stride_kn",
             "stride_kh", "stride_slopes_b")  # fmt: skip
_BWD_DIVISIBLE = ("n_pad", "stride_kn", "stride_kh")  # multiples of 16 at every launch


@dataclass
class GluonRow:
    spec: str
    chosen: GluonCandidate | BwdCandidate
    record: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    kind: KernelKind = KernelKind.prefill

    def line(self) -> str:
        config = self.chosen.config
        verdict = "ok" if not self.problems else "FAIL: " + "; ".join(self.problems)
        kernel = "dK/dV" if isinstance(self.chosen, BwdCandidate) else "forward"
        kernel = f"{self.kind.value} {kernel}" if self.kind is KernelKind.varlen else kernel
        return (
            f"  {self.spec} {kernel}: {config.describe()}: shared {self.record.get('shared')} B "
            f"(model {self.chosen.smem_bytes} B), spills {self.record.get('spill_stores')} B, "
            f"setmaxnreg {self.record.get('setmaxnreg')}: {verdict}"
        )


def gluon_kernel(spec: AttnSpec, name: str = _KERNEL, kind: KernelKind = KernelKind.prefill) -> Any:
    """The kernel `name` of the spec's sm90 `kind` module (rendered, imported)."""
    tile_kernel = load_kernel(spec, GLUON_ARCH, kind)
    return tile_kernel.fn.__globals__[name]


def _descriptor_type(dtype: Any, name: str, block: list[int]) -> str:
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return f"tensordesc<{name}{block},{layout!r}>".replace(" ", "")


def gluon_bwd_source(spec: AttnSpec, kernel: Any, chosen: BwdCandidate, causal: bool,
                     with_dq: bool = True, heads_last: bool = True) -> Any:  # fmt: skip
    """The GluonASTSource of _gluon_bwd_run's launch (its ints that are multiples of 16
    specialised as a launch specialises them); with_dq=False: deterministic=True's;
    heads_last: dQ's sum in flash_attn_func's [B, N, H, D] order, else [B, H, N, D]."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    config, d, name = chosen.config, spec.head_dim, spec.dtype.value
    dtype = getattr(gl, spec.dtype.torch_name)
    signature = {"dq_ptr": "*fp32", "dk_ptr": f"*{name}", "dv_ptr": f"*{name}", "Slopes": "*fp32"}
    signature.update(dict.fromkeys(_BWD_INTS, "i32"), qk_scale="fp32", sm_scale="fp32")
    for desc, rows in (("q", config.block_m), ("do", config.block_m), ("k", config.block_n),
                       ("v", config.block_n)):  # fmt: skip
        signature[f"{desc}_desc"] = _descriptor_type(dtype, name, [1, rows, 1, d])
    dq_block = [min(config.block_m, 64), 32]  # the box of dQ's fp32 sum (TMA reduce-adds)
    signature["dq_desc"] = _descriptor_type(gl.float32, "fp32", dq_block)
    rows = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    for desc in ("lse_desc", "delta_desc"):
        signature[desc] = f"tensordesc<fp32[{config.block_m}],{rows!r}>".replace(" ", "")
    constexprs = {"CAUSAL": causal, "STAGES": config.stages, "DQ_SPLIT": config.dq_split,
                  "WITH_DQ": with_dq, "DQ_HEADS_LAST": heads_last,
                  "CONSUMER_REGS": config.consumer_regs,
                  "PRODUCER_REGS": config.producer_regs, "HEAVY_FIRST": HEAVY_FIRST}  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    if "QNum" in kernel.arg_names:  # score_mod / mask_mod's tensors and the lists; ints i32
        signature.update(_expression_arguments(spec, kernel)[1])
    names = kernel.arg_names
    signature = {n: signature.get(n, "i32") for n in names}
    return GluonASTSource(
        fn=kernel,
        signature=signature,
        attrs={
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(names)
            if signature[n].startswith("*") or n in _BWD_DIVISIBLE
        },
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
    )


def gluon_source(spec: AttnSpec, kernel: Any, chosen: GluonCandidate, causal: bool) -> Any:
    """The GluonASTSource of attention()'s (varlen: attention_varlen()'s, no seqused_k)
    launch on contiguous tensors, LSE stored (an expression module's other ints 32-bit)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    config = chosen.config
    dtype = getattr(gl, spec.dtype.torch_name)
    signature = {"Lse": "*fp32", "Slopes": "*fp32", "Sinks": "*fp32", "qk_scale": "fp32"}
    signature.update(dict.fromkeys(_VARLEN_POINTERS, "*i32"), Out=f"*{spec.dtype.value}")
    signature.update(dict.fromkeys(_INTS, "i32"))  # the variants' params, where the kernel has them
    for name, rows, width in (
        ("q_desc", config.block_m, spec.head_dim),
        ("k_desc", config.block_n, spec.head_dim),
        ("v_desc", config.block_n, spec.value_head_dim),
        ("o_desc", config.block_m, spec.value_head_dim),
    ):
        block = [1, rows, 1, width]
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        signature[name] = f"tensordesc<{spec.dtype.value}{block},{layout!r}>".replace(" ", "")
    constexprs = {
        "STORE_LSE": True,
        "CAUSAL": causal,
        "STAGES": config.stages,
        "NUM_CONSUMERS": config.consumers,
        "CONSUMER_REGS": config.consumer_regs,
        "PRODUCER_REGS": config.producer_regs,
    }
    if "USE_SEQUSED_K" in kernel.arg_names:
        constexprs["USE_SEQUSED_K"] = False
    if "KvNum" in kernel.arg_names:  # score_mod / mask_mod's tensors and the block lists
        signature.update(_expression_arguments(spec, kernel)[1])
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    ordered = {name: signature.get(name, "i32") for name in kernel.arg_names}
    return GluonASTSource(
        fn=kernel,
        signature=ordered,
        constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()},
    )


def compile_gluon(
    spec: AttnSpec, chosen: GluonCandidate | BwdCandidate, kind: KernelKind = KernelKind.prefill
) -> dict[str, Any]:
    """Cross-compile the spec's Gluon kernel for sm90 with `chosen`; the cubin's numbers, or
    the failure in ``error``."""
    record: dict[str, Any] = {"error": None}
    start = time.perf_counter()
    log = io.StringIO()
    saved = os.environ.get("TRITON_CACHE_DIR")
    # A cache of its own: a hit (two specs with the same kernel) has no ptxas log, no spills.
    with tempfile.TemporaryDirectory(prefix="attngen-gluon-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            _compile_into(record, spec, chosen, log, kind)
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved
    record["compile_s"] = round(time.perf_counter() - start, 1)
    return record


def _compile_into(record: dict[str, Any], spec: AttnSpec, chosen: GluonCandidate | BwdCandidate,
                  log: io.StringIO, kind: KernelKind = KernelKind.prefill) -> None:  # fmt: skip
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    try:
        causal = spec.mask.value == "causal"
        with _compiled_not_interpreted():
            if isinstance(chosen, BwdCandidate):
                source = gluon_bwd_source(spec, gluon_kernel(spec, _BWD_KERNEL), chosen, causal)
            else:
                source = gluon_source(spec, gluon_kernel(spec, _KERNEL, kind), chosen, causal)
        options = {"num_warps": 4, "maxnreg": chosen.config.maxnreg}
        with _compiled_not_interpreted(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        record.update(_parse_ptxas_log(log.getvalue()))
        record.update(_resource_usage(compiled.asm["cubin"]))
        record["shared"] = compiled.metadata.shared
        ptx = compiled.asm["ptx"]
        record["setmaxnreg"] = sorted(
            {int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
        )
        record["wgmma"] = bool(re.search(r"\bwgmma\.mma_async", ptx))
        record["atomics"] = sorted(set(re.findall(r"\b(?:red|atom)\.global[\w.]*", ptx)))
        record["tma_reduces"] = sorted(set(re.findall(r"\bcp\.reduce\.async\.bulk[\w.:]*", ptx)))
    except Exception as exc:  # noqa: BLE001 - recorded, the check goes on
        first_line = (str(exc).strip().splitlines() or [""])[0]
        record["error"] = f"{type(exc).__name__}: {first_line[:300]}"


def judge_gluon(row: GluonRow) -> None:
    """The model against the record: exact shared memory, no spills, the derived registers."""
    record, config = row.record, row.chosen.config
    if record.get("error"):
        row.problems.append(record["error"])
        return
    if record["shared"] != row.chosen.smem_bytes:
        row.problems.append(f"shared {record['shared']} B != model {row.chosen.smem_bytes} B")
    if record.get("spill_stores") or record.get("stack"):
        row.problems.append(f"spills {record.get('spill_stores')} B, stack {record.get('stack')} B")
    wanted = {config.consumer_regs, config.producer_regs}
    if not wanted <= set(record["setmaxnreg"]):
        row.problems.append(f"setmaxnreg {record['setmaxnreg']} lacks {sorted(wanted)}")
    if not record["wgmma"]:
        row.problems.append("no wgmma in the PTX")


def _compile_job(payload: tuple[dict[str, Any], GluonCandidate | BwdCandidate, KernelKind],
                 ) -> dict[str, Any]:  # fmt: skip
    data, chosen, kind = payload
    (spec,) = specs_from_data(data)
    return compile_gluon(spec, chosen, kind)


def verify_gluon(specs: Iterable[AttnSpec], processes: int = 2) -> list[GluonRow]:
    """One row per spec whose sm90 prefill module has the Gluon forward, one per spec whose
    module has the Gluon backward and one per varlen module with the forward, compiled and
    judged.
    As compiler.compile_iter, the compiles run in spawned workers without TRITON_INTERPRET
    (a process that imported triton under the interpreter cannot compile)."""
    rows, jobs = [], []
    for spec in specs:
        if GLUON_ARCH not in spec.archs:
            continue
        prefill, varlen = (kind in spec.kernels for kind in (KernelKind.prefill, KernelKind.varlen))
        for kind, derivation in (
            (KernelKind.prefill, derive_gluon_tiles(spec, GLUON_ARCH) if prefill else None),
            (KernelKind.prefill, derive_gluon_backward(spec, GLUON_ARCH) if prefill else None),
            (
                KernelKind.varlen,
                derive_gluon_tiles(spec, GLUON_ARCH, KernelKind.varlen) if varlen else None,
            ),
        ):
            if derivation is not None and derivation.chosen is not None:
                rows.append(GluonRow(spec.name, derivation.chosen, kind=kind))
                jobs.append((spec.model_dump(mode="json"), derivation.chosen, kind))
    if not jobs:
        return rows
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        context = multiprocessing.get_context("spawn")
        with context.Pool(max(1, min(processes, len(jobs)))) as pool:
            records = pool.map(_compile_job, jobs, chunksize=1)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    for row, record in zip(rows, records, strict=True):
        row.record = record
        judge_gluon(row)
    return rows
