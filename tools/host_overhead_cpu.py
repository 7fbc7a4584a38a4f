"""The runtime's own Python overhead per public call, on the CPU, with the kernel stubbed out.

Under Triton's interpreter a real kernel call is dominated by the interpreter, so this tool
loads a registry of stand-in modules instead: each honours its kind's entry-point contract
(docs/generated_modules.md) and returns an output it allocates (or the `out=` it is given)
without running anything. What a public call costs beyond the module's own entry point is the
runtime's share of the host time (dispatch, argument checks, the op layer, layout handling,
copies).

Two registries are timed: stand-ins without `out=` (whose output the runtime copies), and
stand-ins that advertise ACCEPTS_OUT, take `out=` and have the entry points with flash-attn's
layout, prefill's `attention_flash` and `attention_flash_out` and decode's `decode_flash` and
`decode_flash_out` (as the templates render them now). Then
the generated modules' own entry points (generated/, sm90) with their cached launcher on, as
on a GPU, and the launch itself stubbed out: the modules' share of the host time; and the
public functions over those modules at tools/host_overhead.py's shapes, whose ratio to the
module's row is what the runtime adds; then tools/host_overhead.py's decode steps (STEPS:
contiguous and paged, 1 and 8 query tokens, appends, fp8 caches) over fp16 modules with
max_query_tokens 8 built into a temporary folder, through flash_attn_with_kvcache and their
decode_flash; last, the prefill module's entry point phase by phase (its plan, its full
path, TMA descriptors, and the pieces alone).

Shape: B 1, H 12, N 64, D 64, fp16 (the H200 host-time shape of docs/performance.md); decode:
B 1, one query token, a 64-token cache.

    python tools/host_overhead_cpu.py [--calls 2000] [--repeat 7]

Prints microseconds per call: the best of `repeat` runs of `calls` back-to-back calls, timed
in this thread's CPU time (time.thread_time: other processes on a shared machine do not count,
and the best run is the one least disturbed by what they do to the caches).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import tempfile
import textwrap
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors are served under the interpreter
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import attngen  # noqa: E402
from attngen.host import template_hash  # noqa: E402
from attngen.runtime import ops  # noqa: E402
from attngen.runtime.hf import attngen_attention  # noqa: E402
from attngen.runtime.registry import load_kernels  # noqa: E402
from tools.host_stubs import stubbed_generated_modules  # noqa: E402

HEADS, SEQLEN, DIM = 12, 64, 64

_CONSTANTS = """\
    import torch

    HEAD_DIM = 64
    HEAD_DIM_V = 64
    DTYPE = torch.float16
    MASK = {mask!r}
    CAUSAL_ALIGN = {align!r}
    SOFTCAP = 0.0
    ALIBI = False
    KV_LAYOUT = "contiguous"
    PAGE_SIZE = 0
    MAX_QUERY_TOKENS = 1
    ACCEPTS_OUT = {accepts_out}
"""

_ENTRY_POINTS = {
    "prefill": """
        def attention(q, k, v, *, sm_scale=None, alibi_slopes=None, return_lse=False{out}):
            if out is None:
                out = q.new_empty((*q.shape[:3], HEAD_DIM_V))
            if return_lse:
                return out, q.new_empty(q.shape[:3], dtype=torch.float32)
            return out
    """,
    "varlen": """
        def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                             sm_scale=None, alibi_slopes=None, return_lse=False,
                             seqused_k=None{out}):
            if out is None:
                out = q.new_zeros((*q.shape[:2], HEAD_DIM_V))
            if return_lse:
                return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
            return out
    """,
    "decode": """
        def decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None,
                   v_new=None, sm_scale=None, alibi_slopes=None, return_lse=False{out}):
            if out is None:
                out = q.new_empty((*q.shape[:3], HEAD_DIM_V))
            if return_lse:
                return out, q.new_empty(q.shape[:3], dtype=torch.float32)
            return out
    """,
}

# The prefill entry points with flash-attn's output layout, as the templates render them now.
_FLASH_ENTRY = """
    def _heads_last(q, batch, rows, heads, return_lse, out):
        out = q.new_empty((batch, rows, heads, HEAD_DIM_V)) if out is None else out
        return (out, q.new_empty((batch, heads, rows), dtype=torch.float32)) if return_lse else out

    def attention_flash(q, k, v, *, return_lse=False, out=None, **options):
        return _heads_last(q, *q.shape[:3], return_lse, out)

    def attention_flash_out(q, k, v, *, return_lse=False, out=None, **options):
        return _heads_last(q, q.shape[0], q.shape[2], q.shape[1], return_lse, out)
"""

# The decode entry points with flash-attn's layout, as the templates render them now.
_DECODE_FLASH_ENTRY = """
    def _decode_heads_last(q, batch, rows, heads, return_lse, out):
        out = q.new_empty((batch, rows, heads, HEAD_DIM_V)) if out is None else out
        return (out, q.new_empty((batch, heads, rows), dtype=torch.float32)) if return_lse else out

    def decode_flash(q, k_cache, v_cache, cache_seqlens, *, return_lse=False, out=None, **options):
        return _decode_heads_last(q, *q.shape[:3], return_lse, out)

    def decode_flash_out(q, k_cache, v_cache, cache_seqlens, *, return_lse=False, out=None,
                         **options):
        return _decode_heads_last(q, q.shape[0], q.shape[2], q.shape[1], return_lse, out)
"""

# (module name, kind, mask, causal_align): what the timed calls ask for.
_MODULES = [
    ("stub_none", "prefill", "none", "none"),
    ("stub_causal", "prefill", "causal", "bottom_right"),
    ("stub_causal", "varlen", "causal", "bottom_right"),
    ("stub_causal", "decode", "causal", "bottom_right"),
]


def stub_source(kind: str, mask: str, align: str, accepts_out: bool) -> str:
    entry = (
        _ENTRY_POINTS[kind]
        .replace("{out}", ", out=None" if accepts_out else "")
        .replace("if out is None:", "if out is None:" if accepts_out else "if True:")
    )
    constants = _CONSTANTS.format(mask=mask, align=align, accepts_out=accepts_out)
    flash_entry = {"prefill": _FLASH_ENTRY, "decode": _DECODE_FLASH_ENTRY}.get(kind, "")
    flash_entry = textwrap.dedent(flash_entry) if accepts_out else ""
    template = "decode.py.jinja" if kind == "decode" else "prefill.py.jinja"
    header = f"# Generated by attngen {attngen.__version__} from template {template} "
    header += f"({template_hash(template)}).\n"  # what the registry's header check reads
    return header + textwrap.dedent(constants) + textwrap.dedent(entry) + flash_entry


def build_stub_folder(folder: Path, accepts_out: bool) -> Path:
    """A kernel folder of stand-in modules, with the index `attngen build` would write."""
    (folder / "sm90").mkdir(parents=True, exist_ok=True)
    entries = []
    for name, kind, mask, align in _MODULES:
        source = stub_source(kind, mask, align, accepts_out)
        path = f"sm90/{name}_{kind}.py"
        (folder / path).write_text(source)
        spec = dict(
            name=name,
            dtype="fp16",
            head_dim=DIM,
            head_dim_v=DIM,
            num_q_heads=HEADS,
            num_kv_heads=HEADS,
            mask=mask,
            softcap=0.0,
            alibi=False,
        )
        if mask != "none":
            spec["causal_align"] = align
        if kind == "decode":
            spec.update(kv_layout="contiguous", page_size=None, max_query_tokens=1)
        entries.append(
            {
                "module": f"{name}_{kind}",
                "path": path,
                "arch": "sm90",
                "kind": kind,
                "spec": spec,
                "sha256": hashlib.sha256(source.encode()).hexdigest(),
            }
        )
    (folder / "index.json").write_text(json.dumps({"schema": 1, "modules": entries}))
    return folder


def public_calls() -> dict[str, object]:
    """name -> a zero-argument call at the tiny shape."""
    q = torch.randn(1, HEADS, SEQLEN, DIM, dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash layout
    packed = [t.reshape(SEQLEN, HEADS, DIM) for t in (qf, kf, vf)]
    cu = torch.tensor([0, SEQLEN], dtype=torch.int32)
    q1 = torch.randn(1, 1, HEADS, DIM, dtype=torch.float16)
    k_cache = torch.randn(1, 4096, HEADS, DIM, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.full((1,), 64, dtype=torch.int32)
    layer = SimpleNamespace(is_causal=True)
    stub = attngen.runtime.current_registry()
    prefill_key = next(e.key for e in stub.entries if e.module == "stub_none_prefill")
    module = stub.module(prefill_key)
    # The torch.library op itself (named prefill_op where eager calls skip it).
    op = getattr(ops, "prefill_op", ops.prefill)
    op_args = (prefill_key, q, k, v, 0.125, None, False) + (
        (False,) if op is not ops.prefill else ()
    )
    sdpa, flash, varlen = (
        attngen.scaled_dot_product_attention,
        attngen.flash_attn_func,
        attngen.flash_attn_varlen_func,
    )
    kvcache = attngen.flash_attn_with_kvcache
    return {
        "module attention() (the stub itself)": lambda: module.attention(q, k, v),
        "attngen::prefill op (torch.library)": lambda: op(*op_args),
        "scaled_dot_product_attention": lambda: sdpa(q, k, v),
        "flash_attn_func": lambda: flash(qf, kf, vf),
        "flash_attn_func causal": lambda: flash(qf, kf, vf, causal=True),
        "flash_attn_varlen_func causal": lambda: varlen(
            *packed, cu, cu, SEQLEN, SEQLEN, causal=True
        ),
        "flash_attn_with_kvcache (decode, L 64)": lambda: kvcache(
            q1, k_cache, v_cache, cache_seqlens=lens, causal=True
        ),
        "transformers attention (causal)": lambda: attngen_attention(layer, q, k, v, None),
    }


def generated_module_calls() -> dict[str, object]:
    """The generated modules' own entry points and the public functions that reach them, at
    the GPU benchmark's shapes (tools/host_overhead.py), launches stubbed: what the runtime's
    layers add to the module's own host time."""
    modules = stubbed_generated_modules()
    bert, qwen = modules["prefill bert_base"], modules["decode qwen2_5_7b"]
    q = torch.randn(1, HEADS, SEQLEN, DIM, dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash layout
    out = torch.empty_like(qf)
    qv, kv = torch.randn(64, 32, 128).bfloat16(), torch.randn(64, 8, 128).bfloat16()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    qd = torch.randn(1, 1, 28, 128).bfloat16()
    cache = torch.randn(1, 4096, 4, 128).bfloat16()
    q_paged = torch.randn(1, 1, 32, 128).bfloat16()
    pages = torch.randn(256, 16, 8, 128).bfloat16()
    table = torch.arange(256, dtype=torch.int32)[None]
    lens = torch.full((1,), 64, dtype=torch.int32)
    heads_first = [t.transpose(1, 2) for t in (qd, cache, cache)]
    out_d = torch.empty_like(qd)
    layer = SimpleNamespace(is_causal=True)
    return {
        "generated attention() (bert)": lambda: bert.attention(q, k, v),
        "generated attention(out=), flash views": lambda: bert.attention(
            qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), out=out.transpose(1, 2)
        ),
        "generated attention_flash() (bert)": lambda: bert.attention_flash(qf, kf, vf),
        "generated attention_flash_out() (bert)": lambda: bert.attention_flash_out(q, k, v),
        "generated attention_varlen() (llama3)": lambda: modules[
            "varlen llama3_8b"
        ].attention_varlen(qv, kv, kv, cu, cu, 64, 64),
        "generated decode() (qwen, L 64)": lambda: qwen.decode(*heads_first, lens),
        "generated decode(out=), flash views": lambda: qwen.decode(
            qd.transpose(1, 2),
            cache.transpose(1, 2),
            cache.transpose(1, 2),
            lens,
            out=out_d.transpose(1, 2),
        ),
        "generated decode_flash() (qwen, L 64)": lambda: qwen.decode_flash(qd, cache, cache, lens),
        "generated decode_flash_out() (qwen, L 64)": lambda: qwen.decode_flash_out(
            *heads_first, lens
        ),
        "scaled_dot_product_attention (bert)": lambda: attngen.scaled_dot_product_attention(
            q, k, v
        ),
        "flash_attn_func (bert)": lambda: attngen.flash_attn_func(qf, kf, vf),
        "flash_attn_func causal (gpt2)": lambda: attngen.flash_attn_func(qf, kf, vf, causal=True),
        "flash_attn_varlen_func causal (llama3)": lambda: attngen.flash_attn_varlen_func(
            qv, kv, kv, cu, cu, 64, 64, causal=True
        ),
        "flash_attn_with_kvcache (qwen, L 64)": lambda: attngen.flash_attn_with_kvcache(
            qd, cache, cache, cache_seqlens=lens, causal=True
        ),
        "flash_attn_with_kvcache paged (llama3)": lambda: attngen.flash_attn_with_kvcache(
            q_paged, pages, pages, cache_seqlens=lens, block_table=table, causal=True
        ),
        "transformers attention causal (gpt2)": lambda: attngen_attention(layer, q, k, v, None),
        **dynamic_cache_steps(layer),
    }


def training_steps() -> dict[str, object]:
    """A training step's forward and backward (llama3's prefill module, bf16, launches of
    both stubbed): the module's own autograd, and the runtime's op and formula around it."""
    llama = stubbed_generated_modules()["prefill llama3_8b"]
    q = torch.randn(1, 32, 64, 128).bfloat16()
    kv = torch.randn(1, 8, 64, 128).bfloat16()
    dout = torch.randn_like(q)

    def step(attend, *tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        attend(*leaves).backward(dout if leaves[0].shape == dout.shape else dout.transpose(1, 2))

    flash = [t.transpose(1, 2) for t in (q, kv, kv)]
    return {
        "generated attention() fwd+bwd (llama3)": lambda: step(llama.attention, q, kv, kv),
        "flash_attn_func causal fwd+bwd (llama3)": lambda: step(
            lambda *qkv: attngen.flash_attn_func(*qkv, causal=True, deterministic=True), *flash
        ),
    }


def dynamic_cache_steps(layer) -> dict[str, object]:
    """A DynamicCache's decode step through the transformers function (Llama-3-8B's heads,
    bf16, one query token): on the decode module (the mask function's CacheLengths) and on
    the prefill kind (no mask), with the key count the same on every call and growing by one
    a call (4096 key counts in turn: every call a new shape, as between decode steps)."""
    from attngen.runtime.hf import CacheLengths

    q = torch.randn(1, 32, 1, 128).bfloat16()
    buffer = torch.randn(1, 8, 4096 + 128, 128).bfloat16()
    steps = [
        (buffer[:, :, : 128 + i], CacheLengths(torch.full((1,), 128 + i, dtype=torch.int32), True))
        for i in range(4096)
    ]
    turn = itertools.cycle(range(len(steps)))

    def growing(with_lengths: bool):
        def step():
            keys, lengths = steps[next(turn)]
            attngen_attention(layer, q, keys, keys, lengths if with_lengths else None)

        return step

    keys, lengths = steps[0]
    return {
        "DynamicCache step, decode module, same Nk": lambda: attngen_attention(
            layer, q, keys, keys, lengths
        ),
        "DynamicCache step, decode module, Nk growing": growing(True),
        "DynamicCache step, prefill kind, same Nk": lambda: attngen_attention(
            layer, q, keys, keys, None
        ),
        "DynamicCache step, prefill kind, Nk growing": growing(False),
    }


# Decode modules for tools/host_overhead.py's STEPS on CPU tensors: Llama-3-8B's heads with
# up to 8 query tokens (fp16: the interpreter's bf16 asks the device again at every planned
# call, which a GPU does not), contiguous and paged 16, and the same with fp8 caches.
_STEP_SPECS = [
    {"name": f"steps{'_fp8' if fp8 else ''}", "kv_layout": layout, "page_size": page}
    | ({"kv_dtype": "fp8_e4m3"} if fp8 else {})
    for fp8 in (False, True)
    for layout, page in (("contiguous", None), ("paged", 16))
]


def decode_step_calls(folder: Path) -> dict[str, object]:
    """tools/host_overhead.py's decode steps (decode_step_rows) over modules built into
    `folder` and stubbed: flash_attn_with_kvcache's host time and its module's share."""
    from attngen.build import plan_build, write_build
    from attngen.spec import specs_from_data
    from tools.host_overhead import decode_step_rows
    from tools.host_stubs import stubbed_registry

    common = dict(archs=["sm90"], dtype="fp16", head_dim=128, num_q_heads=32, num_kv_heads=8)
    common |= dict(mask="causal", causal_align="bottom_right", kernels=["decode"])
    common |= dict(max_query_tokens=8)
    specs = [s for data in _STEP_SPECS for s in specs_from_data({**common, **data})]
    write_build(plan_build(specs), folder)
    stubbed_registry(folder)
    rows: dict[str, object] = {}
    decode_step_rows(rows, "cpu", torch.float16)
    return rows


def phase_calls() -> dict[str, tuple[object, object, dict]]:
    """Where the prefill module's entry point spends its host time, phase by phase (bert, the
    tiny shape, launches stubbed): name -> (call, module, attributes set on the module while
    it is timed). Rows marked "  " time one piece alone; the others the entry point with
    one piece switched off, so differences between rows are the pieces' shares."""
    bert = stubbed_generated_modules()["prefill bert_base"]
    q = torch.randn(1, HEADS, SEQLEN, DIM, dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    flash = [t.transpose(1, 2).contiguous() for t in (q, k, v, q)]
    recorded = []
    bert._launch, real = (lambda *args: recorded.append(args)), bert._launch
    try:
        bert.attention(q, k, v, return_lse=False)  # its full path: records the launch
        bert._CALL_PLANS.clear()
    finally:
        bert._launch = real
    block = (1, 1, bert.CONFIG["BLOCK_N"], DIM)
    no_plan = {"_call_key": lambda *args: None}
    return {
        "attention(), from its layout's plan": (lambda: bert.attention(q, k, v), bert, {}),
        "attention(), full path (plans off)": (lambda: bert.attention(q, k, v), bert, no_plan),
        "attention(), full path, TMA descriptors": (
            lambda: bert.attention(q, k, v),
            bert,
            {**no_plan, "POINTER_LOADS_UP_TO": 0},
        ),
        "  _call_key (a plan's lookup key)": (
            lambda: bert._call_key(q, k, v, None, None, False, None),
            bert,
            {},
        ),
        "  _tensors_ok (q, k, v checks)": (
            lambda: bert._tensors_ok(q, k, v, 4, 2, q.dtype, DIM, DIM),
            bert,
            {},
        ),
        "  output allocation (new_empty)": (lambda: q.new_empty(q.shape), bert, {}),
        "  _launch, cached (its key; run stubbed)": (lambda: real(*recorded[0]), bert, {}),
        "  TMA descriptors x2 (Python side)": (
            lambda: (bert._descriptor(k, block), bert._descriptor(v, block)),
            bert,
            {},
        ),
        "  flash-layout views (q, k, v, out)": (
            lambda: [t.transpose(1, 2) for t in flash],
            bert,
            {},
        ),
        "  ATTNGEN_CHECKS lookup (varlen, decode)": (
            lambda: os.environ.get("ATTNGEN_CHECKS"),
            bert,
            {},
        ),
    }


def time_patched(call, module, patches: dict, calls: int, repeat: int) -> float:
    """time_us(call) with `patches` set on the module meanwhile."""
    saved = {name: getattr(module, name) for name in patches}
    for name, value in patches.items():
        setattr(module, name, value)
    try:
        return time_us(call, calls, repeat)
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def time_us(call, calls: int, repeat: int) -> float:
    call()  # first call: imports and caches
    best = min(timeit.repeat(call, number=calls, repeat=repeat, timer=time.thread_time))
    return best / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, accepts_out in (("no out=", False), ("out=, attention_flash", True)):
            load_kernels(build_stub_folder(Path(tmp) / str(accepts_out), accepts_out), replace=True)
            results[label] = {}
            for name, call in public_calls().items():
                try:
                    results[label][name] = time_us(call, args.calls, args.repeat)
                except Exception as exc:  # one broken row must not hide the others
                    print(f"{label}: {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    results[label][name] = float("nan")
    results["generated modules"] = {}
    for name, call in {**generated_module_calls(), **training_steps()}.items():
        results["generated modules"][name] = time_us(call, args.calls, args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        results["decode steps"] = {
            name: call if isinstance(call, str) else time_us(call, args.calls, args.repeat)
            for name, call in decode_step_calls(Path(tmp)).items()
        }
    results["phases"] = {
        name: time_patched(call, module, patches, args.calls, args.repeat)
        for name, (call, module, patches) in phase_calls().items()
    }
    labels = list(results)
    print(f"Python overhead per call, us (torch {torch.__version__}, kernel stubbed out)")
    print(f"  {'call':42s}" + "".join(f"{label:>22s}" for label in labels[:2]))
    for name in results[labels[0]]:
        print(f"  {name:42s}" + "".join(f"{results[label][name]:22.1f}" for label in labels[:2]))
    print(
        "Generated modules, and the public functions over them, us per call (launch stubbed, "
        "cached launcher on)"
    )
    for name, value in results["generated modules"].items():
        print(f"  {name:42s}{value:20.1f}")
    print("Decode steps (Llama-3-8B heads, B 1, 64 of 4096 keys; fp16 stand-ins, launches stubbed)")
    for name, value in results["decode steps"].items():
        print(f"  {name:64s}{value:>8.1f}" if isinstance(value, float) else f"  {name}: {value}")
    print("The prefill module's entry point (bert), phase by phase, us per call")
    for name, value in results["phases"].items():
        print(f"  {name:42s}{value:20.1f}")


if __name__ == "__main__":
    main()
