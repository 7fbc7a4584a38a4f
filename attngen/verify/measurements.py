"""The committed compiler measurements of the prefill kernel, keyed by what matters: one JSON
file per Triton version, data/prefill_compile_triton-<version>.json. (The decode kernel's
chosen configs are measured by tools/decode_compile_check.py into
data/decode_compile_triton-<version>.json; the backward kernels' candidates, keyed by
BackwardKey, into data/backward_compile_triton-<version>.json.)

What Triton allocates for attngen's prefill kernel depends on the target, the dtype, the padded
head dims, the launch config and how K/V rows are read (attngen/tiling/rows.py: `tma`, tensor
descriptors on Hopper, which rows that are not a multiple of 16 bytes cannot use; `aligned`,
rows of 16-element multiples, which pointer loads read vectorized and pipelined, and others
element by element) and whether dropout is compiled in (its keep mask's layout conversions
take shared memory), and on nothing else the spec says: mask, window, softcap, ALiBi and the
head counts change no shared memory (checked on the 584 configs this model was fitted to, and
re-checked by `attngen verify-tiling --recompile`). So a measurement is keyed by (arch, dtype,
D, DV, BLOCK_M, BLOCK_N, num_warps, num_stages, tma, aligned, dropout) and serves every spec
with that key; a record states `dropout` only when it is true (the records from before the key
had it read as false). Registers
and spills do vary a little with the mask code; each record names the spec it was compiled from
(its canonical fields are in the file), so it can be recompiled exactly.

The file is written one record per line in a fixed order, so a regeneration diffs cleanly.
Reading it needs neither torch nor triton.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

from attngen.arch import ARCHS
from attngen.host import template_hash
from attngen.render import TEMPLATE_FOR_KIND
from attngen.spec import AttnSpec, KernelKind, specs_from_data
from attngen.spec.files import write_if_different
from attngen.tiling.code_paths import code_paths
from attngen.tiling.prefill import TileConfig, padded_head_dim
from attngen.tiling.rows import rows_aligned

DATA_DIR = Path(__file__).with_name("data")
SCHEMA = 1


def triton_version() -> str:
    """The installed Triton's version, read from package metadata (no import of triton)."""
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "none"


class MeasurementKey(NamedTuple):
    arch: str
    dtype: str
    D: int
    DV: int
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    tma: bool  # K/V through tensor descriptors (code_paths); pointer loads otherwise
    aligned: bool  # rows of 16-element multiples (tiling.rows.rows_aligned)
    dropout: bool = False  # the spec's `dropout: true`: the kernel draws the keep mask

    @property
    def config(self) -> TileConfig:
        return TileConfig(self.BLOCK_M, self.BLOCK_N, self.num_warps, self.num_stages)

    def label(self) -> str:
        loads = " pointer loads" if not self.tma and usual_tma(self.arch, self.dtype) else ""
        rows = "" if self.aligned else " unaligned rows"
        drop = " dropout" if self.dropout else ""
        return (
            f"{self.arch} {self.dtype} D{self.D}/{self.DV} {self.BLOCK_M}x{self.BLOCK_N} "
            f"w{self.num_warps} s{self.num_stages}{loads}{rows}{drop}"
        )

    def job(self, spec: AttnSpec) -> tuple[AttnSpec, str, TileConfig]:
        """The compile of this key from `spec` (attngen.verify.compiler's Job)."""
        return spec, self.arch, self.config

    def expected_mma(self) -> str:
        """The instruction family the model's branch assumes (smem_expression in
        tiling/prefill_model.py)."""
        if self.dtype == "fp32":
            return "fma"
        return "wgmma" if ARCHS[self.arch].has_wgmma and self.BLOCK_M >= 64 else "mma.sync"


class BackwardKey(NamedTuple):
    """A backward kernel's measurement: what its shared memory depends on. Like
    MeasurementKey, with the kernel ("dq" or "dkdv") and whether dropout is compiled in; no
    TMA (the gradient kernels load through pointers)."""

    arch: str
    kernel: str
    dtype: str
    D: int
    DV: int
    dropout: bool
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    aligned: bool

    @property
    def config(self) -> TileConfig:
        return TileConfig(self.BLOCK_M, self.BLOCK_N, self.num_warps, self.num_stages)

    def label(self) -> str:
        extras = (" dropout" if self.dropout else "") + ("" if self.aligned else " unaligned rows")
        return (
            f"{self.arch} {self.kernel} {self.dtype} D{self.D}/{self.DV} "
            f"{self.BLOCK_M}x{self.BLOCK_N} w{self.num_warps} s{self.num_stages}{extras}"
        )

    def job(self, spec: AttnSpec) -> tuple[AttnSpec, str, TileConfig, str]:
        return spec, self.arch, self.config, self.kernel

    def expected_mma(self) -> str:
        """wgmma where the kernel's score tile is at least 64 rows tall (dQ: BLOCK_M; dK/dV,
        whose tiles are transposed: BLOCK_N); tiling.backward's branches."""
        if self.dtype == "fp32":
            return "fma"
        rows = self.BLOCK_M if self.kernel == "dq" else self.BLOCK_N
        return "wgmma" if ARCHS[self.arch].has_wgmma and rows >= 64 else "mma.sync"


AnyKey = MeasurementKey | BackwardKey


def measurement_key(spec: AttnSpec, arch: str, config: TileConfig) -> MeasurementKey:
    tma = code_paths(spec, arch, KernelKind.prefill).tma
    dims, tile = _padded_dims(spec), _tile(config)
    return MeasurementKey(
        arch, spec.dtype.value, *dims, *tile, tma, rows_aligned(spec), spec.dropout
    )


def backward_key(spec: AttnSpec, arch: str, kernel: str, config: TileConfig) -> BackwardKey:
    dims, tile = _padded_dims(spec), _tile(config)
    return BackwardKey(
        arch, kernel, spec.dtype.value, *dims, spec.dropout, *tile, rows_aligned(spec)
    )


def _padded_dims(spec: AttnSpec) -> tuple[int, int]:
    return padded_head_dim(spec.head_dim), padded_head_dim(spec.value_head_dim)


def _tile(config: TileConfig) -> tuple[int, int, int, int]:
    return config.block_m, config.block_n, config.num_warps, config.num_stages


def usual_tma(arch: str, dtype: str) -> bool:
    """Whether a prefill kernel of this arch and dtype loads K/V through TMA when its head
    dims allow it (what records written before the key had `tma` were compiled with)."""
    return arch in ARCHS and ARCHS[arch].has_tma and dtype != "fp32"


def spec_ref(spec: AttnSpec) -> str:
    """Name and hash: two specs of one name but different fields never share an entry."""
    return f"{spec.name}-{spec.spec_hash()[:8]}"


def data_path(version: str, backward: bool = False) -> Path:
    """The measurements file of a Triton version (`data_path(triton_version())`: the installed
    one's), of the forward (prefill) kernel or, with `backward`, of the gradient kernels."""
    return DATA_DIR / f"{'backward' if backward else 'prefill'}_compile_triton-{version}.json"


@dataclass
class Measurements:
    """Measurements by key, and the specs they were compiled from (name -> spec fields).
    `key_type`: MeasurementKey (the forward's file) or BackwardKey."""

    triton: str
    template_hash: str
    records: dict[Any, dict[str, Any]] = field(default_factory=dict)
    specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    key_type: type[AnyKey] = MeasurementKey

    def get(self, key: AnyKey) -> dict[str, Any] | None:
        return self.records.get(key)

    def spec_of(self, key: AnyKey) -> AttnSpec:
        """The spec a record was compiled from, to compile it again."""
        (spec,) = specs_from_data(self.specs[self.records[key]["spec"]])
        return spec

    def add(self, key: AnyKey, spec: AttnSpec, measured: dict[str, Any]) -> None:
        self.specs.setdefault(spec_ref(spec), spec.canonical())
        self.records[key] = {**key._asdict(), "spec": spec_ref(spec), **measured}

    def line(self, key: AnyKey) -> str:
        """A record as the file writes it: a forward record without dropout leaves the field
        out (so the records from before the key had it are written as they were)."""
        record = self.records[key]
        if isinstance(key, MeasurementKey) and not key.dropout:
            record = {name: value for name, value in record.items() if name != "dropout"}
        return json.dumps(record)

    def dumps(self) -> str:
        used = {record["spec"] for record in self.records.values()}
        lines = [
            "{",
            f'"schema": {SCHEMA},',
            f'"triton": {json.dumps(self.triton)},',
            f'"template_hash": {json.dumps(self.template_hash)},',
            f'"key": {json.dumps(list(self.key_type._fields))},',
            '"specs": {',
            ",\n".join(
                f"{json.dumps(name)}: {json.dumps(self.specs[name], sort_keys=True)}"
                for name in sorted(used)
            ),
            "},",
            '"records": [',
            ",\n".join(self.line(key) for key in sorted(self.records, key=_order)),
            "]",
            "}",
        ]
        return "\n".join(lines) + "\n"


def _order(key: AnyKey) -> tuple[Any, ...]:
    """Records in the arch table's order, then by dtype, dims and config."""
    rank = list(ARCHS).index(key.arch) if key.arch in ARCHS else len(ARCHS)
    return (rank, *key)


def current_template_hash() -> str:
    """The hash of the templates a compile renders now (prefill's and the partials): a data
    file records the one its records were compiled from."""
    return template_hash(TEMPLATE_FOR_KIND[KernelKind.prefill])


def save_measurements(data: Measurements, path: Path) -> bool:
    """Write `data` to `path` (atomically; False when the file already held it), stamped with
    the current templates' hash (what its live compiles rendered)."""
    data.template_hash = current_template_hash()
    return write_if_different(path, data.dumps())


def load_measurements(path: Path, key_type: type[AnyKey] = MeasurementKey) -> Measurements:
    """Read a data file of `key_type` records; a missing file reads as empty data for the
    version in its name."""
    if not path.is_file():
        version = path.stem.split("_compile_triton-")[-1]
        return Measurements(triton=version, template_hash="", key_type=key_type)
    raw = json.loads(path.read_text(encoding="utf-8"))
    if raw.get("schema") != SCHEMA:
        raise ValueError(f"{path}: measurements schema {raw.get('schema')!r}, expected {SCHEMA}")
    fields = key_type._fields
    if not set(raw.get("key", ())) <= set(fields):
        raise ValueError(f"{path}: records keyed by {raw['key']}, expected {list(fields)}")
    for record in raw["records"]:  # a file written before the key had `tma` and `aligned`
        if key_type is MeasurementKey:
            record.setdefault("tma", usual_tma(record["arch"], record["dtype"]))
            record.setdefault("dropout", False)
        spec = raw["specs"][record["spec"]]
        record.setdefault("aligned", spec["head_dim"] % 16 == 0 and spec["head_dim_v"] % 16 == 0)
    records = {key_type(*(r[name] for name in fields)): r for r in raw["records"]}
    return Measurements(raw["triton"], raw["template_hash"], records, dict(raw["specs"]), key_type)
