"""Run the D 256 Gluon dK/dV prototype (gluon_bwd_d256.py) on an sm90 GPU: gradients against the
float64 reference, then its time against the module's tile-level D 256 backward.

    PYTHONPATH=. python tools/d256_proto/run_d256.py --out DIR [--skip-check] [--skip-bench]
        [--reps MS] [--bench-n 4096 16384]
    PYTHONPATH=. python tools/d256_proto/run_d256.py --dry-run [--no-compile]   (CPU is enough)

Host side as the D 64/128 kernel's (_gluon_bwd_buffers, _gluon_bwd_run): q, k, v, dO in
flash-attn layout [B, N, H, D] bf16; LSE in log2 units (LSE log2 e, +inf for a row that sees no
key and for the padding rows past N: P = 0 there) and delta = rowsum(dO * O) (0 past N), both
[B, HQ, N_pad] fp32 (N_pad: whole 64-row query blocks), read by 1-d TMA boxes of 64 rows at
(b * HQ + h) * N_pad + m; dQ's fp32 sum [B, N_pad, HQ, D] (zeroed here: no DELTA_ONLY pass),
which the kernel adds dS K sm_scale into, by per-thread atomics (DQ_ATOMIC) or by TMA
reduce-adds of [64, 32] boxes of its [B * N_pad, HQ * D] view; dK, dV [B, N, HKV, D] bf16.
The checks take out and LSE from attngen's low-precision reference forward; the module's timing
includes its own delta pass and dQ cast, so the prototype is timed alone and with torch's
host-side prep too.

--dry-run builds every case's host tensors and descriptors on CPU, prints each launch's argument
list, cross-compiles the kernel for sm90 from those arguments through the JIT's own binder (the
signature, specialisation and constexprs a launch would compile; --no-compile skips it), runs a
torch emulation of the kernel's math on the same buffers through the same comparison (checks
LSE units, padding and the dQ layout as the kernel reads them, not the kernel) and builds the
attngen D 256 module the benchmark times. No GPU is touched.
Writes DIR/run_d256.json (--out; the dry run writes only where --out is given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from attngen.reference import lowp_reference  # noqa: E402
from attngen.reference.backward import (  # noqa: E402
    golden_backward,
    gradient_problems,
    lowp_backward,
)
from tests.kernel_harness import make_spec  # noqa: E402
from tools.ab_templates import _build as build  # noqa: E402
from tools.d256_proto.gluon_bwd_d256 import gluon_bwd_d256_kernel as kernel  # noqa: E402

LOG2E = math.log2(math.e)
D = 256
BLOCK_M, BLOCK_N = 64, 64  # the kernel reads them from the descriptors' boxes
DQ_BOX = [BLOCK_M, 32]  # one 128-byte swizzle atom of fp32: the TMA reduce's box
CONSTEXPRS = {"STAGES": 2, "CONSUMER_REGS": 232, "PRODUCER_REGS": 24}  # + DQ_ATOMIC, CAUSAL
OPTIONS = {"num_warps": 4, "maxnreg": 168}  # as compile_d256.py
ROWS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
# (B, N, HQ, HKV, causal): N 1000 leaves a partial query and key block; B 2 checks the
# batch terms of the dQ rows and the statistics' rows
CHECK_CASES = [
    (1, 1024, 2, 2, False),
    (1, 1024, 2, 2, True),
    (1, 1000, 2, 2, False),
    (1, 1000, 2, 2, True),
    (1, 1024, 4, 2, False),
    (1, 1024, 4, 2, True),
    (2, 1000, 4, 2, True),
]
BENCH_B, BENCH_H = 1, 8


def make_inputs(b, n, hq, hkv, device, seed=7):
    """q, k, v, dout: [B, N, H, D] bf16 (flash-attn layout), contiguous."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(
        torch.randn(b, n, h, D, device=device, dtype=torch.bfloat16, generator=gen)
        for h in (hq, hkv, hkv, hq)
    )


def row_statistics(dout, out, lse, n_pad):
    """LSE log2 e (+inf where no key is seen and past N: P = 0 there) and delta = rowsum(dO O)
    (0 past N), both [B, HQ, N_pad] fp32, as _gluon_bwd_buffers pads them."""
    b, nq, hq, _ = dout.shape
    lse2 = lse.new_full((b, hq, n_pad), math.inf)  # past N: P = exp2(s - inf) = 0
    lse2[:, :, :nq] = torch.where(lse == -math.inf, math.inf, lse * LOG2E)
    delta = lse.new_zeros((b, hq, n_pad))
    delta[:, :, :nq] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return lse2, delta


def descriptors(q, k, v, dout, lse2, delta, dq_sum) -> dict:
    """The kernel's TMA descriptors: q, dO, k, v by one head's rows of [B, N, H, D] memory, the
    row statistics by 64-row boxes, dQ's sum as [B * N_pad, HQ * D] in [64, 32] boxes."""
    d = q.shape[3]

    def bnhd(t, rows):  # [B, N, H, D] memory, boxes of one head's `rows` rows
        block = [1, rows, 1, d]
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    def rows(t):
        return TensorDescriptor(t.view(-1), [t.numel()], [1], [BLOCK_M], ROWS_LAYOUT)

    dq2 = dq_sum.view(-1, dq_sum.shape[2] * d)
    dq_layout = gl.NVMMASharedLayout.get_default_for(DQ_BOX, gl.float32)
    return {"q_desc": bnhd(q, BLOCK_M), "do_desc": bnhd(dout, BLOCK_M), "lse_desc": rows(lse2),
            "delta_desc": rows(delta), "k_desc": bnhd(k, BLOCK_N), "v_desc": bnhd(v, BLOCK_N),
            "dq_desc": TensorDescriptor(dq2, list(dq2.shape), list(dq2.stride()), DQ_BOX,
                                        dq_layout)}  # fmt: skip


def host_args(q, k, v, dout, out, lse, causal, dq_atomic, sm_scale):
    """The prototype's launch: grid, positional args, constexprs, options, and the buffers it
    writes (dq_sum, dk, dv). Mirrors _gluon_bwd_buffers / _gluon_bwd_run, with q, k, v, dout,
    out in [B, N, H, D] memory and lse [B, HQ, N] natural log."""
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    n_pad = triton.cdiv(nq, BLOCK_M) * BLOCK_M
    lse2, delta = row_statistics(dout, out, lse, n_pad)
    dq_sum = q.new_zeros((b, n_pad, hq, d), dtype=torch.float32)  # heads last, as the kernel
    dk, dv = (k.new_empty((b, nk, hkv, d)) for _ in range(2))
    num_n_blocks = triton.cdiv(nk, BLOCK_N)
    ints = {"n_q": nq, "n_keys": nk, "n_heads": hq, "group": hq // hkv, "n_pad": n_pad,
            "diag": nk - nq,  # bottom-right, as flash_attn_func
            "num_n_blocks": num_n_blocks, "stride_kn": dk.stride(1),
            "stride_kh": dk.stride(2)}  # fmt: skip
    named = {"dq_ptr": dq_sum, "dk_ptr": dk, "dv_ptr": dv, **ints, "qk_scale": sm_scale * LOG2E,
             "sm_scale": sm_scale, **descriptors(q, k, v, dout, lse2, delta, dq_sum)}  # fmt: skip
    constexprs = {**CONSTEXPRS, "DQ_ATOMIC": dq_atomic, "CAUSAL": causal}
    names = kernel.arg_names
    assert set(named) | set(constexprs) == set(names), "the kernel's parameters changed"
    args = [named[n] for n in names if n in named]
    return {"grid": (num_n_blocks * b * hkv,), "args": args, "named": named,
            "constexprs": constexprs, "options": dict(OPTIONS), "dq_sum": dq_sum, "dk": dk,
            "dv": dv, "lse2": lse2, "delta": delta, "n_pad": n_pad}  # fmt: skip


def launch(run):
    kernel[run["grid"]](*run["args"], **run["constexprs"], **run["options"])


def gradients(run, nq):
    """(dq, dk, dv) as the module returns them: [B, N, H, D] bf16 (dQ's padding rows dropped)."""
    dq = run["dq_sum"][:, :nq].to(torch.bfloat16)
    return dq, run["dk"], run["dv"]


def describe(run) -> list[str]:
    """The launch's argument list, one line each."""
    lines = [f"grid {run['grid']}"]
    for name, value in run["named"].items():
        if isinstance(value, torch.Tensor):
            text = f"{tuple(value.shape)} {value.dtype} strides {tuple(value.stride())}"
        elif isinstance(value, TensorDescriptor):
            text = (
                f"desc {value.base.dtype} shape {list(value.shape)} strides "
                f"{list(value.strides)} block {list(value.block_shape)} swizzle "
                f"{value.layout.swizzle_byte_width}"
            )
        else:
            text = repr(value)
        lines.append(f"  {name}: {text}")
    lines.append(f"  constexprs {run['constexprs']} options {run['options']}")
    return lines


def cross_compile(run) -> dict:
    """Compiles the kernel for sm90 from the launch's own arguments, through the JIT's binder
    and argument packing (what kernel[grid](...) compiles on an sm90 GPU); no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**run["constexprs"], **run["options"]}
    bound, specialization, options = binder(*run["args"], **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        saved = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            compiled = triton.compile(
                GluonASTSource(kernel, signature, constexprs, attrs),
                target=target,
                options=options.__dict__,
            )
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR")
            else:
                os.environ["TRITON_CACHE_DIR"] = saved
    descs = {k: v for k, v in signature.items() if "tensordesc" in v}
    return {
        "shared": compiled.metadata.shared,
        "n_regs_entry": options.maxnreg,
        "compile_s": round(time.perf_counter() - start, 1),
        "ints": {k: v for k, v in signature.items() if v in ("i32", "i64", "constexpr")},
        "descs": len(descs),
    }


def emulate(run, q, k, v, dout, sm_scale):
    """The kernel's math in torch on the launch's own buffers (Q/dO rows past N as TMA's zero
    fill, LSE log2 e and delta as padded): S^T scale log2 e - LSE2, P = min(exp2, 1) in bf16,
    dS = P_bf16 (dP - delta) in bf16, dV += P^T dO, dK += dS^T Q (times sm_scale at the store),
    dQ's sum += dS K sm_scale at [b, m, h, :]. Checks the host buffers, not the kernel."""
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group, n_pad = hq // hkv, run["n_pad"]
    named = run["named"]

    def pad(t):
        return torch.nn.functional.pad(t.float(), (0, 0, 0, 0, 0, n_pad - nq))

    qp, dop = pad(q), pad(dout)
    dk = torch.zeros(b, nk, hkv, d)
    dv = torch.zeros(b, nk, hkv, d)
    keys = torch.arange(nk)[:, None]
    rows = torch.arange(n_pad)[None, :]
    for bi in range(b):
        for h in range(hq):
            kh, vh = k[bi, :, h // group].float(), v[bi, :, h // group].float()
            qh, doh = qp[bi, :, h], dop[bi, :, h]
            x = (kh @ qh.T) * named["qk_scale"] - run["lse2"][bi, h][None, :]
            if run["constexprs"]["CAUSAL"]:
                x = x.masked_fill(keys > rows + named["diag"], -math.inf)
            p = torch.clamp(torch.exp2(x), max=1.0).to(torch.bfloat16).float()
            dpt = vh @ doh.T
            ds = (p * (dpt - run["delta"][bi, h][None, :])).to(torch.bfloat16).float()
            dv[bi, :, h // group] += p @ doh
            dk[bi, :, h // group] += ds @ qh
            run["dq_sum"][bi, :, h] += (ds.T @ kh) * sm_scale
    run["dk"].copy_(dk * sm_scale)
    run["dv"].copy_(dv)


def check_case(case, device, dry, compile_check) -> list[dict]:
    """One shape, both dQ paths: the launch (or, dry, the emulation) against the float64
    reference by RELIABILITY.md's rule (compare_gradients' per-gradient rule; no row here sees
    no key, so its blind-row check has nothing to check)."""
    b, n, hq, hkv, causal = case
    sm_scale = 1.0 / math.sqrt(D)
    q, k, v, dout = make_inputs(b, n, hq, hkv, device)
    spec = make_spec(name="d256_proto", dtype="bf16", head_dim=D, num_q_heads=hq,
                     num_kv_heads=hkv, mask="causal" if causal else "none",
                     backward=True)  # fmt: skip
    heads_first = [t.transpose(1, 2) for t in (q, k, v, dout)]
    out, lse = lowp_reference(spec, *heads_first[:3], sm_scale=sm_scale)  # the kernels' forward
    out = out.transpose(1, 2)
    golden = golden_backward(spec, *heads_first, sm_scale=sm_scale)[2:5]
    lowp = lowp_backward(spec, *heads_first, sm_scale=sm_scale)[1:4]
    records = []
    for dq_atomic in (True, False):
        run = host_args(q, k, v, dout, out, lse, causal, dq_atomic, sm_scale)
        rec = {"B": b, "N": n, "HQ": hq, "HKV": hkv, "causal": causal, "dq_atomic": dq_atomic}
        name = f"B{b} N{n} H{hq}/{hkv} {'causal' if causal else 'none'} atomic={int(dq_atomic)}"
        if dry:
            print(f"-- {name}")
            print("\n".join(describe(run)))
            if compile_check:
                rec["sm90_compile"] = cross_compile(run)
                print(f"  sm90 compile from these args: {rec['sm90_compile']}")
            emulate(run, q, k, v, dout, sm_scale)
        else:
            launch(run)
            torch.cuda.synchronize()
        grads = [t.transpose(1, 2) for t in gradients(run, n)]
        problems = []
        for gname, got, gold, low in zip(("dq", "dk", "dv"), grads, golden, lowp, strict=True):
            err = (got.double() - gold).abs()
            rec[f"{gname}_max_err"] = err.max().item()
            rec[f"{gname}_lowp_max_err"] = (low.double() - gold).abs().max().item()
            problems += gradient_problems(gname, got, gold, low)
        rec["problems"] = problems
        rec["pass"] = not problems
        errs = " ".join(
            f"{g} {rec[g + '_max_err']:.2e} (lowp {rec[g + '_lowp_max_err']:.2e})"
            for g in ("dq", "dk", "dv")
        )
        tag = "emulated " if dry else ""
        print(f"{tag}{'PASS' if not problems else 'FAIL'} {name}: {errs}", flush=True)
        for problem in problems:
            print(f"    {problem}")
        records.append(rec)
    return records


def build_module(causal: bool, folder: Path):
    """The attngen sm90 prefill module of a D 256 bf16 spec with backward (tile-level there),
    built and imported as tools/ab_templates.py does."""
    spec = make_spec(name=f"d256_bench_c{int(causal)}", dtype="bf16", head_dim=D,
                     num_q_heads=BENCH_H, num_kv_heads=BENCH_H,
                     mask="causal" if causal else "none", backward=True)  # fmt: skip
    return build(spec, folder, None)


def bench_case(n, causal, reps, dry) -> dict:
    """The prototype (both dQ paths) against the module's attention_backward, one shape."""
    b, h = BENCH_B, BENCH_H
    sm_scale = 1.0 / math.sqrt(D)
    flops = 2.5 * 4 * b * h * n * n * D * (0.5 if causal else 1.0)
    rec: dict = {"B": b, "H": h, "N": n, "causal": causal}
    with tempfile.TemporaryDirectory() as tmp:
        module = build_module(causal, Path(tmp) / "m")
        device = "cpu" if dry else "cuda"
        q, k, v, dout = make_inputs(b, n, h, h, device, seed=0)
        views = [t.transpose(1, 2) for t in (q, k, v, dout)]  # [B, H, N, D] of [B, N, H, D]
        if dry:  # no forward on CPU: stand-in out and LSE (the buffers' shapes only)
            out_v, lse = views[0], torch.zeros(b, h, n)
        else:
            out_v, lse = module.attention(*views[:3], return_lse=True)
        out = out_v.transpose(1, 2)
        times = {}
        for dq_atomic in (True, False):
            run = host_args(q, k, v, dout, out, lse, causal, dq_atomic, sm_scale)
            key = f"proto_atomic{int(dq_atomic)}"
            if dry:
                print(f"-- bench B{b} H{h} N{n} causal={int(causal)} {key}")
                print("\n".join(describe(run)))
                continue

            def full(q=q, k=k, v=v, dout=dout, out=out, lse=lse, a=dq_atomic):
                r = host_args(q, k, v, dout, out, lse, causal, a, sm_scale)
                launch(r)
                return gradients(r, n)

            times[key] = triton.testing.do_bench(lambda r=run: launch(r), rep=reps)
            times[key + "_with_prep"] = triton.testing.do_bench(full, rep=reps)
        if not dry:
            times["module"] = triton.testing.do_bench(
                lambda: module.attention_backward(
                    views[3], *views[:3], out_v, lse, deterministic=False
                ),
                rep=reps,
            )
            rec["module_backward_path"] = getattr(module, "backward_path", lambda: "tile")()
    rec["times"] = {
        k: {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)} for k, ms in times.items()
    }
    if times:
        rec["speedup_vs_module"] = {
            k: round(times["module"] / ms, 3) for k, ms in times.items() if k != "module"
        }
        print(json.dumps(rec), flush=True)
    return rec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="writes OUT/run_d256.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU: host side only")
    parser.add_argument("--no-compile", action="store_true", help="dry run: no sm90 compile")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--reps", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--bench-n", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args(argv)
    if not args.dry_run and args.out is None:
        parser.error("--out is required (unless --dry-run)")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (sm90); --dry-run runs the host side on CPU")
    device = "cpu" if args.dry_run else "cuda"
    result: dict = {"dry_run": args.dry_run, "check": [], "bench": []}
    if not args.dry_run:
        result["device"] = torch.cuda.get_device_name()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)

    def save():
        if args.out is not None:
            (args.out / "run_d256.json").write_text(json.dumps(result, indent=1))

    if not args.skip_check:
        for i, case in enumerate(CHECK_CASES):
            # the dry run compiles 3 shapes (none, causal, causal GQA: group not 1), 6 compiles
            compile_check = args.dry_run and not args.no_compile and i in (0, 1, 5)
            try:
                result["check"] += check_case(case, device, args.dry_run, compile_check)
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                result["check"].append({"case": case, "error": f"{type(exc).__name__}: {exc}"})
                print(f"ERROR {case}: {type(exc).__name__}: {exc}", flush=True)
            save()
    if not args.skip_bench:
        for n in args.bench_n:
            for causal in (False, True):
                try:
                    result["bench"].append(bench_case(n, causal, args.reps, args.dry_run))
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    error = f"{type(exc).__name__}: {exc}"[:500]
                    result["bench"].append({"N": n, "causal": causal, "error": error})
                    print(f"ERROR bench N{n} causal={int(causal)}: {error}", flush=True)
                save()
                if not args.dry_run:
                    torch.cuda.empty_cache()
    bad = [r for r in result["check"] if not r.get("pass")]
    print(f"{len(result['check']) - len(bad)}/{len(result['check'])} checks pass")
    save()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
