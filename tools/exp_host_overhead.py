"""Where a public call's host time goes, at a tiny shape (B 1, H 12, N 64, D 64, fp16).

Host time per call = wall time of N back-to-back calls / N: at this shape the GPU work is a
few microseconds, so the host is the bottleneck and the loop measures it. Rows:

- anchors: torch SDPA (default dispatch) and a bare launch of a trivial Triton kernel;
- the layers of an attngen call, from the outside in: flash_attn_func, the SDPA-shaped
  function, the torch.library op (which eager calls skip) and the direct call that replaces
  it, dispatch alone (a cached choice), the generated module's attention(), Triton's
  `kernel[grid](...)` with the module's arguments (pointers, and TMA descriptors built per
  call), and the compiled kernel's launcher called directly (the floor a cached launcher can
  reach);
- decode: flash_attn_with_kvcache and the decode module's decode() at B 1, L 64;
- a cProfile of flash_attn_func (top functions by own time).

Usage on the GPU machine:  PYTHONPATH=. python3 tools/exp_host_overhead.py --out DIR
Writes DIR/host_overhead.json and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import attngen
from attngen.runtime import ops
from attngen.runtime.registry import current_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import profile_text  # noqa: E402


@triton.jit
def _noop(X):
    pass


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


class Recorder:
    """Stands in for a module's @triton.jit kernel and records one launch's grid and args."""

    def __init__(self, real):
        self.real, self.grid, self.args, self.kwargs = real, None, None, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs
            return self.real[grid](*args, **kwargs)

        return launch


def module_for(kind: str, name_part: str):
    entry = next(
        e
        for e in current_registry().entries
        if e.kind == kind and e.arch == "sm90" and name_part in e.module
    )
    return current_registry().module(entry.key), entry


def direct_launcher(real, grid, args, kwargs):
    """The compiled kernel and a zero-argument function that launches it without binding."""
    compiled = real[grid](*args, **kwargs)
    bound = real.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in real.arg_names})
    bound.apply_defaults()
    values = list(bound.arguments.values())
    grid = tuple(grid) + (1,) * (3 - len(grid))
    device = torch.cuda.current_device()

    def launch():
        stream = torch.cuda.current_stream(device).cuda_stream
        compiled.run(
            grid[0],
            grid[1],
            grid[2],
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *values,
        )

    return compiled, launch


def measure(rows: dict, name: str, fn) -> None:
    try:
        rows[name] = round(host_us(fn), 2)
    except Exception as exc:  # report and go on: one broken row must not hide the others
        rows[name] = f"error: {type(exc).__name__}: {exc}"
        traceback.print_exc()


def measure_public(rows: dict, q, k, v) -> None:
    """The anchors and the layers of a prefill call, outside in."""
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash layout
    x = torch.empty(16, device=q.device)
    measure(rows, "torch sdpa (default dispatch)", lambda: F.scaled_dot_product_attention(q, k, v))
    measure(rows, "bare triton launch (1 arg)", lambda: _noop[(1,)](x))
    measure(rows, "attngen.flash_attn_func", lambda: attngen.flash_attn_func(qf, kf, vf))
    measure(
        rows,
        "attngen.scaled_dot_product_attention",
        lambda: attngen.scaled_dot_product_attention(q, k, v),
    )
    module, entry = module_for("prefill", "bert_base")
    measure(
        rows,
        "torch.ops.attngen.prefill (op only)",
        lambda: ops.prefill_op(entry.key, q, k, v, 0.125, None, False, False),
    )
    measure(
        rows,
        "ops.prefill (eager: the module directly)",
        lambda: ops.prefill(entry.key, q, k, v, 0.125, None, False),
    )
    measure(rows, "module attention()", lambda: module.attention(q, k, v))
    from attngen.runtime.dispatch import choose, need_for
    from attngen.spec import KernelKind, Mask

    def need():
        return need_for(
            KernelKind.prefill,
            q,
            v,
            mask=Mask.none,
            align=None,
            window=None,
            softcap=0.0,
            alibi=False,
            seqlen_q=64,
            seqlen_k=64,
            same_lengths=True,
        )

    measure(rows, "need_for only", need)
    asked = need()
    measure(rows, "dispatch (choose, cached) only", lambda: choose("flash_attn_func", asked))


def measure_launch(rows: dict, q, k, v) -> None:
    """Triton's binding launcher against the compiled kernel's own, with the module's args."""
    module, _ = module_for("prefill", "bert_base")
    real = module._attn_fwd_kernel
    recorder = Recorder(real)
    module._attn_fwd_kernel = recorder
    fast = getattr(module, "_FAST_LAUNCH", False)
    module._FAST_LAUNCH = False  # the cached launcher would call the recorder only once
    # The TMA launch, with its descriptors: a launch this small reads K/V by pointers, so the
    # rows below compare the two paths as before POINTER_LOADS_UP_TO.
    threshold = getattr(module, "POINTER_LOADS_UP_TO", None)
    if threshold is not None:
        module.POINTER_LOADS_UP_TO = 0
    try:
        module.attention(q, k, v)
    finally:
        module._attn_fwd_kernel = real
        module._FAST_LAUNCH = fast
        if threshold is not None:
            module.POINTER_LOADS_UP_TO = threshold
    grid, kargs, kkw = recorder.grid, recorder.args, recorder.kwargs
    tma = bool(kkw.get("USE_TMA"))
    rows["module uses TMA at this shape"] = tma
    measure(rows, "kernel[grid](...) as the module calls it", lambda: real[grid](*kargs, **kkw))
    ptr_args, ptr_kw = list(kargs), dict(kkw)
    if tma:
        for i, arg in enumerate(kargs):
            if type(arg).__name__ == "TensorDescriptor":
                ptr_args[i] = None
        ptr_kw["USE_TMA"] = False
        measure(
            rows,
            "kernel[grid](...) with pointers (no TMA)",
            lambda: real[grid](*ptr_args, **ptr_kw),
        )
        from triton.tools.tensor_descriptor import TensorDescriptor

        measure(
            rows,
            "TensorDescriptor x2 construction only",
            lambda: [
                TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 64, 64]) for t in (k, v)
            ],
        )
    variants = [("pointers", ptr_args, ptr_kw)] + (
        [("TMA descriptors prebuilt", kargs, kkw)] if tma else []
    )
    for label, a, kw in variants:
        name = f"compiled.run direct ({label})"
        try:
            _, launch = direct_launcher(real, grid, a, kw)
            measure(rows, name, launch)
        except Exception as exc:
            rows[name] = f"error: {exc}"
            traceback.print_exc()


def measure_decode(rows: dict) -> None:
    """flash_attn_with_kvcache and decode() at B 1 against 64 cached keys (bf16, D 128)."""
    try:
        dmod, dentry = module_for("decode", "qwen2_5_7b")
        qd = torch.randn(1, 1, 28, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(1, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((1,), 64, dtype=torch.int32, device="cuda")
        measure(
            rows,
            "attngen.flash_attn_with_kvcache (B1, L64)",
            lambda: attngen.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=True),
        )
        measure(
            rows,
            "decode module decode() (B1, L64)",
            lambda: dmod.decode(qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), lens),
        )
        rows["decode module"] = dentry.describe()
    except Exception as exc:
        rows["decode"] = f"error: {exc}"
        traceback.print_exc()


def profile_flash_attn(q, k, v) -> str:
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return profile_text(lambda: attngen.flash_attn_func(qf, kf, vf), lines=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, object] = {}
    q = torch.randn(1, 12, 64, 64, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    measure_public(rows, q, k, v)
    measure_launch(rows, q, k, v)
    measure_decode(rows)
    profile = profile_flash_attn(q, k, v)
    (args.out / "host_overhead_profile.txt").write_text(profile)
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": "B1 H12 N64 D64 fp16",
        "host_us": rows,
    }
    (args.out / "host_overhead.json").write_text(json.dumps(result, indent=1))
    print(profile[:6000])
    print(
        f"\nhost time per call ({result['gpu']}, torch {torch.__version__}, "
        f"triton {triton.__version__})"
    )
    for name, value in rows.items():
        print(f"  {name:55s} {value}")


if __name__ == "__main__":
    main()
