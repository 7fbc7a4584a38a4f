"""Cross-compile every example's chosen decode config on its archs (no GPU) and record what
Triton allocates: attngen/verify/data/decode_compile_triton-<version>.json, which
tests/test_decode_tiling.py holds the decode tiling model to (`--check` compares instead).

    PYTHONPATH=. python tools/decode_compile_check.py [--check | --add]

--add compiles only the (kernel, arch) pairs the data file has no row for (a new example)
and keeps every recorded row as it is. An absorbed MLA decode (attngen/tiling/decode_latent.py)
has two rows per arch: "v_from_k" true (its latent cache, CONFIG) and false (a v_cache of its
own, SEPARATE_V_CONFIG).
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
from attngen.tiling.decode import derive_decode_tiles, latent_rope_split  # noqa: E402
from attngen.tiling.decode_latent import derive_latent_tiles  # noqa: E402
from attngen.verify.measurements import triton_version  # noqa: E402

FIELDS = ("shared", "regs", "spill_stores", "mma", "error")


def data_path(version: str) -> Path:
    return ROOT / "attngen" / "verify" / "data" / f"decode_compile_triton-{version}.json"


def jobs():
    """(spec, arch, config, v_from_k): v_from_k None for the usual decode kernel; an absorbed
    MLA decode compiles its latent cache's path (True, CONFIG) and a v_cache of its own's
    (False, SEPARATE_V_CONFIG)."""
    specs = [
        s
        for s in load_specs(sorted((ROOT / "examples").glob("*.yaml")))
        if KernelKind.decode in s.kernels
    ]
    out = []
    for spec in specs:
        for arch in spec.archs:
            if latent_rope_split(spec):
                for v_from_k in (True, False):
                    config = derive_latent_tiles(spec, arch, v_from_k).chosen
                    out.append((spec, arch, config, v_from_k))
            else:
                out.append((spec, arch, derive_decode_tiles(spec, arch).chosen, None))
    return out


def row_key(kernel_hash: str, arch: str, v_from_k: bool | None) -> tuple:
    return (kernel_hash, arch, v_from_k)


def measure(skip: frozenset[tuple] = frozenset()) -> list[dict]:
    """Rows for every job whose row_key is not in `skip`."""
    from attngen.verify.compiler import SEPARATE_V, compile_many

    todo = [
        (spec, arch, config, v_from_k)
        for spec, arch, config, v_from_k in jobs()
        if row_key(spec.kernel_hash(KernelKind.decode), arch, v_from_k) not in skip
    ]
    compiled = [
        (spec, arch, config) if v_from_k in (None, True) else (spec, arch, config, SEPARATE_V)
        for spec, arch, config, v_from_k in todo
    ]
    records = compile_many(compiled, processes=2, kind=KernelKind.decode)
    rows = []
    for (spec, arch, config, v_from_k), record in zip(todo, records, strict=True):
        rows.append(
            {
                "spec": spec.name,
                "kernel_hash": spec.kernel_hash(KernelKind.decode),
                "arch": arch,
                **({} if v_from_k is None else {"v_from_k": v_from_k}),
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
        known = frozenset(row_key(r["kernel_hash"], r["arch"], r.get("v_from_k")) for r in recorded)
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
