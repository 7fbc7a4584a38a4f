"""attngen.flex_attention against compiled FlexAttention on attention-gym's mods, forward and
backward, and against attngen's built-in kernel for the same attention where one exists.

Each mod runs three ways in one process on the same bf16 inputs ([B, H, N, D], B = 16384 / N,
H = 2048 / D, as the FlashAttention grid): `attngen.flex_attention` (its module built on
demand at the first call), `torch.compile(flex_attention)` with the same torch BlockMask
(BLOCK_SIZE 128), and where attngen has the mask built in, `attngen.flash_attn_func` on
heads-last copies of the same tensors (causal, sliding window, ALiBi, softcap); for the mods
flex_attention recognises as built-in ones, also `attngen_expr`: the same call with that
recognition patched off (the expression kernels and the block mask). The forward is
timed alone; the backward as `torch.autograd.grad` of a kept graph (the forward not counted).
The issue's targets: attngen.flex_attention >= 1.3x compiled Flex, and >= 0.9x the built-in.

    PYTHONPATH=. python tools/bench_flex.py --out OUT [--d 128] [--n 4096] [--mods NAME ...]

Prints one line per mod and writes OUT/bench_flex.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attngen
from attngen.runtime.flex import attention as flex_module
from attngen.runtime.flex.builtin import builtin_mask, mapped
from attngen.runtime.flex.cache import traced

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_graph import kernel_times  # noqa: E402

WINDOW, PREFIX, DOCUMENTS, SOFTCAP = 1024, 1024, 4, 30.0


def gym(heads: int, seqlen: int) -> dict:
    """name -> (score_mod, mask_mod, built-in flash_attn_func keywords or None)."""
    slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
    doc = torch.repeat_interleave(torch.arange(DOCUMENTS, device="cuda"), seqlen // DOCUMENTS)
    bias = torch.randn(heads, 2 * seqlen - 1, device="cuda") * 0.5

    def causal(b, h, q, kv):
        return q >= kv

    def sliding(b, h, q, kv):
        return (q >= kv) & (q - kv <= WINDOW)

    def prefix(b, h, q, kv):
        return (kv < PREFIX) | (q >= kv)

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    def alibi(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)

    def softcap(score, b, h, q, kv):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def relative(score, b, h, q, kv):
        return score + bias[h, q - kv + seqlen - 1]

    return {
        "causal": (None, causal, dict(causal=True)),
        "sliding window": (None, sliding, dict(causal=True, window_size=(WINDOW, 0))),
        "softcap (causal)": (softcap, causal, dict(causal=True, softcap=SOFTCAP)),
        "document": (None, document, None),
        "ALiBi (causal)": (alibi, causal, dict(causal=True, alibi_slopes=slopes)),
        "relative bias": (relative, None, None),
        "prefix-LM": (None, prefix, None),
    }


def timed(forward, inputs, grad) -> tuple:
    """Forward and backward medians (ms) of forward(*inputs) (the backward of the output
    gradient `grad`) and the backward's longest kernels (us), its output and its gradients."""
    out = forward(*inputs)
    fwd = triton.testing.do_bench(lambda: forward(*inputs), warmup=25, rep=100)
    kept = forward(*inputs)
    bwd = triton.testing.do_bench(
        lambda: torch.autograd.grad(kept, inputs, grad, retain_graph=True), warmup=25, rep=100
    )
    grads = torch.autograd.grad(forward(*inputs), inputs, grad)
    kernels = kernel_times(lambda: torch.autograd.grad(kept, inputs, grad, retain_graph=True), 3)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:6]  # the backward's longest kernels
    times = dict(fwd_ms=fwd, bwd_ms=bwd, bwd_kernels_us={k[:80]: round(t, 1) for k, t in top})
    times |= dict(bwd_kernel_names=len(kernels), bwd_kernel_sum_us=round(sum(kernels.values()), 1))
    return times, out, grads


def expression_path(call):
    """call with flex_attention's built-in recognition off: the mods as expression kernels."""

    def run(*inputs):
        saved, flex_module.builtin_mask = flex_module.builtin_mask, lambda *args: None
        try:
            return call(*inputs)
        finally:
            flex_module.builtin_mask = saved

    return run


def bench_mod(name, mods, q, k, v) -> dict:
    score_mod, mask_mod, builtin = mods
    n = q.shape[2]
    mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, n, n, "cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    runs = {
        "attngen": lambda a, b, c: attngen.flex_attention(a, b, c, score_mod, block_mask=mask),
        "flex": lambda a, b, c: compiled(a, b, c, score_mod=score_mod, block_mask=mask),
    }
    if builtin is not None:
        runs["builtin"] = lambda a, b, c: attngen.flash_attn_func(
            *(t.transpose(1, 2) for t in (a, b, c)), **builtin
        ).transpose(1, 2)
    if builtin_mask(mapped(traced(score_mod, mask_mod)[:3]), n, n) is not None:
        runs["attngen_expr"] = expression_path(runs["attngen"])
    result: dict = dict(mod=name, ms={}, max_diff={}, errors={})
    seeded = torch.Generator(q.device).manual_seed(0)
    reference, grad = None, torch.randn(q.shape, generator=seeded, device=q.device, dtype=q.dtype)
    for impl, run in runs.items():
        try:
            times, out, grads = timed(run, (q, k, v), grad)
        except Exception as exc:  # a failing run is recorded, not fatal
            result["errors"][impl] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        result["ms"][impl] = times
        if impl == "attngen":
            dispatch = attngen.last_dispatch()
            result["dispatch"] = dict(module=dispatch.module, forward=dispatch.forward)
        if reference is None:
            reference = (out, *grads)
        pairs = zip(("out", "dq", "dk", "dv"), (out, *grads), reference, strict=True)
        diffs = {n: (a.float() - b.float()).abs().max().item() for n, a, b in pairs}
        result["max_diff"][impl] = diffs  # against attngen's own run: the first
    return result


def ratios(result: dict) -> dict:
    ms = result["ms"]
    found = {}
    for other in ("flex", "builtin", "attngen_expr"):
        if "attngen" in ms and other in ms:
            for half in ("fwd_ms", "bwd_ms"):
                found[f"{half[:3]}_x_{other}"] = ms[other][half] / ms["attngen"][half]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--n", type=int, nargs="+", default=[4096])
    parser.add_argument("--mods", nargs="+", help="only these mods, e.g. causal 'softcap (causal)'")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 1000
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    meta |= dict(triton=triton.__version__, date=datetime.date.today().isoformat())
    results = []
    for n in args.n:
        batch, heads = 16384 // n, 2048 // args.d
        q, k, v = (
            torch.randn(
                batch, heads, n, args.d, device="cuda", dtype=torch.bfloat16
            ).requires_grad_()
            for _ in range(3)
        )
        for name, mods in gym(heads, n).items():
            if args.mods and name not in args.mods:
                continue
            result = dict(n=n, d=args.d, **bench_mod(name, mods, q, k, v))
            result["ratios"] = ratios(result)
            results.append(result)
            shown = {key: round(value, 2) for key, value in result["ratios"].items()}
            print(f"N {n} D {args.d} {name:18s} {shown} {result['errors']}", flush=True)
            report = json.dumps(dict(meta, results=results), indent=1)
            (args.out / "bench_flex.json").write_text(report)
    print(meta)


if __name__ == "__main__":
    main()
