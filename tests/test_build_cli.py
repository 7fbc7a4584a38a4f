"""`attngen build / check / explain`: outputs, idempotence, errors, concurrency, import hygiene.

Most cases run the typer app in-process (CliRunner); a few run the installed `attngen` entry
point in real processes to see real exit codes, stderr and concurrent writers.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attngen.arch import arch_names
from attngen.build import INDEX_NAME, load_specs, stale_paths
from attngen.cli import app
from attngen.spec import KernelKind, module_name
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.prefill import derive_tiles
from attngen.tuning.database import apply_tuning, lookup

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GENERATED = ROOT / "generated"
# generated/ is built with the committed tuning database, as `attngen build` does by default.
TUNING = ROOT / "tuning" if (ROOT / "tuning").is_dir() else None
ALLOWED_IMPORTS = {
    "contextlib",
    "math",
    "os",
    "torch",
    "triton",
    "triton.language",
    "triton.language.extra",
    "triton.tools.tensor_descriptor",
    # sm90 modules whose forward is the warp-specialized Gluon kernel (Triton's own package),
    # and the per-thread record of which forward ran
    "threading",
    "triton.experimental",
    "triton.experimental.gluon",
    "triton.experimental.gluon.language.nvidia.hopper",
    "triton.experimental.gluon.nvidia.hopper",
}
BAD_SPEC = """\
name: bad
archs: [sm80]
dtype: bf16
head_dim: 300
num_q_heads: 8
num_kv_heads: 8
mask: none
kernels: [prefill]
"""

runner = CliRunner()


def _cli(*args: str | Path):
    return runner.invoke(app, [str(a) for a in args])


def _entry_point() -> list[str]:
    beside = Path(sys.executable).parent / "attngen"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("attngen")
    # The README's install puts the entry point on PATH; its absence is a broken install.
    assert found is not None, "the attngen entry point is not installed (pip install -e .)"
    return [found]


def _run(*args: str | Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*_entry_point(), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def _expected_paths(spec_paths) -> set[str]:
    return {
        f"{arch}/{module_name(spec, kind)}.py"
        for spec in load_specs(spec_paths)
        for kind in spec.kernels
        for arch in spec.archs
    }


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _modules(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*.py")}


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("built") / "out"
    result = _cli("build", *EXAMPLES, "--out", out)
    assert result.exit_code == 0, result.output
    assert "file(s) written to" in result.stdout
    return out


# ---------------------------------------------------------------------------------- build


def test_build_writes_every_kernel_and_arch(built: Path) -> None:
    expected = _expected_paths(EXAMPLES)
    # 9 specs (gemma2 has two) on two archs, llama3 on four; llama3, qwen2.5, mistral and
    # both gemma2 variants also have the varlen and decode kinds; gpt-oss-20b and
    # Llama-4-Scout (two variants each, three kinds) and DeepSeek-V3 (mla: prefill and
    # varlen, absorbed: decode) on two archs
    assert len(expected) == 20 + 12 + 12 + 24 + 6
    assert _modules(built) == expected
    assert {p.name for p in built.iterdir() if p.is_dir()} <= set(arch_names())
    assert not list(built.rglob("*.tmp")), "temporary files left behind"


def test_index_lists_every_module(built: Path) -> None:
    index = _index(built)
    assert index["schema"] == 1 and index["attngen_version"]
    entries = index["modules"]
    assert [e["path"] for e in entries] == sorted(_expected_paths(EXAMPLES))
    specs = {spec.name: spec for spec in load_specs(EXAMPLES)}
    for entry in entries:
        assert {"module", "path", "arch", "kind", "spec", "spec_hash", "config"} <= set(entry)
        spec = specs[entry["spec"]["name"]]
        assert entry["spec"] == spec.canonical()
        assert entry["spec_hash"] == spec.spec_hash()
        kind = KernelKind(entry["kind"])
        assert kind in spec.kernels
        assert entry["path"] == f"{entry['arch']}/{entry['module']}.py"
        assert entry["module"] == module_name(spec, kind)
        assert entry["arch"] in spec.archs
        tuned = lookup(TUNING, spec, kind, entry["arch"])
        derive = derive_decode_tiles if kind is KernelKind.decode else derive_tiles
        chosen = apply_tuning(derive(spec, entry["arch"]), tuned)
        assert entry["config"] == chosen.chosen.as_dict()
        assert entry["config_source"] == chosen.source
        header = (built / entry["path"]).read_text(encoding="utf-8").split('"""', 1)[0]
        config = entry["config"]
        assert (
            f"BLOCK_M={config['BLOCK_M']}, BLOCK_N={config['BLOCK_N']}, "
            f"num_warps={config['num_warps']}, num_stages={config['num_stages']}"
        ) in header
        assert f"hash {entry['spec_hash']}" in header


def test_second_build_is_a_no_op(built: Path) -> None:
    before = _snapshot(built)
    result = _cli("build", *EXAMPLES, "--out", built)
    assert result.exit_code == 0, result.output
    assert "is up to date" in result.stdout
    assert _snapshot(built) == before  # same bytes and same mtimes


def test_build_repairs_what_changed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _cli("build", ROOT / "examples" / "gpt2.yaml", "--out", out).exit_code == 0
    module = next(out.rglob("*.py"))
    good = module.read_bytes()
    module.write_bytes(good + b"# edited\n")
    result = _cli("build", ROOT / "examples" / "gpt2.yaml", "--out", out)
    assert result.exit_code == 0 and "1 file(s) written" in result.stdout
    assert module.read_bytes() == good


def test_second_spec_keeps_first_entries(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first, second = ROOT / "examples" / "gpt2.yaml", ROOT / "examples" / "bert_base.yaml"
    assert _cli("build", first, "--out", out).exit_code == 0
    first_entries = _index(out)["modules"]
    assert _cli("build", second, "--out", out).exit_code == 0
    paths = [e["path"] for e in _index(out)["modules"]]
    assert set(paths) == _expected_paths([first, second]) == _modules(out)
    assert all(e in _index(out)["modules"] for e in first_entries)
    assert stale_paths([first, second], out, TUNING) == []


def test_bad_spec_among_good_ones_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_SPEC, encoding="utf-8")
    out = tmp_path / "out"
    specs = [EXAMPLES[0], bad, *EXAMPLES[1:]]
    result = _cli("build", *specs, "--out", out)
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("attngen: error: ") and str(bad) in lines[0]
    assert "head_dim: got 300" in lines[0]
    assert not out.exists()
    # an existing output folder is left exactly as it was
    assert _cli("build", EXAMPLES[0], "--out", out).exit_code == 0
    before = _snapshot(out)
    assert _cli("build", *specs, "--out", out).exit_code == 1
    assert _snapshot(out) == before


def test_missing_spec_file_is_one_line(tmp_path: Path) -> None:
    result = _cli("build", tmp_path / "nope.yaml", "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "nope.yaml: cannot read" in result.stderr
    assert not (tmp_path / "out").exists()


def test_corrupt_index_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / INDEX_NAME).write_text("[1, 2]\n", encoding="utf-8")
    result = _cli("build", EXAMPLES[0], "--out", out)
    assert result.exit_code == 1 and "not an attngen index" in result.stderr
    assert "Traceback" not in result.output


# ------------------------------------------------------------------------------ usage errors


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["build"],
        ["build", "examples/gpt2.yaml", "--bogus"],
        ["frobnicate"],
        ["explain", "examples/llama3_8b.yaml", "--arch", "bogus"],
        ["explain", "examples/llama3_8b.yaml", "--arch"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    if "--arch" in args and "bogus" in args:
        assert "bogus" in result.output and "sm80, sm86, sm89, sm90" in result.output


def test_entry_point_exit_codes(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_SPEC, encoding="utf-8")
    result = _run("build", bad, "--out", tmp_path / "out")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"attngen: error: {bad}: head_dim: got 300 (int); allowed: an int in 1..256 (up to 576 "
        "with kernels: [decode] only)"
    ]
    assert not (tmp_path / "out").exists()
    usage = _run("explain", "examples/llama3_8b.yaml", "--arch", "bogus")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert "bogus" in usage.stderr and "Traceback" not in usage.stdout


# ---------------------------------------------------------------------------------- check


def test_check_detects_edits_and_deletions(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = ROOT / "examples" / "llama3_8b.yaml"
    assert _cli("build", spec, "--out", out).exit_code == 0
    ok = _cli("check", spec, "--out", out)
    assert ok.exit_code == 0 and "is up to date" in ok.stdout
    module = out / "sm86" / "llama3_8b_prefill_bf16_d128_causal_br_bwd.py"
    original = module.read_bytes()
    module.write_bytes(original.replace(b"BLOCK_M", b"BLOCK_Q", 1))
    edited = _cli("check", spec, "--out", out)
    assert edited.exit_code == 1
    assert "sm86/llama3_8b_prefill_bf16_d128_causal_br_bwd.py" in edited.stderr
    assert "stale" in edited.stderr and edited.stderr.count("\n") == 1
    module.write_bytes(original)
    assert _cli("check", spec, "--out", out).exit_code == 0
    module.unlink()
    deleted = _cli("check", spec, "--out", out)
    assert deleted.exit_code == 1 and "sm86/" in deleted.stderr
    assert _cli("build", spec, "--out", out).exit_code == 0
    index = _index(out)
    index["modules"][0]["config"]["BLOCK_M"] += 1
    (out / INDEX_NAME).write_text(json.dumps(index), encoding="utf-8")
    tampered = _cli("check", spec, "--out", out)
    assert tampered.exit_code == 1 and INDEX_NAME in tampered.stderr


def test_check_on_empty_folder_and_bad_spec(tmp_path: Path) -> None:
    assert _cli("check", EXAMPLES[0], "--out", tmp_path).exit_code == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_SPEC, encoding="utf-8")
    result = _cli("check", bad, "--out", GENERATED)
    assert result.exit_code == 1 and "head_dim" in result.stderr


# -------------------------------------------------------------------------------- explain


def test_explain_one_arch() -> None:
    spec_path = ROOT / "examples" / "llama3_8b.yaml"
    result = _cli("explain", spec_path, "--arch", "sm86")
    assert result.exit_code == 0, result.output
    text = result.stdout
    derivation = derive_tiles(load_specs([spec_path])[0], "sm86")
    config = derivation.chosen
    assert text.count("== llama3_8b on ") == 1 and "== llama3_8b on sm86 (A10" in text
    assert (
        f"chosen: BLOCK_M={config.block_m} BLOCK_N={config.block_n} "
        f"num_warps={config.num_warps} num_stages={config.num_stages}"
    ) in text
    assert f"binding constraint: {derivation.binding}" in text
    assert "headroom: " in text and " B shared memory, " in text and "registers/thread" in text
    assert "CHOSEN" in text and "rejected: " in text
    assert "101376 B" in text  # the sm86 shared-memory budget


def test_explain_decode_works_the_split_rule_out() -> None:
    result = _cli("explain", ROOT / "examples" / "llama3_8b.yaml", "--arch", "sm90")
    assert result.exit_code == 0, result.output
    text = result.stdout
    spec = load_specs([ROOT / "examples" / "llama3_8b.yaml"])[0]
    config = derive_decode_tiles(spec, "sm90").chosen
    assert "== llama3_8b decode on sm90 (H100/H200, 132 SMs" in text
    assert "KV layout paged, page_size 16" in text
    assert (
        f"decode tile: BLOCK_N={config.block_n} num_warps={config.num_warps} "
        f"num_stages={config.num_stages}, query rows up to 16"
    ) in text
    assert "num_splits rule (132 SMs, BLOCK_N=64)" in text
    assert "B=1 L=4096: 8 programs, span 4096 keys = 64 blocks" in text
    assert "-> 16 split(s) of 256 keys: 128 programs" in text
    assert "B=8 L=32768: 64 programs" in text and "B=64 L=4096: 512 programs" in text
    assert "(no combine: written directly)" in text


def test_explain_all_archs() -> None:
    result = _cli("explain", ROOT / "examples" / "llama3_8b.yaml")
    assert result.exit_code == 0
    sections = [line.split()[2:4] for line in result.stdout.splitlines() if line.startswith("== ")]
    assert sections == [
        part
        for arch in ("sm80", "sm86", "sm89", "sm90")
        for part in (["on", arch], ["decode", "on"])
    ]
    assert result.stdout.count("chosen: BLOCK_M=") == 4
    assert result.stdout.count("binding constraint: ") == 4
    both = _cli("explain", ROOT / "examples" / "gemma2_9b.yaml", ROOT / "examples" / "gpt2.yaml")
    heads = [line.split()[1:4] for line in both.stdout.splitlines() if line.startswith("== ")]
    assert heads == [
        ["gemma2_9b_local", "on", "sm80"],
        ["gemma2_9b_local", "decode", "on"],
        ["gemma2_9b_local", "on", "sm90"],
        ["gemma2_9b_local", "decode", "on"],
        ["gemma2_9b_global", "on", "sm80"],
        ["gemma2_9b_global", "decode", "on"],
        ["gemma2_9b_global", "on", "sm90"],
        ["gemma2_9b_global", "decode", "on"],
        ["gpt2", "on", "sm80"],
        ["gpt2", "on", "sm90"],
    ]


# ------------------------------------------------------------------ the committed generated/


def test_generated_is_up_to_date() -> None:
    stale = stale_paths(EXAMPLES, GENERATED, TUNING)
    assert stale == [], f"generated/ is stale; run `attngen build examples/*.yaml`: {stale}"
    assert _modules(GENERATED) == _expected_paths(EXAMPLES), "orphan or missing modules"
    assert [e["path"] for e in _index(GENERATED)["modules"]] == sorted(_expected_paths(EXAMPLES))


def _ruff_check(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--isolated",
            "--no-cache",
            "--line-length",
            "100",
            "--select",
            "E,F,W,I,B,UP",
            str(folder),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generated_is_ruff_clean() -> None:
    result = _ruff_check(GENERATED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_imports_only_torch_triton_and_stdlib() -> None:
    paths = sorted(GENERATED.glob("*/*.py"))
    assert paths
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                imported.add(node.module)
        assert imported <= ALLOWED_IMPORTS, f"{path}: {imported - ALLOWED_IMPORTS}"
        assert {"torch", "triton", "triton.language"} <= imported
        assert not any(name.split(".")[0] == "attngen" for name in imported)
        assert "attngen" not in "".join(n.id for n in ast.walk(tree) if isinstance(n, ast.Name))


# ------------------------------------------------------------------------------ processes


def test_concurrent_builds_agree_with_a_serial_one(tmp_path: Path) -> None:
    shared, serial = tmp_path / "shared", tmp_path / "serial"
    assert _cli("build", *EXAMPLES, "--out", serial).exit_code == 0
    procs = []
    for seed in range(4):
        # PYTHONPATH: the entry point runs this checkout's attngen, wherever it is installed from
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(ROOT)}
        procs.append(
            subprocess.Popen(
                [*_entry_point(), "build", *map(str, EXAMPLES), "--out", str(shared)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
            )
        )
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    expected = {path: data for path, (data, _) in _snapshot(serial).items()}
    got = {path: data for path, (data, _) in _snapshot(shared).items()}
    assert got == expected  # every module and the index, byte for byte; no temp files
    assert _index(shared)["modules"] == _index(serial)["modules"]
    assert stale_paths(EXAMPLES, shared, TUNING) == []


def test_build_path_never_imports_torch_or_triton(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from attngen.cli import app\n"
        "for args in (['build', *sys.argv[2:], '--out', sys.argv[1]],\n"
        "             ['check', *sys.argv[2:], '--out', sys.argv[1]],\n"
        "             ['explain', *sys.argv[2:]]):\n"
        "    try:\n"
        "        app(args, standalone_mode=False)\n"
        "    except SystemExit as exc:\n"
        "        assert not exc.code, exc.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "print(json.dumps(heavy))\n"
    )
    specs = [ROOT / "examples" / "gemma2_9b.yaml", ROOT / "examples" / "mpt_7b.yaml"]
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "out"), *map(str, specs)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []
    assert _modules(tmp_path / "out") == _expected_paths(specs)
