"""Cross-compile the D 256 prototype for sm90; print registers, spills, shared memory."""

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def signature(dq_atomic, stages, block_m, block_n, d, regs, causal) -> tuple[dict, dict]:
    """The kernel's parameter types (pointers, ints, TMA descriptors) and constexprs."""
    from triton.experimental.gluon import language as gl

    def desc(dtype, name, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        return f"tensordesc<{name}{block},{layout!r}>".replace(" ", "")

    sig = {"dq_ptr": "*fp32", "dk_ptr": "*bf16", "dv_ptr": "*bf16", "qk_scale": "fp32",
           "sm_scale": "fp32"}  # fmt: skip
    ints = ("n_q", "n_keys", "n_heads", "group", "n_pad", "diag", "num_n_blocks", "stride_kn",
            "stride_kh")  # fmt: skip
    sig.update(dict.fromkeys(ints, "i32"))
    for n, rows in (("q", block_m), ("do", block_m), ("k", block_n), ("v", block_n)):
        sig[f"{n}_desc"] = desc(gl.bfloat16, "bf16", [1, rows, 1, d])
    sig["dq_desc"] = desc(gl.float32, "fp32", [block_m, 32])
    rows = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    for n in ("lse_desc", "delta_desc"):
        sig[n] = f"tensordesc<fp32[{block_m}],{rows!r}>".replace(" ", "")
    constexprs = {"STAGES": stages, "DQ_ATOMIC": dq_atomic, "CAUSAL": causal,
                  "CONSUMER_REGS": regs[0], "PRODUCER_REGS": regs[1]}  # fmt: skip
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    return sig, constexprs


def compile_sm90(sig, constexprs, maxnreg):
    """(compiled kernel, ptxas log) of the prototype for sm90 under `sig`."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tools.d256_proto.gluon_bwd_d256 import gluon_bwd_d256_kernel as kernel

    names = kernel.arg_names
    divisible = ("n_pad", "stride_kn", "stride_kh")
    source = GluonASTSource(
        fn=kernel,
        signature={n: sig[n] for n in names},
        attrs={
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(names)
            if sig[n].startswith("*") or n in divisible
        },  # fmt: skip
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
    )
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": 4, "maxnreg": maxnreg})  # fmt: skip
    return compiled, log.getvalue()


def main(dq_atomic: bool, stages: int, block_m: int = 64, block_n: int = 64, d: int = 256,
         regs=(240, 24, 168), causal: bool = False):  # fmt: skip
    from attngen.verify.compiler import _parse_ptxas_log, _resource_usage

    start = time.perf_counter()
    sig, constexprs = signature(dq_atomic, stages, block_m, block_n, d, regs, causal)
    compiled, log = compile_sm90(sig, constexprs, regs[2])
    rec = {"causal": causal, "consumer_regs": regs[0], "dq_atomic": dq_atomic, "stages": stages,
           "block_m": block_m, "block_n": block_n}  # fmt: skip
    rec.update(_parse_ptxas_log(log))
    rec.update(_resource_usage(compiled.asm["cubin"]))
    rec["shared"] = compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    regs_set = re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)
    rec["setmaxnreg"] = sorted({int(x) for x in regs_set})
    rec["wgmma"] = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)))
    rec["atomics"] = sorted(set(re.findall(r"\b(?:red|atom)\.global[\w.]*", ptx)))
    rec["n_atomics"] = len(re.findall(r"\b(?:red|atom)\.global[\w.]*", ptx))
    rec["tma_reduces"] = sorted(set(re.findall(r"\bcp\.reduce\.async\.bulk[\w.:]*", ptx)))
    rec["compile_s"] = round(time.perf_counter() - start, 1)
    os.makedirs("/tmp/d256/out", exist_ok=True)
    tag = f"a{int(dq_atomic)}_s{stages}_m{block_m}_c{int(causal)}_r{regs[0]}"
    open(f"/tmp/d256/out/{tag}.ptx", "w").write(ptx)
    open(f"/tmp/d256/out/{tag}.log", "w").write(log)
    print(json.dumps(rec))


if __name__ == "__main__":
    for atomic in (True, False):
        for causal in (False, True):
            for consumer in (240, 232, 224, 216):
                main(atomic, 2, 64, regs=(consumer, 24, 168), causal=causal)
