"""Cross-compile every example's chosen decode config on its archs (no GPU) and record what
Triton allocates: attngen/verify/data/decode_compile_triton-<version>.json, which
tests/test_decode_tiling.py holds the decode tiling model to (`--check` compares instead).

    PYTHONPATH=. python tools/decode_compile_check.py [--check | --add]

--add compiles only the (kernel, arch) pairs the data file has no row for (a new example)
and keeps every recorded row as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.build import load_specs  # noqa: E402
from attngen.spec import KernelKind  # noqa: E402
from attngen.tiling.decode import derive_decode_tiles  # noqa: E402
from attngen.verify.measurements import triton_version  # noqa: E402

FIELDS = ("shared", "regs", "spill_stores", "mma", "error")


def data_path(version: str) -> Path:
    return ROOT / "attngen" / "verify" / "data" / f"decode_compile_triton-{version}.json"


def jobs():
    specs = [
        s
        for s in load_specs(sorted((ROOT / "examples").glob("*.yaml")))
        if KernelKind.decode in s.kernels
    ]
    return [
        (spec, arch, derive_decode_tiles(spec, arch).chosen)
        for spec in specs
        for arch in spec.archs
    ]


def measure(skip: frozenset[tuple[str, str]] = frozenset()) -> list[dict]:
    """Rows for every job whose (kernel hash, arch) is not in `skip`."""
    from attngen.verify.compiler import compile_many

    todo = [
        (spec, arch, config)
        for spec, arch, config in jobs()
        if (spec.kernel_hash(KernelKind.decode), arch) not in skip
    ]
    records = compile_many(todo, processes=2, kind=KernelKind.decode)
    rows = []
    for (spec, arch, config), record in zip(todo, records, strict=True):
        rows.append(
            {
                "spec": spec.name,
                "kernel_hash": spec.kernel_hash(KernelKind.decode),
                "arch": arch,
                "config": config.as_dict(),
                **{f: record[f] for f in FIELDS},
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the data file")
    parser.add_argument(
        "--add", action="store_true", help="compile only kernels the data file has no row for"
    )
    args = parser.parse_args()
    path = data_path(triton_version())
    if args.add:
        recorded = json.loads(path.read_text())["rows"]
        known = frozenset((r["kernel_hash"], r["arch"]) for r in recorded)
        rows = recorded + measure(known)
    else:
        rows = measure()
    text = json.dumps({"triton": triton_version(), "rows": rows}, indent=1) + "\n"
    if args.check:
        recorded = json.loads(path.read_text())["rows"]
        same = recorded == rows
        print("decode compile data is current" if same else "decode compile data differs")
        return 0 if same else 1
    path.write_text(text)
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
