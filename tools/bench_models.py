"""Today's open models' attention on the H200: gpt-oss, Llama 4 and DeepSeek-V3's MLA decode.

One process, the same inputs per case, each runner checked against attngen's output before it
is timed (median of triton.testing.do_bench); bf16.

- gpt-oss-20b (examples/gpt_oss_20b.yaml, local layers): sliding window 128 + learned sinks,
  GQA 64/8, D = 64. Against compiled FlexAttention (the window as a block mask; the sinks as a
  correction on its LSE: out * sigmoid(lse - sink), which is exactly the sink's share of the
  normaliser, timed with the attention) and SDPA with an explicit mask (the sinks as one extra
  key of zeros whose bias is the sink and whose value is zero: exact, and the [H, N, N + 1]
  bias is what SDPA needs to express them).
- Llama-4-Scout (examples/llama4_scout.yaml, chunked layers): chunks of 8192, GQA 40/8,
  D = 128, against compiled FlexAttention with the chunked causal block mask.
- DeepSeek-V3 absorbed decode (examples/deepseek_v3.yaml, absorbed): 128 query heads over one
  latent KV head of 576 dims (values: its first 512, the same memory), paged by 64 tokens,
  B 1/32/128, cache 4k..32k. Reported as a fraction of the H200's 4.8 TB/s (the latent
  cache read once: B x L x 576 x 2 bytes, plus q and out). FlashMLA (`flash_mla`) and
  FlashInfer (`flashinfer`'s MLA wrapper) run beside it when importable; otherwise the JSON
  says why each was skipped. The absorbed form in PyTorch (two cuBLAS bmm and a softmax over
  the cache gathered to dense) runs on every machine.

    PYTHONPATH=. python tools/bench_models.py --out "$OUT" [--quick] [--no-flex]

JSON to --out (bench_models.json); a short table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.build import plan_build  # noqa: E402
from attngen.spec import KernelKind, load_spec_file  # noqa: E402

H200_BANDWIDTH = 4.8e12  # bytes/s, the datasheet's HBM3e rate
GPT_OSS_LENGTHS = (4096, 16384)
LLAMA4_LENGTHS = (16384, 32768)
MLA_BATCHES = (1, 32, 128)
MLA_LENGTHS = (4096, 8192, 16384, 32768)


def module_for(example: str, variant: str, kind: KernelKind, arch: str = "sm90"):
    """The example variant's module for `kind`, rendered from the spec (so the benchmark
    needs no rebuilt generated/) and imported by path."""
    spec = next(
        s for s in load_spec_file(ROOT / "examples" / f"{example}.yaml") if s.name.endswith(variant)
    )
    spec = spec.model_copy(update={"archs": (arch,)})
    artifact = next(a for a in plan_build([spec]) if a.entry["kind"] == kind.value)
    path = Path(tempfile.mkdtemp(prefix="attngen-models-")) / Path(artifact.relative_path).name
    path.write_text(artifact.source)
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    return spec, module


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def agree(name: str, got: torch.Tensor, want: torch.Tensor, problems: list[str]) -> bool:
    """bf16 outputs of two exact implementations differ by a few bf16 ulps of the largest
    output: each rounds its probabilities to bf16 at a different point (attngen before
    normalising, the PyTorch MLA anchor after) and the outputs themselves to bf16, so over
    millions of outputs (MLA at B 128: 8.4M) the largest difference reaches 4 ulps. A wrong
    anchor differs by O(max |out|)."""
    err = (got.float() - want.float()).abs().max().item()
    top = max(want.float().abs().max().item(), 1.0)
    bound = 8 * 2.0 ** (math.floor(math.log2(top)) - 7)  # 8 bf16 ulps at the largest output
    if not err <= bound:
        problems.append(f"{name}: max |diff| to attngen {err:.3e} > {bound:.3e}; not timed")
        return False
    return True


# ------------------------------------------------------------------------- gpt-oss


def gpt_oss_case(module, seqlen: int, use_flex: bool) -> dict:
    torch.manual_seed(0)
    hq, hkv, d, window = 64, 8, 64, 128
    q = torch.randn(1, hq, seqlen, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, seqlen, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    sinks = torch.randn(hq, device="cuda") * 2
    out = module.attention(q, k, v, sinks=sinks)
    row: dict = {"case": f"gpt-oss sliding 128 + sinks N={seqlen}", "problems": []}
    row["attngen_ms"] = bench(lambda: module.attention(q, k, v, sinks=sinks))
    if use_flex:
        flex = flex_sliding_sinks(q, k, v, sinks, window)
        if agree("flex", flex(), out, row["problems"]):
            row["flex_ms"] = bench(flex)
    if seqlen <= 8192:  # the [H, N, N + 1] bias: 2 GiB at N = 4096
        sdpa = sdpa_sliding_sinks(q, k, v, sinks, window)
        if agree("sdpa", sdpa(), out, row["problems"]):
            row["sdpa_ms"] = bench(sdpa)
    else:
        row["problems"].append(
            f"sdpa: skipped at N={seqlen} (its explicit [H, N, N + 1] "
            "bias would not fit comfortably)"
        )
    return row


def flex_sliding_sinks(q, k, v, sinks, window):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    n = q.shape[2]
    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run():
        out, lse = compiled(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
        # the sink's share: exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)
        return (out * torch.sigmoid(lse - sinks[None, :, None])[..., None]).to(q.dtype)

    return run


def sdpa_sliding_sinks(q, k, v, sinks, window):
    import torch.nn.functional as F

    n, hq, hkv = q.shape[2], q.shape[1], k.shape[1]
    i = torch.arange(n, device="cuda")[:, None]
    j = torch.arange(n, device="cuda")[None, :]
    seen = (j <= i) & (i - j < window)
    bias = torch.zeros(hq, n, n + 1, device="cuda", dtype=q.dtype)
    bias[:, :, :n].masked_fill_(~seen, float("-inf"))
    bias[:, :, n] = sinks.to(q.dtype)[:, None]
    zero = torch.zeros(1, hkv, 1, q.shape[-1], device="cuda", dtype=q.dtype)
    k_sink, v_sink = torch.cat([k, zero], 2), torch.cat([v, zero], 2)

    def run():
        return F.scaled_dot_product_attention(
            q, k_sink, v_sink, attn_mask=bias[None], enable_gqa=True
        )

    return run


# ------------------------------------------------------------------------- Llama 4


def llama4_case(module, seqlen: int, use_flex: bool) -> dict:
    torch.manual_seed(0)
    hq, hkv, d, chunk = 40, 8, 128, 8192
    q = torch.randn(1, hq, seqlen, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, seqlen, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    out = module.attention(q, k, v)
    row: dict = {"case": f"llama4 chunked 8192 N={seqlen}", "problems": []}
    row["attngen_ms"] = bench(lambda: module.attention(q, k, v))
    # causal work inside each chunk: N x chunk / 2 score pairs, 4 flops x D each
    row["attngen_tflops"] = (
        4 * d * hq * seqlen * min(chunk, seqlen) / 2 / (row["attngen_ms"] * 1e-3) / 1e12
    )
    if use_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx // chunk == kv_idx // chunk)

        block_mask = create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex():
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)

        if agree("flex", flex(), out, row["problems"]):
            row["flex_ms"] = bench(flex)
    return row


# ---------------------------------------------------------------------- MLA decode


def mla_case(module, batch: int, length: int) -> dict:
    torch.manual_seed(0)
    hq, latent, rope, page = 128, 512, 64, 64
    pages_per_seq = -(-length // page)
    num_pages = batch * pages_per_seq
    cache = torch.randn(num_pages, page, 1, latent + rope, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_pages, device="cuda", dtype=torch.int32).view(batch, -1)
    seqlens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, 1, latent + rope, device="cuda", dtype=torch.bfloat16)
    values = cache[..., :latent]  # the absorbed form's values are the latent itself

    def run():
        return module.decode(
            q, cache, values, seqlens, block_table=table, sm_scale=(128 + 64) ** -0.5
        )

    out = run()
    ms = bench(run)
    bytes_moved = batch * length * (latent + rope) * 2 + q.numel() * 2 + out.numel() * 2
    row = {
        "case": f"mla decode B={batch} L={length}",
        "attngen_ms": ms,
        "attngen_fraction": bytes_moved / (ms * 1e-3) / H200_BANDWIDTH,
        # 128 heads make the absorbed decode compute-bound (about 240 FLOP per cache byte)
        "attngen_tflops": 2 * batch * hq * length * (latent + rope + latent) / (ms * 1e-3) / 1e12,
        # the kernel that ran: V the latent key tile (values = cache[..., :512]), its tile
        # (64 head rows, the 512 + 64 split dot: attngen/tiling/decode_latent.py) and splits
        "v_from_k": module._values_are_latent_keys(cache, values),
        "config": dict(module.CONFIG),
        "num_splits": module.LAST_NUM_SPLITS,
        "problems": [],
    }
    for name, anchor in (
        ("flashmla", flashmla_runner),
        ("flashinfer", flashinfer_runner),
        ("torch", torch_mla_runner),
    ):
        try:
            fn = anchor(q, cache, table, seqlens, latent)
        except Exception as exc:  # an anchor that is absent or refuses the shape: say why
            row["problems"].append(f"{name}: skipped ({type(exc).__name__}: {exc})"[:300])
            continue
        if agree(name, fn(), out, row["problems"]):
            anchor_ms = bench(fn)
            row[f"{name}_ms"] = anchor_ms
            row[f"{name}_fraction"] = bytes_moved / (anchor_ms * 1e-3) / H200_BANDWIDTH
            row[f"{name}_tflops"] = row["attngen_tflops"] * ms / anchor_ms
    return row


def torch_mla_runner(q, cache, table, seqlens, latent):
    """The absorbed form in PyTorch (cuBLAS bmm, fp32 softmax) over the latent cache gathered
    to dense before timing: the anchor every machine has; it needs no paging and all
    sequences here have the same length."""
    length = int(seqlens[0])
    dense = cache[table.long()].flatten(1, 3)[:, :length]  # [B, L, 576]
    keys_t, values = dense.transpose(1, 2), dense[..., :latent]
    scale = (128 + 64) ** -0.5

    def run():
        scores = torch.bmm(q[:, :, 0], keys_t).float() * scale  # [B, Hq, L]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.bmm(probs, values)[:, :, None, :]

    return run


def flashmla_runner(q, cache, table, seqlens, latent):
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    metadata, splits = get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1)
    q_bshd = q.transpose(1, 2).contiguous()

    def run():
        out, _ = flash_mla_with_kvcache(
            q_bshd,
            cache,
            table,
            seqlens,
            latent,
            metadata,
            splits,
            softmax_scale=(128 + 64) ** -0.5,
            causal=True,
        )
        return out.transpose(1, 2)

    return run


def flashinfer_runner(q, cache, table, seqlens, latent):
    import flashinfer

    batch, page = q.shape[0], cache.shape[1]
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
    pages = table.shape[1]
    indptr = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * pages
    qo_indptr = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32)
    wrapper.plan(
        qo_indptr,
        indptr,
        table.flatten(),
        seqlens,
        q.shape[1],
        latent,
        cache.shape[-1] - latent,
        page,
        False,
        (128 + 64) ** -0.5,
        q.dtype,
        cache.dtype,
    )
    q_nope = q[:, :, 0, :latent].contiguous()
    q_pe = q[:, :, 0, latent:].contiguous()
    ckv, kpe = cache[:, :, 0, :latent], cache[:, :, 0, latent:]

    def run():
        return wrapper.run(q_nope, q_pe, ckv, kpe)[:, :, None, :]

    return run


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON")
    parser.add_argument("--quick", action="store_true", help="one size per model")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument(
        "--only", choices=("gpt_oss", "llama4", "mla"), action="append", help="these rows only"
    )
    args = parser.parse_args()
    wanted = set(args.only or ("gpt_oss", "llama4", "mla"))
    use_flex = not args.no_flex
    pick = (lambda xs: xs[:1]) if args.quick else (lambda xs: xs)
    rows = []
    if "gpt_oss" in wanted:
        _, gpt_oss = module_for("gpt_oss_20b", "local", KernelKind.prefill)
        rows += [gpt_oss_case(gpt_oss, n, use_flex) for n in pick(GPT_OSS_LENGTHS)]
    if "llama4" in wanted:
        _, llama4 = module_for("llama4_scout", "chunked", KernelKind.prefill)
        rows += [llama4_case(llama4, n, use_flex) for n in pick(LLAMA4_LENGTHS)]
    if "mla" in wanted:
        _, mla = module_for("deepseek_v3", "absorbed", KernelKind.decode)
        rows += [mla_case(mla, b, n) for b in pick(MLA_BATCHES) for n in pick(MLA_LENGTHS)]
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bandwidth_reference": H200_BANDWIDTH,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_models.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print(
        f"{'case':40} {'attngen':>9} {'flex':>9} {'sdpa':>9} {'torch':>9} {'flashmla':>9} "
        f"{'flashinfer':>10} {'attngen BW':>10}"
    )

    def cell(row, key, width=9):
        value = row.get(key)
        return f"{value:{width}.3f}" if isinstance(value, float) else " " * (width - 1) + "-"

    for row in rows:
        fraction = row.get("attngen_fraction")
        shown = f"{fraction:10.2f}" if fraction is not None else " " * 9 + "-"
        print(
            f"{row['case']:40} {cell(row, 'attngen_ms')} {cell(row, 'flex_ms')} "
            f"{cell(row, 'sdpa_ms')} {cell(row, 'torch_ms')} {cell(row, 'flashmla_ms')} "
            f"{cell(row, 'flashinfer_ms', 10)} {shown}"
        )
        fractions = [
            f"{name} {row[f'{name}_fraction']:.2f}"
            for name in ("attngen", "torch", "flashmla", "flashinfer")
            if isinstance(row.get(f"{name}_fraction"), float)
        ]
        if len(fractions) > 1:  # the MLA rows: every kernel's share of the bandwidth
            tflops = ", ".join(
                f"{name} {row[f'{name}_tflops']:.0f}"
                for name in ("attngen", "torch", "flashmla", "flashinfer")
                if isinstance(row.get(f"{name}_tflops"), float)
            )
            print(
                "    BW "
                + ", ".join(fractions)
                + f"; TFLOP/s {tflops}; config {row.get('config')}, "
                f"{row.get('num_splits')} split(s), V from K {row.get('v_from_k')}"
            )
        for problem in row["problems"]:
            print(f"    {problem}")
    print("(ms, median; BW = fraction of 4.8 TB/s)")


if __name__ == "__main__":
    main()
