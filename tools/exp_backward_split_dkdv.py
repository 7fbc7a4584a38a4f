"""Experiment: the D 256 backward's dK/dV as two kernels, one for dV and one for dK.

The generated dK/dV kernel keeps both accumulators, dK [BLOCK_N, D] and dV [BLOCK_N, DV] in
fp32, resident for its whole loop. At D 256 that is 64 KiB of registers per 32 keys, so the
tiles that fit are 32 keys wide (the H200 autotune's winner: 32x32, 4 warps, 3 stages), and
a 32-row M is below wgmma's 64: the kernel runs on mma.sync at about 220 TFLOP/s, 75% of the
backward's time at D 256 (autotune on the H200: dK/dV 4.99 ms against dQ 1.63 ms at B 4,
H 8, N 4096, non-causal; the dQ kernel, on wgmma, runs its three products at ~500 TFLOP/s).

Split, each kernel holds one accumulator: dV = sum P^T dO needs S = K Q^T (two products),
dK = sum dS^T Q needs S and dP^T = V dO^T (three). Five products instead of four (1.25x the
work), but with one [BLOCK_N, 256] fp32 accumulator a kernel can take 64-key tiles on 8
warps: wgmma's M. Whether that wins is the question this answers, on the GPU:

    PYTHONPATH=. python tools/exp_backward_split_dkdv.py --out DIR     # H200: times, JSON
    TRITON_INTERPRET=1 PYTHONPATH=. python tools/exp_backward_split_dkdv.py --check  # CPU
    PYTHONPATH=. python tools/exp_backward_split_dkdv.py --compile  # sm90 registers, no GPU

On the GPU it times the split kernels at several tiles beside the generated module's own
gradient kernels (torch.profiler, per kernel) at the backward grid's D 256 shape (B 4, H 8,
N 4096, bf16, non-causal and causal), and checks the split dK/dV against the module's.
On the CPU (--check) it compares the split kernels with float64 autograd at a small shape.
The kernels here are standalone (MHA, Nq = Nk, causal top-left or none, no padding, no
dropout, softcap or ALiBi): an experiment, not the template.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _probs_t(k, q, lse2, rows, key_pos, qk_scale, CAUSAL: tl.constexpr):
    """P^T [BLOCK_N, BLOCK_M] = exp(K Q^T * scale - LSE), causal top-left when CAUSAL."""
    qk_t = tl.dot(k, tl.trans(q))
    p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
    if CAUSAL:
        p_t = tl.where(rows[None, :] >= key_pos[:, None], p_t, 0.0)
    return p_t


@triton.jit
def _split_dv_kernel(
    Q, K, DO, DV, Lse,
    stride_bh, stride_n, seqlen, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):  # fmt: skip
    n_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = tl.arange(0, BLOCK_M)
    key_pos = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    base = bh * stride_bh
    k = tl.load(K + base + key_pos[:, None] * stride_n + offs_d[None, :])
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    start = n_block * BLOCK_N if CAUSAL else 0
    start = start // BLOCK_M * BLOCK_M
    for m0 in tl.range(start, seqlen, BLOCK_M):
        rows = m0 + offs_m
        q = tl.load(Q + base + rows[:, None] * stride_n + offs_d[None, :])
        do = tl.load(DO + base + rows[:, None] * stride_n + offs_d[None, :])
        lse2 = tl.load(Lse + bh * seqlen + rows) * 1.4426950408889634
        p_t = _probs_t(k, q, lse2, rows, key_pos, qk_scale, CAUSAL)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
    tl.store(DV + base + key_pos[:, None] * stride_n + offs_d[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _split_dk_kernel(
    Q, K, V, DO, DK, Lse, Delta,
    stride_bh, stride_n, seqlen, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):  # fmt: skip
    n_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = tl.arange(0, BLOCK_M)
    key_pos = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    base = bh * stride_bh
    k = tl.load(K + base + key_pos[:, None] * stride_n + offs_d[None, :])
    v = tl.load(V + base + key_pos[:, None] * stride_n + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    start = n_block * BLOCK_N if CAUSAL else 0
    start = start // BLOCK_M * BLOCK_M
    for m0 in tl.range(start, seqlen, BLOCK_M):
        rows = m0 + offs_m
        q = tl.load(Q + base + rows[:, None] * stride_n + offs_d[None, :])
        do = tl.load(DO + base + rows[:, None] * stride_n + offs_d[None, :])
        lse2 = tl.load(Lse + bh * seqlen + rows) * 1.4426950408889634
        delta = tl.load(Delta + bh * seqlen + rows)
        p_t = _probs_t(k, q, lse2, rows, key_pos, qk_scale, CAUSAL)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    dk = dk * sm_scale
    tl.store(DK + base + key_pos[:, None] * stride_n + offs_d[None, :], dk.to(DK.dtype.element_ty))


def split_dkdv(q, k, v, do, lse, delta, causal, config_dv, config_dk):
    """dK, dV of [B, H, N, D] contiguous tensors; lse, delta [B, H, N] fp32 (natural log);
    config_*: (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    batch, heads, seqlen, head_dim = q.shape
    sm_scale = 1.0 / math.sqrt(head_dim)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    common = {"HEAD_DIM": head_dim, "CAUSAL": causal}
    block_m, block_n, warps, stages = config_dv
    _split_dv_kernel[(seqlen // block_n, batch * heads)](
        q, k, do, dv, lse, seqlen * head_dim, head_dim, seqlen, sm_scale * LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )  # fmt: skip
    block_m, block_n, warps, stages = config_dk
    _split_dk_kernel[(seqlen // block_n, batch * heads)](
        q, k, v, do, dk, lse, delta, seqlen * head_dim, head_dim, seqlen, sm_scale * LOG2E,
        sm_scale, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        **common,
    )  # fmt: skip
    return dk, dv


def forward_stats(q, k, v, do, causal):
    """LSE [B, H, N] (natural log) and delta = rowsum(dO * O), both fp32, from torch."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1).to(q.device), -1e30)
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v.float()
    delta = (do.float() * out).sum(-1)
    return lse.contiguous(), delta.contiguous()


def check_on_cpu() -> None:
    """The split kernels against float64 autograd at B 1, H 2, N 128, D 256, fp16."""
    torch.manual_seed(0)
    for causal in (False, True):
        q, k, v, do = (torch.randn(1, 2, 128, 256, dtype=torch.float16) for _ in range(4))
        lse, delta = forward_stats(q, k, v, do, causal)
        dk, dv = split_dkdv(q, k, v, do, lse, delta, causal, (32, 32, 4, 1), (32, 32, 4, 1))
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        out.backward(do.double())
        for name, got, want in (("dK", dk, k64.grad), ("dV", dv, v64.grad)):
            error = (got.double() - want).abs().max().item()
            scale = want.abs().max().item()
            print(f"causal={causal} {name}: max error {error:.2e} (max |grad| {scale:.2e})")
            # fp16 inputs and products rounded to fp16 before each dot: a few fp16 ulps of
            # the largest gradient
            assert error <= 8 * 2.0**-10 * scale, (name, error, scale)


CONFIGS = (  # (BLOCK_M, BLOCK_N, warps, stages) for dV, then for dK
    ((64, 64, 8, 2), (64, 64, 8, 2)),
    ((64, 64, 4, 2), (64, 64, 8, 2)),
    ((32, 64, 4, 2), (32, 64, 4, 2)),
    ((64, 128, 8, 2), (32, 64, 8, 2)),
    ((32, 128, 8, 2), (32, 128, 8, 2)),
    ((64, 64, 8, 3), (32, 64, 8, 3)),
)


def kernel_ms(run, repeats: int = 10) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:40]
            totals[name] = totals.get(name, 0.0) + event.device_time / repeats / 1e3
    return totals


def on_gpu(out: Path, shape=(4, 8, 4096, 256), device="cuda", timer=None) -> None:
    """shape (B, H, N, D): the backward grid's D 256 cell; device and timer (kernel_ms) are
    parameters so that a CPU smoke run can take a small shape."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_backward import load_module  # the grid cell's module, with its tuned configs

    kernel_ms_of = timer or kernel_ms
    rows = []
    head_dim = shape[-1]
    for causal in (False, True):
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4))
        lse, delta = forward_stats(q, k, v, do, causal)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        module = load_module(head_dim, causal)

        def module_backward(qg=qg, kg=kg, vg=vg, do=do, module=module):
            module.attention(qg, kg, vg).backward(do)

        module_backward()
        reference = (kg.grad.float(), vg.grad.float())
        kernels = kernel_ms_of(module_backward)
        rows.append({"causal": causal, "impl": "module", "kernels_ms": kernels})
        print(f"causal={causal} module: " + ", ".join(f"{n} {t:.3f}" for n, t in kernels.items()))
        for config_dv, config_dk in CONFIGS:
            try:
                dk, dv = split_dkdv(q, k, v, do, lse, delta, causal, config_dv, config_dk)
                errors = [
                    (got.float() - want).abs().max().item() / want.abs().max().item()
                    for got, want in ((dk, reference[0]), (dv, reference[1]))
                ]
                times = kernel_ms_of(
                    functools.partial(
                        split_dkdv, q, k, v, do, lse, delta, causal, config_dv, config_dk
                    )
                )
                row = {"causal": causal, "dv": config_dv, "dk": config_dk, "kernels_ms": times,
                       "relative_error_vs_module": errors}  # fmt: skip
            except Exception as exc:  # a config that does not fit: reported, the others run
                row = {"causal": causal, "dv": config_dv, "dk": config_dk, "error": str(exc)[:300]}
            rows.append(row)
            print(row)
    result = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp_backward_split_dkdv.json").write_text(json.dumps(result, indent=1))


def compile_report() -> list[dict]:
    """Cross-compile both kernels at every config for sm90 (no GPU): registers, spills,
    shared memory and the matrix instructions (attngen.verify.compiler)."""
    from attngen.tiling.prefill import TileConfig
    from attngen.verify.compiler import _ast_source as ast_source
    from attngen.verify.compiler import compile_source

    def source(kernel, block_m, block_n, causal):
        types = {"Lse": "*fp32", "Delta": "*fp32", "qk_scale": "fp32", "sm_scale": "fp32"}
        types.update({name: "*bf16" for name in ("Q", "K", "V", "DO", "DK", "DV")})
        constexprs = {"HEAD_DIM": 256, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": causal}
        return lambda: ast_source(
            kernel, constexprs, types, lambda name: name.startswith(("stride", "seqlen"))
        )

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel has no ptxas log
    records = []
    done = set()
    for pair in CONFIGS:
        for kernel, config in zip((_split_dv_kernel, _split_dk_kernel), pair, strict=True):
            if (kernel, config) in done:
                continue
            done.add((kernel, config))
            block_m, block_n, warps, stages = config
            record = compile_source(
                source(kernel, block_m, block_n, False), "sm90",
                TileConfig(block_m, block_n, warps, stages),
            )  # fmt: skip
            record.update(kernel=kernel.fn.__name__, config=config)
            records.append(record)
            print(
                f"{kernel.fn.__name__:<18}{'x'.join(map(str, config)):<12} regs {record['regs']}"
                f" spills {record['spill_stores']} shared {record['shared']} {record['mma']}"
                f" {record.get('error') or ''}"
            )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--check", action="store_true", help="on the CPU, against float64")
    parser.add_argument("--compile", action="store_true", help="cross-compile for sm90")
    args = parser.parse_args()
    if args.check:
        check_on_cpu()
    elif args.compile:
        compile_report()
    else:
        on_gpu(args.out or Path("/tmp"))


if __name__ == "__main__":
    main()
