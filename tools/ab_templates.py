"""A kernel change measured against the kernel before it, in one process on one GPU.

Builds each cell's sm90 prefill module twice, from the package's templates (A) and from the
same templates with the files of `--alt DIR` in their place (B), imports both module files
directly (no registry: B's header hash names templates the package does not have) and times
the module's own entry points alternately, A then B, with triton's do_bench: the forward
(`attention`) and, for a spec with backward: true, the backward alone (`attention_backward`,
deterministic=False, or True with --deterministic). Inputs are [B, H, N, D] bf16 (contiguous,
or with --heads-last views of [B, N, H, D] memory as flash_attn_func's), B = 16384 / N,
H = 2048 / D (the FlashAttention grid's shapes). Each cell also records the largest
difference between A's and B's outputs and gradients, and each module's forward_path() /
backward_path().

    PYTHONPATH=. python tools/ab_templates.py --alt DIR --out OUT [--d 64 128] [--n 4096]
        [--causal 0 1] [--backward] [--deterministic] [--heads-last] [--short-causal A B]
        [--softcap C]
        [--b-gluon NAME=INT,...]  (B: the package's templates with these Gluon forward knobs)
        [--enqueue]  (also each call's host time from a synchronised start, microseconds)

Writes OUT/ab_templates.json and prints one line per cell (B's time over A's: < 1 is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

import jinja2
import torch
import triton

import attngen.render.template_env as template_env
from attngen.build import plan_build, write_build
from attngen.spec import KernelKind
from attngen.tuning.database import TUNING_SCHEMA, entry_key, render_tuning_file, tuning_path
from tests.kernel_harness import make_spec


def _alt_environment(alt: Path) -> jinja2.Environment:
    loader = jinja2.ChoiceLoader(
        [jinja2.FileSystemLoader(str(alt)), jinja2.PackageLoader("attngen", "templates")]
    )
    return jinja2.Environment(
        loader=loader, undefined=jinja2.StrictUndefined, **template_env.OPTIONS
    )


def _gluon_tuning(spec, folder: Path, knobs: dict[str, int]) -> Path:
    """A tuning folder whose sm90 file gives the spec's prefill module these Gluon forward
    knobs (the build renders them where they are a feasible candidate)."""
    key = entry_key(spec, KernelKind.prefill)
    record = {"config": knobs, "gpu": "ab_templates --b-gluon", "date": "-", "complete": True}
    data = {"schema": TUNING_SCHEMA, "arch": "sm90", "entries": {key: {"gluon": record}}}
    folder.mkdir(parents=True, exist_ok=True)
    tuning_path(folder, "sm90").write_text(render_tuning_file(data))
    return folder


def _build(spec, folder: Path, alt: Path | None, knobs: dict[str, int] | None = None):
    saved = template_env._environment
    if alt is not None:
        template_env._environment = cache(lambda: _alt_environment(alt))
    try:
        tuning = (
            _gluon_tuning(spec, folder.with_name(folder.name + "_tuning"), knobs) if knobs else None
        )
        write_build(plan_build([spec], tuning), folder)
    finally:
        template_env._environment = saved
    (path,) = [p for p in folder.rglob("sm90/*.py")]
    module_spec = importlib.util.spec_from_file_location(f"ab_{folder.name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _cell(d: int, n: int, causal: bool, args: argparse.Namespace) -> dict:
    backward, reps, deterministic, heads_last = (args.backward, args.reps, args.deterministic,
                                                 args.heads_last)  # fmt: skip
    batch, heads = max(1, 16384 // n), 2048 // d
    mask = "causal" if causal else "none"
    spec = make_spec(name=f"ab_d{d}", head_dim=d, num_q_heads=heads, num_kv_heads=heads,
                     mask=mask, backward=backward, dtype="bf16", softcap=args.softcap)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        modules = {"A": _build(spec, Path(tmp) / "a", None),
                   "B": _build(spec, Path(tmp) / "b", args.alt and args.alt.resolve(),
                               args.b_gluon)}  # fmt: skip
        for module, keys in zip(modules.values(), args.short_causal or (), strict=False):
            module.GLUON_BWD_SHORT_CAUSAL_KEYS = keys  # the Gluon kernel's causal threshold
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (batch, n, heads, d) if heads_last else (batch, heads, n, d)
        q, k, v, dout = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))  # fmt: skip
        if heads_last:  # flash_attn_func's [B, N, H, D] memory, seen as [B, H, N, D]
            q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
        cell: dict = {"D": d, "N": n, "B": batch, "H": heads, "causal": causal}
        flops = 4 * batch * heads * n * n * d * (0.5 if causal else 1)
        results = {}
        for name, module in modules.items():
            out, lse = module.attention(q, k, v, return_lse=True)
            grads = (
                module.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic)
                if backward
                else ()
            )
            results[name] = (out, *grads)
            cell[f"{name}_gluon"] = getattr(module, "GLUON_CONFIG", None)
            backward_path = getattr(module, "backward_path", lambda: "tile-level")  # no Gluon's
            cell[f"{name}_paths"] = [module.forward_path(), backward_path()][: 1 + backward]
        pairs = zip(results["A"], results["B"], strict=True)
        cell["max_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        del results
        for phase in ("forward", "backward") if backward else ("forward",):
            times, last_fns = {}, {}
            for _ in range(2):  # A, B, A, B: the best of two each
                for name, module in modules.items():
                    if phase == "forward":
                        fn = lambda m=module: m.attention(q, k, v, return_lse=True)  # noqa: E731
                    else:
                        out, lse = module.attention(q, k, v, return_lse=True)
                        fn = lambda m=module, o=out, s=lse: m.attention_backward(  # noqa: E731
                            dout, q, k, v, o, s, deterministic=deterministic
                        )
                    last_fns[name] = fn
                    ms = triton.testing.do_bench(fn, rep=reps)
                    times[name] = min(times.get(name, ms), ms)
            scale = 2.5 if phase == "backward" else 1.0
            cell[phase] = {name: {"ms": round(ms, 4), "tflops": round(scale * flops / ms / 1e9, 1)}
                           for name, ms in times.items()}  # fmt: skip
            cell[phase]["B/A"] = round(times["B"] / times["A"], 4)
            if args.enqueue:
                for name, fn in last_fns.items():
                    cell[phase][name]["enqueue_us"] = enqueue_us(fn)
        torch.cuda.empty_cache()
    return cell


def enqueue_us(fn, calls: int = 20) -> float:
    """Host time a call from a synchronised start: the enqueue the GPU waits behind when its
    work is shorter (the best of three runs of `calls` back-to-back calls)."""
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    torch.cuda.synchronize()
    return round(best / calls * 1e6, 1)


def _knobs(text: str) -> dict[str, int]:
    try:
        return {name: int(value) for name, value in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=INT,... got {text!r}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alt", type=Path, help="B's templates: this folder's files first")
    parser.add_argument("--b-gluon", type=_knobs, metavar="NAME=INT,...",
                        help="B's Gluon forward knobs, e.g. NUM_CONSUMERS=3,BLOCK_M=64,"
                        "BLOCK_N=128,STAGES=2 (a tuning record the build renders where it "
                        "is a feasible candidate)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--n", type=int, nargs="+", default=[4096])
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--reps", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--deterministic", action="store_true", help="the backward's")
    parser.add_argument("--softcap", type=float, default=0.0, help="the spec's softcap")
    parser.add_argument("--enqueue", action="store_true", help="also each call's host time")
    parser.add_argument("--heads-last", action="store_true", help="[B, N, H, D] memory")
    short_help = "each module's GLUON_BWD_SHORT_CAUSAL_KEYS (0: the Gluon kernel always)"
    parser.add_argument("--short-causal", type=int, nargs=2, metavar=("A", "B"), help=short_help)
    args = parser.parse_args(argv)
    if args.alt is None and args.b_gluon is None:
        parser.error("B needs --alt or --b-gluon")
    args.out.mkdir(parents=True, exist_ok=True)
    cells = []
    for d in args.d:
        for n in args.n:
            for causal in args.causal:
                try:
                    cell = _cell(d, n, bool(causal), args)
                except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                    cell = {
                        "D": d,
                        "N": n,
                        "causal": bool(causal),
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    }
                cells.append(cell)
                (args.out / "ab_templates.json").write_text(json.dumps(cells, indent=1))
                line = {k: v for k, v in cell.items() if k[1:] not in ("_paths", "_gluon")}
                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
