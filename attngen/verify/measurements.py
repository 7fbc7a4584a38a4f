"""The committed compiler measurements: one JSON file per Triton version, keyed by what matters.

What Triton allocates for attngen's prefill kernel depends on the target, the dtype, the padded
head dims and the launch config, and on nothing else the spec says: mask, window, softcap,
ALiBi and the head counts change no shared memory (checked on the 584 configs this model was
fitted to, and re-checked by `attngen verify-tiling --recompile`). So a measurement is keyed by
(arch, dtype, D, DV, BLOCK_M, BLOCK_N, num_warps, num_stages) and serves every spec with that
key. Registers and spills do vary a little with the mask code; each record names the spec it
was compiled from (its canonical fields are in the file), so it can be recompiled exactly.

The file is written one record per line in a fixed order, so a regeneration diffs cleanly.
Reading it needs neither torch nor triton.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from attngen.arch import ARCHS
from attngen.spec import AttnSpec, specs_from_data
from attngen.tiling.prefill import TileConfig, padded_head_dim

DATA_DIR = Path(__file__).with_name("data")
SCHEMA = 1


class OracleKey(NamedTuple):
    arch: str
    dtype: str
    D: int
    DV: int
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int

    @property
    def config(self) -> TileConfig:
        return TileConfig(self.BLOCK_M, self.BLOCK_N, self.num_warps, self.num_stages)

    def label(self) -> str:
        return (f"{self.arch} {self.dtype} D{self.D}/{self.DV} "
                f"{self.BLOCK_M}x{self.BLOCK_N} w{self.num_warps} s{self.num_stages}")


def oracle_key(spec: AttnSpec, arch: str, config: TileConfig) -> OracleKey:
    return OracleKey(arch, spec.dtype.value, padded_head_dim(spec.head_dim),
                     padded_head_dim(spec.value_head_dim), config.block_m, config.block_n,
                     config.num_warps, config.num_stages)


def spec_ref(spec: AttnSpec) -> str:
    """Name and hash: two specs of one name but different fields never share an entry."""
    return f"{spec.name}-{spec.spec_hash()[:8]}"


def data_path(version: str) -> Path:
    return DATA_DIR / f"prefill_compile_triton-{version}.json"


@dataclass
class OracleData:
    """Measurements by key, and the specs they were compiled from (name -> spec fields)."""

    triton: str
    template_hash: str
    records: dict[OracleKey, dict[str, Any]] = field(default_factory=dict)
    specs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def get(self, key: OracleKey) -> dict[str, Any] | None:
        return self.records.get(key)

    def spec_of(self, key: OracleKey) -> AttnSpec:
        """The spec a record was compiled from, to compile it again."""
        (spec,) = specs_from_data(self.specs[self.records[key]["spec"]])
        return spec

    def add(self, key: OracleKey, spec: AttnSpec, measured: dict[str, Any]) -> None:
        self.specs.setdefault(spec_ref(spec), spec.canonical())
        self.records[key] = {**key._asdict(), "spec": spec_ref(spec), **measured}

    def dumps(self) -> str:
        used = {record["spec"] for record in self.records.values()}
        lines = [
            "{",
            f'"schema": {SCHEMA},',
            f'"triton": {json.dumps(self.triton)},',
            f'"template_hash": {json.dumps(self.template_hash)},',
            f'"key": {json.dumps(list(OracleKey._fields))},',
            '"specs": {',
            ",\n".join(f"{json.dumps(name)}: {json.dumps(self.specs[name], sort_keys=True)}"
                       for name in sorted(used)),
            "},",
            '"records": [',
            ",\n".join(json.dumps(self.records[key]) for key in sorted(self.records, key=_order)),
            "]",
            "}",
        ]
        return "\n".join(lines) + "\n"


def _order(key: OracleKey) -> tuple[Any, ...]:
    """Records in the arch table's order, then by dtype, dims and config."""
    rank = list(ARCHS).index(key.arch) if key.arch in ARCHS else len(ARCHS)
    return (rank, *key)


def load_oracle_data(path: Path) -> OracleData:
    """Read a data file; a missing file reads as empty data for the version in its name."""
    if not path.is_file():
        version = path.stem.removeprefix("prefill_compile_triton-")
        return OracleData(triton=version, template_hash="")
    raw = json.loads(path.read_text(encoding="utf-8"))
    if raw.get("schema") != SCHEMA:
        raise ValueError(f"{path}: oracle data schema {raw.get('schema')!r}, expected {SCHEMA}")
    records = {OracleKey(*(r[name] for name in OracleKey._fields)): r for r in raw["records"]}
    return OracleData(raw["triton"], raw["template_hash"], records, dict(raw["specs"]))
