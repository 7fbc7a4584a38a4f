"""GPU half of tools/gluon_forward.py: correctness against a float64 golden and the
FlashAttention-grid benchmark against SDPA cuDNN and attngen's flash_attn_func.

Correctness follows ../shared/RELIABILITY.md: pass when max|kernel - golden| <= 2 *
max|lowp - golden| + floor and the mean error obeys the same rule with 1.5, where lowp is
the same math in the kernel's dtype (fp32 scores and softmax, P rounded to the input dtype
before P @ V, output rounded) and floor is two ulps of the output dtype at the output's
magnitude; -inf LSE (rows with no key) and NaN exactly where the golden has them.
"""

from __future__ import annotations

import json
import math
import os
import time

import gluon_forward as gf

# (B, Nq, Nk, HQ, HKV, D, causal, top_left, dtype)
CASES = [
    (1, 1, 1, 2, 2, 64, False, False, "bf16"),
    (1, 1, 1, 2, 2, 128, True, False, "bf16"),
    (2, 127, 127, 4, 2, 128, True, False, "bf16"),
    (2, 129, 129, 3, 3, 64, True, False, "bf16"),
    (2, 129, 129, 3, 3, 64, False, False, "fp16"),
    (1, 1000, 1000, 14, 2, 128, True, False, "bf16"),
    (1, 1000, 1000, 14, 2, 128, False, False, "bf16"),
    (1, 1000, 1000, 14, 2, 64, False, False, "bf16"),
    (2, 300, 300, 2, 1, 256, True, False, "bf16"),
    (2, 300, 300, 2, 1, 256, False, False, "fp16"),
    (1, 100, 300, 2, 2, 128, True, False, "bf16"),
    (1, 100, 300, 2, 2, 128, True, True, "bf16"),
    (1, 300, 100, 2, 2, 64, True, False, "bf16"),
    (1, 300, 100, 2, 2, 64, True, True, "bf16"),
    (1, 257, 1000, 4, 4, 256, True, False, "bf16"),
    (1, 1000, 257, 4, 4, 256, True, True, "bf16"),
    (2, 2048, 2048, 4, 1, 128, True, False, "bf16"),
    (1, 4096, 4096, 2, 2, 64, False, False, "bf16"),
]


def _torch_dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def reference(q, k, v, causal, top_left, scale, dtype64, lowp_dtype=None):
    """[B, N, H, D] in; (out [B, Nq, HQ, D], lse [B, HQ, Nq]). With lowp_dtype, scores and
    softmax in fp32 and P rounded to lowp_dtype before P @ V."""
    import torch

    b, n_q, hq, d = q.shape
    n_k, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qh = q.transpose(1, 2).to(dtype64)
    kh = k.transpose(1, 2).repeat_interleave(g, dim=1).to(dtype64)
    vh = v.transpose(1, 2).repeat_interleave(g, dim=1).to(dtype64)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        diag = 0 if top_left else n_k - n_q
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + diag, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isinf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse)[..., None])
    if lowp_dtype is not None:
        p = p.to(lowp_dtype).to(dtype64)
    out = (p @ vh).masked_fill(empty[..., None], 0.0)
    return out.transpose(1, 2), lse


def check_case(case, seed=0, cfg=None):
    import torch

    b, n_q, n_k, hq, hkv, d, causal, top_left, dname = case
    dt = _torch_dtype(dname)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, n_q, hq, d, device="cuda", dtype=dt, generator=gen)
    k = torch.randn(b, n_k, hkv, d, device="cuda", dtype=dt, generator=gen)
    v = torch.randn(b, n_k, hkv, d, device="cuda", dtype=dt, generator=gen)
    scale = 1.0 / math.sqrt(d)
    out, lse = gf.gluon_attention(q, k, v, causal, scale, top_left, cfg=cfg)
    out2, lse2 = gf.gluon_attention(q, k, v, causal, scale, top_left, cfg=cfg)
    torch.cuda.synchronize()
    gold, gold_lse = reference(q, k, v, causal, top_left, scale, torch.float64)
    lowp, _ = reference(q, k, v, causal, top_left, scale, torch.float32, lowp_dtype=dt)
    lowp = lowp.to(dt).double()
    err = (out.double() - gold).abs()
    lerr = (lowp - gold).abs()
    ulp = 2.0**-7 if dt == torch.bfloat16 else 2.0**-10
    floor = 2 * ulp * max(gold.abs().max().item(), 1e-6)
    finite = torch.isfinite(gold_lse)
    lse_err = (lse.double() - gold_lse)[finite].abs().max().item() if finite.any() else 0.0
    res = dict(
        case=dict(
            B=b, Nq=n_q, Nk=n_k, HQ=hq, HKV=hkv, D=d, causal=causal, top_left=top_left, dtype=dname
        ),
        max_err=err.max().item(),
        lowp_max_err=lerr.max().item(),
        floor=floor,
        mean_err=err.mean().item(),
        lowp_mean_err=lerr.mean().item(),
        lse_max_err=lse_err,
        nan_out=bool(torch.isnan(out).any()),
        nan_lse=bool(torch.isnan(lse).any()),
        inf_lse_match=bool(torch.equal(torch.isinf(lse), ~finite)),
        deterministic=bool(torch.equal(out, out2) and torch.equal(lse, lse2)),
        empty_rows=int((~finite).sum().item()),
    )
    res["ok"] = bool(
        res["max_err"] <= 2 * res["lowp_max_err"] + floor
        and res["mean_err"] <= 1.5 * res["lowp_mean_err"] + floor
        and lse_err <= 1e-3
        and not res["nan_out"]
        and not res["nan_lse"]
        and res["inf_lse_match"]
        and res["deterministic"]
    )
    return res


def _attngen_fn():
    try:
        import attngen

        return attngen.flash_attn_func
    except Exception as exc:  # the baseline column is optional on a host without pydantic
        print(f"attngen baseline unavailable: {exc!r}", flush=True)
        return None


def bench_cell(d, n, causal, attngen_fn, variants=None):
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h = 16384 // n, 2048 // d
    dt = torch.bfloat16
    q = torch.randn(b, n, h, d, device="cuda", dtype=dt)
    k = torch.randn(b, n, h, d, device="cuda", dtype=dt)
    v = torch.randn(b, n, h, d, device="cuda", dtype=dt)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    row = dict(D=d, N=n, B=b, H=h, causal=causal)

    def tflops(ms):
        return round(flops / ms / 1e9, 1)

    launch, _, _ = gf.prepare(q, k, v, causal=causal)
    row["gluon"] = tflops(triton.testing.do_bench(launch))
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
        row["cudnn"] = tflops(triton.testing.do_bench(fn))
    if attngen_fn is not None:
        try:
            fn = lambda: attngen_fn(q, k, v, causal=causal)  # noqa: E731
            row["attngen"] = tflops(triton.testing.do_bench(fn))
        except Exception as exc:
            row["attngen_error"] = repr(exc)[:200]
    for name, kw in (variants or {}).items():
        launch, _, _ = gf.prepare(q, k, v, causal=causal, **kw)
        row[name] = tflops(triton.testing.do_bench(launch))
    row["gluon/cudnn"] = round(row["gluon"] / row["cudnn"], 3)
    return row


# Three consumer warpgroups of 64 rows (FlashAttention-3's choice for D 64), 160 registers.
NC3 = {
    64: dict(gf.CONFIGS[64], NUM_CONSUMERS=3, CONSUMER_REGS=160, STAGES=2),
    128: dict(gf.CONFIGS[128], NUM_CONSUMERS=3, CONSUMER_REGS=160, BLOCK_N=64, STAGES=2),
}
CASES_NC3 = [c for c in CASES if c[5] in NC3]


# Variants timed beside the default (what limits the kernel): ping-pong off, other tiles.
def _variants(d):
    out = {"no_pingpong": dict(pingpong=False)}
    if d == 64:
        out["nc3_s2"] = dict(cfg=NC3[64])
        out["nc3_s3"] = dict(cfg=dict(NC3[64], STAGES=3))
        out["nc3_s3_nopp"] = dict(cfg=dict(NC3[64], STAGES=3), pingpong=False)
    if d == 128:
        out["nc3_bn64"] = dict(cfg=NC3[128])
    return out


def _meta():
    import torch
    import triton

    return dict(
        date="2026-12-04",
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


def run_checks(out_dir, nc3=False):
    t0 = time.time()
    meta = _meta()
    print(json.dumps(meta), flush=True)
    checks = []
    for case in CASES_NC3 if nc3 else CASES:
        cfg = NC3[case[5]] if nc3 else None
        try:
            res = check_case(case, cfg=cfg)
            res["cfg"] = cfg
        except Exception as exc:
            res = dict(case=case, ok=False, error=repr(exc)[:400])
        checks.append(res)
        print(json.dumps(res), flush=True)
        _dump(out_dir, "gluon_forward_check.json", dict(meta=meta, correctness=checks))
    n_ok = sum(r["ok"] for r in checks)
    print(f"correctness: {n_ok}/{len(checks)} passed ({time.time() - t0:.0f}s)", flush=True)
    return checks


def run_bench(out_dir, budget_s=170.0, dims=(64, 128, 256), variants_at=(4096,)):
    t0 = time.time()
    meta = _meta()
    attngen_fn = _attngen_fn()
    rows = []
    for d in dims:
        for n in (1024, 4096, 16384):
            for causal in (False, True):
                if time.time() - t0 > budget_s:
                    print("benchmark stopped: time budget", flush=True)
                    break
                variants = _variants(d) if n in variants_at else None
                try:
                    row = bench_cell(d, n, causal, attngen_fn, variants)
                except Exception as exc:
                    row = dict(D=d, N=n, causal=causal, error=repr(exc)[:400])
                rows.append(row)
                print(json.dumps(row), flush=True)
                _dump(out_dir, "gluon_forward_bench.json", dict(meta=meta, bench=rows))
    print("\nTFLOP/s (bf16, B=16384/N, H=2048/D)")
    head = ("D", "N", "causal", "gluon", "cudnn", "attngen", "g/cudnn")
    print("".join(f"{h:>9}" for h in head))
    for r in rows:
        if "gluon" in r:
            vals = (r["D"], r["N"], r["causal"], r["gluon"], r["cudnn"], r.get("attngen", "-"))
            print("".join(f"{str(x):>9}" for x in vals + (r["gluon/cudnn"],)))
    return rows


def run(args):
    """The GPU modes of tools/gluon_forward.py (--gpu, --check, --bench, --nc3)."""
    if args.nc3:
        run_checks(args.out, nc3=True)
        run_bench(args.out, dims=(64, 128), variants_at=(1024, 4096, 16384))
    if args.gpu or args.check:
        run_checks(args.out)
    if args.gpu or args.bench:
        run_bench(args.out)
