"""Cross-compilation of tools/gluon_forward.py's kernel for sm90 on a machine without a GPU
(triton.compile on a GluonASTSource with GPUTarget("cuda", 90, 32)), with the resources the
cubin reports: registers at entry, stack and local memory (spills), the setmaxnreg values of
the partitions, HGMMA count, shared memory and threads per CTA."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time

import gluon_forward as gf
import triton
from triton.experimental.gluon import language as gl


def compile_sm90(d, causal, dtype="bf16", cfg=None, pingpong=True):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = dict(gf.CONFIGS[d] if cfg is None else cfg)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    qb, kb = gf._blocks(cfg, d)
    ql = gl.NVMMASharedLayout.get_default_for(qb, gdt)
    kl = gl.NVMMASharedLayout.get_default_for(kb, gdt)

    def desc(block, layout):
        return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"

    sig = {
        "q_desc": desc(qb, ql),
        "k_desc": desc(kb, kl),
        "v_desc": desc(kb, kl),
        "o_desc": desc(qb, ql),
        "lse_ptr": "*fp32",
        "n_q": "i32",
        "n_keys": "i32",
        "n_heads": "i32",
        "group": "i32",
        "qk_scale": "fp32",
        "diag": "i32",
    }
    consts = dict(
        CAUSAL=bool(causal),
        STAGES=cfg["STAGES"],
        NUM_CONSUMERS=cfg["NUM_CONSUMERS"],
        PINGPONG=bool(pingpong) and cfg["NUM_CONSUMERS"] > 1,
        CONSUMER_REGS=cfg["CONSUMER_REGS"],
        PRODUCER_REGS=cfg["PRODUCER_REGS"],
    )
    for name in consts:
        sig[name] = "constexpr"
    fn = gf.attn_fwd_kernel
    src = GluonASTSource(
        fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()}
    )
    t0 = time.time()
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": gf.maxnreg(cfg)}
    )
    secs = time.time() - t0
    return compiled, secs


def resource_usage(compiled):
    """Registers, spills and stack per kernel from cuobjdump on the cubin."""
    binpath = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        name = f.name
    try:
        res = subprocess.run(
            [binpath, "--dump-resource-usage", name], capture_output=True, text=True
        )
        text = res.stdout + res.stderr
        sass = subprocess.run([binpath, "--dump-sass", name], capture_output=True, text=True).stdout
    finally:
        os.unlink(name)
    info = {}
    for key, pat in (
        ("registers", r"REG:(\d+)"),
        ("stack", r"STACK:(\d+)"),
        ("local", r"LOCAL:(\d+)"),
    ):
        m = re.search(pat, text)
        info[key] = int(m.group(1)) if m else None
    ptx = compiled.asm["ptx"]
    info["setmaxnreg"] = sorted(
        set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))
    )
    info["hgmma"] = sass.count("HGMMA")
    info["ldl_stl"] = sass.count("LDL") + sass.count("STL")
    info["shared"] = compiled.metadata.shared
    info["threads"] = int(re.search(r"\.reqntid (\d+)", ptx).group(1))
    return info


def run_compile():
    rows = []
    for d in (64, 128, 256):
        for causal in (False, True):
            compiled, secs = compile_sm90(d, causal)
            info = resource_usage(compiled)
            info.update(d=d, causal=causal, secs=round(secs, 1))
            rows.append(info)
            print(json.dumps(info), flush=True)
    return rows
