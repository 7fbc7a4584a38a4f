"""GPU half of tools/gluon_backward.py: gradients against the float64 reference and a
benchmark against the tile-level backward (an attngen sm90 module's, through autograd, with
`ATTNGEN_ATOMIC_DQ` unset: the two-kernel path) and SDPA's cuDNN and flash backends.

Correctness is attngen.reference_backward.compare_gradients (RELIABILITY.md's rule against
the float64 golden with the kernel-precision yardstick), on [B, H, N, D] views of the
kernel's [B, N, H, D] results; the forward's out and lse come from the float64 reference
(rounded to the dtype), so only the backward is judged.
"""

from __future__ import annotations

import json
import os
import time

import gluon_backward as gb

# (B, Nq, Nk, HQ, HKV, D, mask, align, dtype)
CASES = [
    (1, 1, 1, 2, 2, 64, "none", None, "bf16"),
    (2, 127, 127, 4, 2, 128, "causal", "bottom_right", "bf16"),
    (2, 129, 129, 3, 3, 64, "causal", "bottom_right", "fp16"),
    (2, 129, 200, 3, 3, 64, "none", None, "fp16"),
    (1, 300, 300, 14, 2, 128, "causal", "bottom_right", "bf16"),
    (1, 300, 300, 14, 2, 128, "none", None, "fp16"),
    (1, 100, 300, 2, 2, 128, "causal", "bottom_right", "bf16"),
    (1, 100, 300, 2, 2, 128, "causal", "top_left", "bf16"),
    (1, 300, 100, 2, 2, 64, "causal", "bottom_right", "bf16"),
    (1, 300, 100, 2, 2, 64, "causal", "top_left", "fp16"),
    (2, 1024, 1024, 8, 1, 128, "causal", "bottom_right", "bf16"),
    (1, 2048, 2048, 4, 4, 64, "none", None, "bf16"),
]


def spec_for(case):
    from attngen.spec import specs_from_data

    _, _, _, hq, hkv, d, mask, align, dtype = case
    fields = dict(
        name="gluon_bwd",
        dtype=dtype,
        head_dim=d,
        num_q_heads=hq,
        num_kv_heads=hkv,
        mask=mask,
        backward=True,
        archs=["sm90"],
        kernels=["prefill"],
    )
    if align is not None:
        fields["causal_align"] = align
    return specs_from_data(fields)[0]


def inputs(case, seed=0, device="cuda"):
    """q, k, v, dout [B, N, H, D] in the case's dtype, and the forward's out, lse from the
    float64 reference (out rounded to the dtype, as a forward kernel returns it)."""
    import torch

    from attngen.reference_backward import golden_backward

    b, n_q, n_k, hq, hkv, d, mask, align, dname = case
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dname]
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(n, h):
        return torch.randn(b, n, h, d, device=device, dtype=dt, generator=gen)

    q, k, v, dout = rand(n_q, hq), rand(n_k, hkv), rand(n_k, hkv), rand(n_q, hq)
    heads = [t.transpose(1, 2) for t in (q, k, v, dout)]
    out64, lse64, *_ = golden_backward(spec_for(case), *heads)
    out = out64.to(dt).transpose(1, 2).contiguous()
    return q, k, v, dout, out, lse64.float()


def check_case(case, seed=0):
    """{'case', 'problems', 'ok', 'deterministic_dkdv'} for one case."""
    import torch

    from attngen.reference_backward import compare_gradients

    q, k, v, dout, out, lse = inputs(case, seed)
    causal, top_left = case[6] == "causal", case[7] == "top_left"
    dq, dk, dv = gb.gluon_backward(q, k, v, out, lse, dout, causal=causal, top_left=top_left)
    dq2, dk2, dv2 = gb.gluon_backward(q, k, v, out, lse, dout, causal=causal, top_left=top_left)
    torch.cuda.synchronize()
    heads = [t.transpose(1, 2).cpu() for t in (q, k, v, dout)]
    grads = [t.transpose(1, 2).cpu() for t in (dq, dk, dv)]
    problems = compare_gradients(spec_for(case), grads, *heads)
    return dict(
        case=list(case),
        problems=problems,
        ok=not problems,
        # dK/dV are summed in registers in a fixed order: bitwise repeatable; dQ (atomics) not
        deterministic_dkdv=bool(torch.equal(dk, dk2) and torch.equal(dv, dv2)),
        dq_max_diff_between_runs=float((dq.float() - dq2.float()).abs().max()),
    )


def _tile_level(d, causal):
    """The tile-level backward of an sm90 module (bf16, the case's D and mask) as a function
    of (q, k, v, dout) [B, N, H, D]: forward then backward through autograd; None when
    attngen cannot build it here."""
    try:
        import attngen

        fn = attngen.flash_attn_func
    except Exception as exc:  # the column is optional
        print(f"attngen tile-level baseline unavailable: {exc!r}", flush=True)
        return None
    return lambda q, k, v: fn(q, k, v, causal=causal)


def _time_backward(fwd, q, k, v, dout):
    """Milliseconds of the backward alone: a forward with grad, then backward timed."""
    import triton

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fwd(*leaves)

    def step():
        out.backward(dout, retain_graph=True)

    return triton.testing.do_bench(step, grad_to_none=leaves)


def bench_cell(d, n, causal):
    """One cell of the FlashAttention grid (bf16, B = 16384 / N, H = 2048 / D): TFLOP/s of
    the Gluon kernel alone, of the Gluon backward with its host steps (row statistics, dQ
    zeroing and cast), of the tile-level backward and of SDPA's cuDNN and flash backends."""
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h = 16384 // n, 2048 // d
    dt = torch.bfloat16
    q, k, v, dout = (torch.randn(b, n, h, d, device="cuda", dtype=dt) for _ in range(4))
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)  # five GEMMs of 2 N^2 D
    row = dict(D=d, N=n, B=b, H=h, causal=causal)

    def tflops(ms):
        return round(flops / ms / 1e9, 1)

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out_t, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, is_causal=causal)[
        :2
    ]
    out = out_t.transpose(1, 2).contiguous()
    launch, finish, _, _ = gb.prepare_backward(q, k, v, out, lse, dout, causal=causal)
    row["gluon_kernel"] = tflops(triton.testing.do_bench(launch))
    whole = lambda: gb.gluon_backward(q, k, v, out, lse, dout, causal=causal)  # noqa: E731
    row["gluon"] = tflops(triton.testing.do_bench(whole))
    if d == 64:
        launch3, _, _, _ = gb.prepare_backward(q, k, v, out, lse, dout, causal=causal, stages=3)
        row["gluon_kernel_s3"] = tflops(triton.testing.do_bench(launch3))
    tile = _tile_level(d, causal)
    if tile is not None:
        try:
            row["tile_level"] = tflops(_time_backward(tile, q, k, v, dout))
        except Exception as exc:
            row["tile_level_error"] = repr(exc)[:200]
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
    ):
        try:
            with sdpa_kernel([backend]):
                sdpa = lambda a, b_, c: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                    a.transpose(1, 2), b_.transpose(1, 2), c.transpose(1, 2), is_causal=causal
                ).transpose(1, 2)
                row[name] = tflops(_time_backward(sdpa, q, k, v, dout))
        except Exception as exc:
            row[f"{name}_error"] = repr(exc)[:200]
    if "cudnn" in row:
        row["gluon/cudnn"] = round(row["gluon"] / row["cudnn"], 3)
    if "tile_level" in row:
        row["gluon/tile"] = round(row["gluon"] / row["tile_level"], 3)
    return row


def _meta():
    import torch
    import triton

    return dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        cudnn=torch.backends.cudnn.version(),
    )


def _dump(out_dir, name, obj):
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=1)


def run_checks(out_dir):
    meta, checks, t0 = _meta(), [], time.time()
    for case in CASES:
        try:
            res = check_case(case)
        except Exception as exc:
            res = dict(case=list(case), ok=False, problems=[repr(exc)[:400]])
        checks.append(res)
        print(json.dumps(res), flush=True)
        _dump(out_dir, "gluon_backward_check.json", dict(meta=meta, correctness=checks))
    n_ok = sum(r["ok"] for r in checks)
    print(f"correctness: {n_ok}/{len(checks)} passed ({time.time() - t0:.0f}s)", flush=True)
    return n_ok == len(checks)


def run_bench(out_dir, budget_s=300.0):
    meta, rows, t0 = _meta(), [], time.time()
    for d in (64, 128):
        for n in (1024, 4096, 16384):
            for causal in (False, True):
                if time.time() - t0 > budget_s:
                    print("benchmark stopped: time budget", flush=True)
                    break
                try:
                    row = bench_cell(d, n, causal)
                except Exception as exc:
                    row = dict(D=d, N=n, causal=causal, error=repr(exc)[:400])
                rows.append(row)
                print(json.dumps(row), flush=True)
                _dump(out_dir, "gluon_backward_bench.json", dict(meta=meta, bench=rows))
    cols = ("gluon_kernel", "gluon", "tile_level", "cudnn", "sdpa_flash", "gluon/cudnn")
    print("\nbackward TFLOP/s (bf16, B=16384/N, H=2048/D; gluon includes its host steps)")
    print("".join(f"{c:>13}" for c in ("D", "N", "causal") + cols))
    for r in rows:
        vals = [r.get(c, "-") for c in ("D", "N", "causal") + cols]
        print("".join(f"{str(x):>13}" for x in vals))
    return rows


def run(args):
    """The GPU modes of tools/gluon_backward.py (--gpu, --check, --bench); 0 when the checks
    pass."""
    ok = True
    if args.gpu or args.check:
        ok = run_checks(args.out)
    if args.gpu or args.bench:
        run_bench(args.out)
    return 0 if ok else 1
