"""Where one entry point's host time goes on the GPU host: the Python around its launches,
each launch's cost, and what Triton's launcher itself spends.

For each entry point (tiny shapes, as tools/host_overhead.py) it records the launches one
warm call makes, then times, in one process beside torch SDPA:

- the call as users make it;
- the call with every launch a no-op (the Python and allocations alone);
- each recorded launch replayed as the module makes it. A module whose direct launches go
  through `_runner` (the tensors' addresses, Triton 3.6's C launcher) is seen through a
  proxy around what `_runner` returns (installed before the first call: a Python frame per
  launch in every row of that module); a launch through `compiled.run(...)` with tensors
  (modules built before `_runner`) is seen at CudaLauncher.__call__ and replayed four ways:
  `compiled.run(...)` with the tensors (Triton's C launcher calls each tensor's data_ptr()
  and cuPointerGetAttribute on it), `compiled.run(...)` with the tensors' addresses as ints
  (the launcher takes an int as the pointer itself), the C launcher (`CudaLauncher.launch`)
  with ints (no Python frame of CudaLauncher.__call__ and its scratch closures), and the
  addresses alone (t.data_ptr() for each tensor);
- a cProfile of the call (own time per function).

Usage on the GPU machine:  PYTHONPATH=. python3 tools/profile_launch_host.py --out DIR
Writes DIR/profile_launch_host.json and DIR/profile_launch_host_cprofile.txt; a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.backends.nvidia.driver import CudaLauncher

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import _noop, host_us, module_for, profile_text  # noqa: E402

import attngen  # noqa: E402

_REAL_CALL = CudaLauncher.__call__
_MODE = [None]  # None: launch; "record": launch and record; "noop": skip every launch
_SEEN: list[tuple] = []  # ("runner", launch, args) or ("launcher", launcher, grid..., args)


def proxy_runners(module) -> None:
    """Route the launches of `module`'s direct path (its `_runner`'s launch functions)
    through _MODE, from the module's first launch on."""
    real_runner = getattr(module, "_runner", None)
    if real_runner is None:
        return  # a module built before _runner: its launches reach CudaLauncher.__call__

    def runner(compiled):
        launch, prefix = real_runner(compiled)

        def proxied(*args):
            mode = _MODE[0]
            if mode is None:
                return launch(*args)
            if mode == "noop":
                return None
            _SEEN.append(("runner", launch, args))
            return launch(*args)

        return proxied, prefix

    module._runner = runner


def _hooked_call(self, gx, gy, gz, stream, function, *args):
    mode = _MODE[0]
    if mode == "noop":
        return None
    if mode == "record":
        _SEEN.append(("launcher", self, gx, gy, gz, stream, function, args))
    return _REAL_CALL(self, gx, gy, gz, stream, function, *args)


CudaLauncher.__call__ = _hooked_call


def recorded_launches(call) -> list[tuple]:
    """The launches one call makes."""
    _SEEN.clear()
    _MODE[0] = "record"
    try:
        call()
    finally:
        _MODE[0] = None
    return list(_SEEN)


def without_launches(call):
    """call() with every compiled launch a no-op: the entry point's own host time."""

    def run():
        _MODE[0] = "noop"
        try:
            call()
        finally:
            _MODE[0] = None

    return run


def replayed(record: tuple) -> dict[str, object]:
    if record[0] == "runner":
        _, launch, args = record
        name = getattr(launch, "__qualname__", type(launch).__name__)
        return {
            "launch": name,
            "args": len(args),
            "as the module launches it": round(host_us(lambda: launch(*args)), 2),
        }
    return launch_variants(record[1:])


def launch_variants(record: tuple) -> dict[str, object]:
    launcher, gx, gy, gz, stream, function, args = record
    head, kernel_args = args[:4], args[4:]
    tensors = [a for a in kernel_args if isinstance(a, torch.Tensor)]
    as_ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in kernel_args)
    rows: dict[str, object] = {"tensor args": len(tensors), "args": len(kernel_args)}
    rows["compiled.run, tensors"] = round(
        host_us(lambda: launcher(gx, gy, gz, stream, function, *args)), 2
    )
    rows["compiled.run, addresses as ints"] = round(
        host_us(lambda: launcher(gx, gy, gz, stream, function, *head, *as_ints)), 2
    )
    scratch = launcher.global_scratch_size or launcher.profile_scratch_size
    if not scratch:
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        c_launch = launcher.launch
        rows["C launcher, addresses as ints"] = round(
            host_us(
                lambda: c_launch(
                    gx, gy, gz, stream, function, coop, pdl, None, None, *head, *as_ints
                )
            ),
            2,
        )
    rows["data_ptr() of each tensor"] = round(host_us(lambda: [t.data_ptr() for t in tensors]), 2)
    return rows


def entry_points() -> dict[str, object]:
    q = torch.randn(1, 12, 64, 64, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    bert = module_for("prefill", "bert_base")
    qwen = module_for("decode", "qwen2_5_7b")
    for module in (bert, qwen):
        proxy_runners(module)
    qd = torch.randn(1, 1, 28, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(1, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.full((1,), 64, dtype=torch.int32, device="cuda")
    heads_first = [t.transpose(1, 2) for t in (qd, kc, vc)]
    calls = {
        "module attention()": lambda: bert.attention(q, k, v),
        "attngen.flash_attn_func": lambda: attngen.flash_attn_func(qf, kf, vf),
        "module decode() (B1, L64)": lambda: qwen.decode(*heads_first, lens),
        "attngen.flash_attn_with_kvcache (B1, L64)": lambda: attngen.flash_attn_with_kvcache(
            qd, kc, vc, cache_seqlens=lens, causal=True
        ),
    }
    if hasattr(qwen, "decode_flash"):
        calls["module decode_flash() (B1, L64)"] = lambda: qwen.decode_flash(qd, kc, vc, lens)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    q = torch.randn(1, 12, 64, 64, device="cuda", dtype=torch.float16)
    x = torch.empty(16, device="cuda")
    anchors = {
        "torch sdpa (default dispatch)": round(
            host_us(lambda: F.scaled_dot_product_attention(q, q, q)), 2
        ),
        "bare triton launch (1 arg)": round(host_us(lambda: _noop[(1,)](x)), 2),
        "torch.empty (1, 28, 1, 128) bf16": round(
            host_us(lambda: torch.empty(1, 28, 1, 128, device="cuda", dtype=torch.bfloat16)), 2
        ),
    }
    results: dict[str, object] = {}
    profiles = []
    for name, call in entry_points().items():
        try:
            for _ in range(3):
                call()  # compiles, fills the plans
            row: dict[str, object] = {
                "call": round(host_us(call), 2),
                "launches no-op": round(host_us(without_launches(call)), 2),
            }
            row["launches"] = [replayed(r) for r in recorded_launches(call)]
            results[name] = row
            profiles.append(f"== {name}\n{profile_text(call)}")
        except Exception as exc:  # one broken row must not hide the others
            results[name] = f"error: {type(exc).__name__}: {exc}"
            traceback.print_exc()
    report = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "anchors_us": anchors,
        "entry_points_us": results,
    }
    (args.out / "profile_launch_host.json").write_text(json.dumps(report, indent=1))
    (args.out / "profile_launch_host_cprofile.txt").write_text("\n".join(profiles))
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    print(f"host us per call ({report['gpu']}, {versions})")
    for name, value in anchors.items():
        print(f"  {name:44s} {value}")
    for name, row in results.items():
        if not isinstance(row, dict):
            print(f"  {name:44s} {row}")
            continue
        print(f"  {name:44s} call {row['call']}, launches no-op {row['launches no-op']}")
        for i, launch in enumerate(row["launches"]):
            print(f"      launch {i}: {launch}")


if __name__ == "__main__":
    main()
