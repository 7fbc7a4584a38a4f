"""Block sparsity benchmark: a document mask as an expression, with and without `block_mask=`,
against compiled FlexAttention with the same block mask.

Packed documents (random lengths, seeded) in one sequence of N = 4k-16k keys, 4-16 documents,
optionally causal; mask_mod `doc[b, q_idx] == doc[b, kv_idx]` (and the built-in causal mask).
Three runs per case, in one process, on the same inputs: attngen's expression module with the
block mask torch's create_block_mask makes on the device (BLOCK_SIZE 128: the sparse kernel
visits only the listed blocks and skips mask_mod on full ones), the same module without it
(every key block the built-in mask keeps, mask_mod per element), and torch.compile'd
flex_attention with that block mask. TFLOP/s count only the visible (query, key) pairs, so a
kernel that skips empty blocks shows its gain. Usage (on a CUDA machine, from the repository
root):

    PYTHONPATH=. python tools/bench_block_sparse.py --out results/ [--quick] [--no-flex]

Prints a table and writes results/bench_block_sparse.json (after every case).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefill import load_module  # noqa: E402  (tools/ is not a package)

from attngen.spec import specs_from_data  # noqa: E402

HEADS, HEAD_DIM, BLOCK = 16, 128, 128
SEQLENS, DOCUMENTS = (4096, 8192, 16384), (4, 16)


def document_spec(causal: bool):
    mask = dict(mask="causal", causal_align="top_left") if causal else dict(mask="none")
    return specs_from_data(
        dict(
            name=f"bench_doc_{'causal' if causal else 'full'}",
            archs=["sm90"],
            dtype="bf16",
            head_dim=HEAD_DIM,
            num_q_heads=HEADS,
            num_kv_heads=HEADS,
            kernels=["prefill"],
            mask_mod="doc[b, q_idx] == doc[b, kv_idx]",
            tensors=[{"name": "doc", "dtype": "int32", "shape": ["B", "N"]}],
            **mask,
        )
    )[0]


def documents(seqlen: int, count: int, seed: int) -> torch.Tensor:
    """doc ids [1, seqlen] int32 of `count` documents of random lengths (at least 1/4 of the
    mean each)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 0.25 + torch.rand(count, generator=gen)
    lengths = (weights / weights.sum() * seqlen).long().clamp(min=1)
    lengths[-1] = seqlen - lengths[:-1].sum()
    return torch.repeat_interleave(torch.arange(count, dtype=torch.int32), lengths)[None]


def visible_pairs(doc: torch.Tensor, causal: bool) -> int:
    lengths = torch.bincount(doc[0].long()).tolist()
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def runners(module, q, k, v, doc, causal: bool, use_flex: bool):
    """{name: callable} of the three runs, and the block mask's density (listed blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seqlen = q.shape[2]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = doc[b, q_idx] == doc[b, kv_idx]
        return keep & (q_idx >= kv_idx) if causal else keep

    mask = create_block_mask(mask_mod, 1, None, seqlen, seqlen, device="cuda", BLOCK_SIZE=BLOCK)
    lists = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    block_mask = (*lists, BLOCK, BLOCK)
    tensors = {"doc": doc}
    found = {
        "sparse": lambda: module.attention(q, k, v, tensors=tensors, block_mask=block_mask),
        "dense": lambda: module.attention(q, k, v, tensors=tensors),
    }
    if use_flex:
        compiled = torch.compile(flex_attention, dynamic=False)
        found["flex"] = lambda: compiled(q, k, v, block_mask=mask)
    rows = mask.kv_num_blocks.numel()
    listed = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    return found, dict(
        listed_fraction=listed / (rows * mask.kv_indices.shape[-1]),
        full_fraction=int(mask.full_kv_num_blocks.sum()) / max(listed, 1),
    )


def bench_case(seqlen: int, count: int, causal: bool, use_flex: bool) -> dict:
    module = load_module(document_spec(causal))
    shape = (1, HEADS, seqlen, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc = documents(seqlen, count, seed=seqlen + count).cuda()
    found, density = runners(module, q, k, v, doc, causal, use_flex)
    flops = 4 * HEADS * HEAD_DIM * visible_pairs(doc.cpu(), causal)
    label = f"N{seqlen} docs{count} {'causal' if causal else 'full'}"
    result = dict(label=label, seqlen=seqlen, documents=count, causal=causal, **density)
    result |= dict(config=dict(module.CONFIG), ms={}, tflops={}, max_abs_diff={}, errors={})
    reference = None
    for name, run in found.items():
        try:
            out = run()
            torch.cuda.synchronize()
        except Exception as exc:  # a run that fails is recorded, not fatal
            result["errors"][name] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        reference = out if reference is None else reference
        result["max_abs_diff"][name] = (out.float() - reference.float()).abs().max().item()
        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
        result["ms"][name], result["tflops"][name] = ms, flops / ms / 1e9
    return result


def print_table(results: list[dict]) -> None:
    head = f"{'case':24s} {'listed':>6s} {'sparse':>8s} {'dense':>8s} {'flex':>8s}"
    print(f"\n{head} {'x dense':>8s} {'x flex':>8s}  (TFLOP/s of visible pairs)")
    for r in results:
        t = r["tflops"]
        cells = [f"{t[n]:8.1f}" if n in t else f"{'-':>8s}" for n in ("sparse", "dense", "flex")]
        ratios = [
            f"{t['sparse'] / t[n]:8.2f}" if "sparse" in t and n in t else f"{'-':>8s}"
            for n in ("dense", "flex")
        ]
        print(f"{r['label']:24s} {r['listed_fraction']:6.2f} {' '.join(cells)} {' '.join(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="N = 4k only")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 1000
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seqlen in SEQLENS[:1] if args.quick else SEQLENS:
        for count in DOCUMENTS:
            for causal in (False, True):
                results.append(bench_case(seqlen, count, causal, use_flex=not args.no_flex))
                print(
                    results[-1]["label"], results[-1]["tflops"], results[-1]["errors"], flush=True
                )
                (args.out / "bench_block_sparse.json").write_text(
                    json.dumps(dict(meta=meta, results=results), indent=1)
                )
    print(meta)
    print_table(results)


if __name__ == "__main__":
    main()
