"""Shared memory of the backward kernels on every candidate, fast: Triton's stages up to LLVM IR
only (where its allocator fixes `shared`), without ptxas, so no registers or spills. For
sweeping allocator behaviour over whole grids (the dropout keep mask's conversion scratch,
attngen/tiling/dropout.py keep_mask_scratch); `attngen verify-tiling --backward` is the full
check. Writes one JSON record per config, which tests/test_verify_backward.py holds the model
to. With --forward, the forward (prefill) kernel's candidates instead, keyed as the forward's
compiler data (tests/test_verify_forward_dropout.py holds the forward model to them).

    python tools/backward_smem_sweep.py tools/verify_specs/backward_dropout.yaml \
        --arch sm80 --arch sm90 --out attngen/verify/data/backward_dropout_smem_triton-3.6.0.json
    python tools/backward_smem_sweep.py tools/verify_specs/forward_dropout_shapes.yaml \
        --forward --fraction 0.1 --arch sm80 --arch sm90 \
        --out attngen/verify/data/forward_dropout_smem_triton-3.6.0.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.build import load_specs  # noqa: E402
from attngen.spec import specs_from_data  # noqa: E402
from attngen.tiling.backward import KERNELS, derive_backward_tiles  # noqa: E402
from attngen.tiling.prefill import derive_tiles  # noqa: E402
from attngen.verify.measurements import backward_key, measurement_key, triton_version  # noqa: E402


def shared_bytes(payload: tuple[dict, str, str | None, tuple[int, int, int, int]]) -> int | str:
    """metadata['shared'] after the llir stage, or the error's first line (kernel None: the
    forward kernel)."""
    data, arch, kernel, config_values = payload
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from attngen.arch import ARCHS
    from attngen.tiling.prefill import TileConfig
    from attngen.verify import compiler

    (spec,) = specs_from_data(data)
    config = TileConfig(*config_values)
    try:
        with compiler._compiled_not_interpreted():
            source = compiler.kernel_source(
                spec,
                compiler.load_kernel(spec, arch, kernel=kernel),
                config,
                backward=kernel is not None,
            )
            target = GPUTarget("cuda", ARCHS[arch].compute_capability, 32)
            backend = make_backend(target)
            options = backend.parse_options(
                {
                    "num_warps": config.num_warps,
                    "num_stages": config.num_stages,
                    "enable_fp_fusion": compiler.fp_fusion(spec),
                }
            )
            stages: dict = {}
            backend.add_stages(stages, options, source.language)
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            module = source.make_ir(
                target,
                options,
                backend.get_codegen_implementation(options),
                backend.get_module_map(),
                context,
            )
            metadata = {"hash": "sweep", "target": target, **options.__dict__}
            for ext, stage in stages.items():
                module = stage(module, metadata)
                if ext == "llir":
                    return int(metadata["shared"])
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return "no llir stage"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--arch", action="append", required=True)
    parser.add_argument(
        "--fraction",
        type=float,
        default=1.0,
        help="a seeded random share of the candidates (default all)",
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--forward",
        action="store_true",
        help="the forward kernel's candidates (MeasurementKey records)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    todo: list = []
    for spec in load_specs([Path(args.spec)]):
        for arch in args.arch:
            if args.forward:
                keys = [
                    measurement_key(spec, arch, cand.config)
                    for cand in derive_tiles(spec, arch).candidates
                ]
            else:
                derivation = derive_backward_tiles(spec, arch)
                keys = [
                    backward_key(spec, arch, kernel, cand.config)
                    for kernel in KERNELS
                    for cand in getattr(derivation, kernel).candidates
                ]
            todo += [
                (key, spec) for key in keys if random.Random(str(key)).random() < args.fraction
            ]
    payload = [
        (
            spec.model_dump(mode="json"),
            key.arch,
            getattr(key, "kernel", None),
            (key.BLOCK_M, key.BLOCK_N, key.num_warps, key.num_stages),
        )
        for key, spec in todo
    ]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        os.environ.pop("TRITON_INTERPRET", None)
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.map(shared_bytes, payload, chunksize=4)
    rows = [
        json.dumps({**key._asdict(), "shared": shared})
        for (key, _), shared in zip(todo, results, strict=True)
    ]
    args.out.write_text(
        f'{{"triton": "{triton_version()}", "records": [\n' + ",\n".join(sorted(rows)) + "\n]}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
