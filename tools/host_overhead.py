"""Host time per call of every public entry point, beside torch SDPA and a bare Triton launch
measured in the same run (one GPU, eager mode).

Host time per call = wall time of back-to-back calls / calls: at these shapes the GPU work is
a few microseconds, so the host is the bottleneck and the loop measures it. The ratio column
divides by torch SDPA's row, which makes runs on hosts of different speed comparable.

Shapes: prefill B 1, H 12, N 64, D 64 fp16 (BERT-base's module; causal rows GPT-2's; on a
Hopper GPU the module reads K/V of so small a launch by pointers, and one row forces its TMA
path for comparison); varlen one sequence of 64 tokens of Llama-3-8B (bf16, 32/8 heads,
D 128, causal); decode B 1, one query token against 64 or 4096 cached keys, contiguous
(Qwen2.5-7B's module, 28/4 heads) and paged (Llama-3-8B's, page 16); and the decode steps of
STEPS (Llama-3-8B's heads, contiguous and paged, 1 and 8 query tokens, with and without an
append, and fp8 caches), through flash_attn_with_kvcache and the serving module's
decode_flash (modules that generated/ lacks are built on demand at the first call: seconds
of compiles before the timing).

Usage, from the repository root after `pip install -e .` and
`python -m attngen build examples/*.yaml`, on a machine with a GPU:

    python tools/host_overhead.py            # writes $OUT/host_overhead.json (OUT: /tmp)
"""

from __future__ import annotations

import cProfile
import datetime
import io
import json
import os
import pstats
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton

import attngen
from attngen.runtime.hf import attngen_attention
from attngen.runtime.registry import current_registry

SDPA_ROW = "torch sdpa (default dispatch)"


@triton.jit
def _noop(X):
    pass


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):  # compiles, fills every cache
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def profile_text(call, calls: int = 2000, lines: int = 18) -> str:
    """A cProfile of `calls` calls (the GPU synchronised at the end): the top `lines`
    functions by their own time."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def module_for(kind: str, name_part: str):
    """The generated module of `kind` whose name contains name_part, for this GPU's arch."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm{major}{minor}"
    entry = next(
        e
        for e in current_registry().entries
        if e.kind == kind and e.arch == arch and name_part in e.module
    )
    return current_registry().module(entry.key)


def forced_tma(module, call):
    """call() with the module's small-launch pointer loads off: K/V through TMA descriptors,
    as every launch read them before POINTER_LOADS_UP_TO."""
    saved, module.POINTER_LOADS_UP_TO = module.POINTER_LOADS_UP_TO, 0
    try:
        return call()
    finally:
        module.POINTER_LOADS_UP_TO = saved


def prefill_rows(rows: dict) -> None:
    q = torch.randn(1, 12, 64, 64, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash layout
    x = torch.empty(16, device="cuda")
    bert = module_for("prefill", "bert_base")
    out = torch.empty_like(qf).transpose(1, 2)
    layer = SimpleNamespace(is_causal=True)
    rows[SDPA_ROW] = lambda: F.scaled_dot_product_attention(q, k, v)
    rows["bare triton launch (1 arg)"] = lambda: _noop[(1,)](x)
    rows["module attention()"] = lambda: bert.attention(q, k, v)
    rows["module attention(out=)"] = lambda: bert.attention(q, k, v, out=out)
    if hasattr(bert, "POINTER_LOADS_UP_TO"):  # TMA modules: the descriptors' share of the row
        rows["module attention(), TMA forced (descriptors)"] = lambda: forced_tma(
            bert, lambda: bert.attention(q, k, v)
        )
    if hasattr(bert, "attention_flash"):  # flash_attn_func's entry point: [B, N, H, D] in, out
        rows["module attention_flash()"] = lambda: bert.attention_flash(qf, kf, vf)
        rows["module attention_flash_out() (transformers)"] = lambda: bert.attention_flash_out(
            q, k, v
        )
        if hasattr(bert, "POINTER_LOADS_UP_TO"):
            rows["module attention_flash(), TMA forced (descriptors)"] = lambda: forced_tma(
                bert, lambda: bert.attention_flash(qf, kf, vf)
            )
    rows["attngen.scaled_dot_product_attention"] = lambda: attngen.scaled_dot_product_attention(
        q, k, v
    )
    rows["attngen.flash_attn_func"] = lambda: attngen.flash_attn_func(qf, kf, vf)
    rows["attngen.flash_attn_func causal (gpt2)"] = lambda: attngen.flash_attn_func(
        qf, kf, vf, causal=True
    )
    qkv = torch.stack((qf, kf, vf), dim=2)  # [B, N, 3, H, D]
    rows["attngen.flash_attn_qkvpacked_func"] = lambda: attngen.flash_attn_qkvpacked_func(qkv)
    rows["transformers attention causal (gpt2)"] = lambda: attngen_attention(layer, q, k, v, None)


def varlen_rows(rows: dict) -> None:
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)
    llama3 = module_for("varlen", "llama3_8b")
    rows["varlen module attention_varlen() (llama3, 64)"] = lambda: llama3.attention_varlen(
        q, k, v, cu, cu, 64, 64
    )
    rows["attngen.flash_attn_varlen_func causal (llama3, 64)"] = lambda: (
        attngen.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, causal=True)
    )


def decode_rows(rows: dict) -> None:
    qwen = module_for("decode", "qwen2_5_7b")
    q = torch.randn(1, 1, 28, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(1, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q_paged = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    pages = torch.randn(256, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(256, device="cuda", dtype=torch.int32)[None]
    for length in (64, 4096):
        lens = torch.full((1,), length, dtype=torch.int32, device="cuda")
        rows[f"attngen.flash_attn_with_kvcache contiguous (B1, L{length})"] = lambda lens=lens: (
            attngen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
        )
        rows[f"attngen.flash_attn_with_kvcache paged (B1, L{length})"] = lambda lens=lens: (
            attngen.flash_attn_with_kvcache(
                q_paged, pages, pages, cache_seqlens=lens, block_table=table, causal=True
            )
        )
    lens = torch.full((1,), 64, dtype=torch.int32, device="cuda")
    heads_first = [t.transpose(1, 2) for t in (q, k_cache, v_cache)]
    rows["decode module decode() (B1, L64)"] = lambda: qwen.decode(*heads_first, lens)
    if hasattr(qwen, "decode_flash"):  # flash_attn_with_kvcache's entry point: no views
        rows["decode module decode_flash() (B1, L64)"] = lambda: qwen.decode_flash(
            q, k_cache, v_cache, lens
        )


# The decode steps both host-time tools time (this one on the GPU, host_overhead_cpu.py on CPU
# stand-ins): Llama-3-8B's heads (32 query, 8 KV, D 128), B 1, 64 keys cached of 4096, a
# contiguous and a paged (16) cache, one and 8 query tokens, with and without an append of as
# many new keys; and fp8 caches (FA3's descales) with an append.
STEPS = [
    (layout, tokens, append)
    for layout in ("contiguous", "paged")
    for tokens in (1, 8)
    for append in (False, True)
]


def step_arguments(device, dtype, layout: str, tokens: int, append: bool, fp8: bool = False):
    """flash_attn_with_kvcache's (args, keywords) for one decode step of STEPS."""
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    shape = (1, 4096, 8, 128) if layout == "contiguous" else (256, 16, 8, 128)
    caches = [torch.randn(shape, device=device).to(cache_dtype) for _ in range(2)]
    q = torch.randn(1, tokens, 32, 128, device=device, dtype=dtype)
    new = [torch.randn(1, tokens, 8, 128, device=device, dtype=dtype) for _ in range(2)]
    keywords = dict(cache_seqlens=torch.full((1,), 64, dtype=torch.int32, device=device))
    if layout == "paged":
        keywords["block_table"] = torch.arange(256, device=device, dtype=torch.int32)[None]
    if fp8:
        keywords |= {n: torch.ones(1, 8, device=device) for n in ("k_descale", "v_descale")}
    return (q, *caches, *(new if append else (None, None))), dict(keywords, causal=True)


def decode_step_rows(rows: dict, device="cuda", dtype=torch.bfloat16) -> None:
    """STEPS (and fp8 caches) through flash_attn_with_kvcache, and through the decode_flash of
    the module that served each (the module's own host time), as rows; a case that fails
    (no module for it) leaves its error as its row."""
    cases = [(*step, False) for step in STEPS]
    cases += [(layout, 1, True, True) for layout in ("contiguous", "paged")]
    for layout, tokens, append, fp8 in cases:
        args, keywords = step_arguments(device, dtype, layout, tokens, append, fp8)
        name = f"{'fp8 ' if fp8 else ''}{layout}, {tokens} token{'s' if tokens > 1 else ''}"
        name += ", append" if append else ""
        try:
            attngen.flash_attn_with_kvcache(*args, **keywords)  # the module (built on demand)
        except Exception as exc:
            rows[f"attngen.flash_attn_with_kvcache {name}"] = f"error: {exc}"[:200]
            continue
        module = current_registry().module(attngen.last_dispatch().key)
        rows[f"attngen.flash_attn_with_kvcache {name}"] = lambda a=args, kw=keywords: (
            attngen.flash_attn_with_kvcache(*a, **kw)
        )
        flash = {k: v for k, v in keywords.items() if k not in ("causal", "cache_seqlens")}
        flash |= dict(k_new=args[3], v_new=args[4], cache_seqlens=keywords["cache_seqlens"])
        rows[f"decode module decode_flash() {name}"] = lambda m=module, a=args, kw=flash: (
            m.decode_flash(*a[:3], **kw)
        )


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    calls: dict = {}
    results: dict[str, object] = {}
    for add in (prefill_rows, varlen_rows, decode_rows, decode_step_rows):
        try:
            add(calls)
        except Exception as exc:  # one missing module must not hide the other rows
            results[add.__name__] = f"error: {type(exc).__name__}: {exc}"
            traceback.print_exc()
    for name, call in calls.items():
        if isinstance(call, str):  # the case's error (decode_step_rows)
            results[name] = call
            continue
        try:
            results[name] = round(host_us(call), 2)
        except Exception as exc:
            results[name] = f"error: {type(exc).__name__}: {exc}"
            traceback.print_exc()
    sdpa = results.get(SDPA_ROW)
    report = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host_us": results,
        "ratio_to_torch_sdpa": {
            n: round(u / sdpa, 2)
            for n, u in results.items()
            if isinstance(u, float) and isinstance(sdpa, float)
        },
    }
    path = out_dir / "host_overhead.json"
    path.write_text(json.dumps(report, indent=1))
    print(
        f"host time per call, us ({report['gpu']}, torch {torch.__version__}, "
        f"triton {triton.__version__}); ratio to torch SDPA"
    )
    for name, value in results.items():
        ratio = report["ratio_to_torch_sdpa"].get(name, "")
        print(f"  {name:58s} {value!s:>10} {ratio!s:>7}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
