"""Kernels on demand (attngen/runtime/selection.py): calls no loaded module serves are built
into the cache, match the float64 reference, and are reused; the cache survives racing
processes and refuses tampered files; on_demand=False refuses as before."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import attngen
from attngen.reference import compare_to_reference
from attngen.runtime import registry, selection
from attngen.runtime.registry import configure, load_kernels
from tests.kernel_harness import make_spec
from tests.ondemand_harness import child, module_files, on_demand  # noqa: F401

# Shapes no example spec serves: odd and unusual head dims, 6 query heads (GQA 3:1 and MHA),
# windows, softcap in fp16, fp32, ALiBi.
CASES = [
    dict(head_dim=59, dtype="fp16", heads=(6, 2), mask="causal"),
    dict(head_dim=72, dtype="fp32", heads=(6, 6), mask="sliding_window", window=(7, 3)),
    dict(head_dim=111, dtype="fp16", heads=(6, 3), mask="none", softcap=30.0),
    dict(head_dim=200, dtype="fp16", heads=(6, 6), mask="causal", softcap=50.0),
    dict(head_dim=59, dtype="fp32", heads=(6, 1), mask="none", alibi=True),
]


def _flash_inputs(case, seqlen_q=37, seqlen_k=45, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, {"fp16": "float16", "fp32": "float32"}[case["dtype"]])
    hq, hkv = case["heads"]
    d = case["head_dim"]
    q, k, v = (
        torch.randn(2, n, h, d, generator=gen).to(dtype)
        for n, h in ((seqlen_q, hq), (seqlen_k, hkv), (seqlen_k, hkv))
    )
    slopes = 2.0 ** (-8 * torch.arange(1, hq + 1) / hq) if case.get("alibi") else None
    return q, k, v, slopes


def _window_size(case):
    if case["mask"] == "sliding_window":
        return case["window"]
    return (-1, -1)


def _reference_spec(case):
    fields = dict(
        dtype=case["dtype"],
        head_dim=case["head_dim"],
        num_q_heads=case["heads"][0],
        num_kv_heads=case["heads"][1],
        mask=case["mask"],
        softcap=case.get("softcap", 0.0),
        alibi=case.get("alibi", False),
    )
    if case["mask"] == "sliding_window":
        fields.update(window_left=case["window"][0], window_right=case["window"][1])
    return make_spec(**fields)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c['head_dim']}_{c['dtype']}_{c['mask']}")
def test_calls_no_module_serves_are_built_matched_and_reused(case, on_demand):  # noqa: F811
    q, k, v, slopes = _flash_inputs(case)
    renders = registry.render_count()
    kwargs = dict(
        causal=case["mask"] == "causal",
        window_size=_window_size(case),
        softcap=case.get("softcap", 0.0),
        alibi_slopes=slopes,
        return_attn_probs=True,
    )
    out, lse, _ = attngen.flash_attn_func(q, k, v, **kwargs)
    first = attngen.last_dispatch()
    assert first.source == "cache" and first.built, first
    assert first.key.startswith(str(on_demand)) and first.module.startswith("sm80/auto_h")
    assert f"_d{case['head_dim']}" in first.module
    assert registry.render_count() == renders + 1
    problems = compare_to_reference(
        _reference_spec(case),
        out.transpose(1, 2),
        lse,
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        alibi_slopes=slopes,
    )
    assert not problems, problems
    again = attngen.flash_attn_func(q, k, v, **kwargs)[0]
    second = attngen.last_dispatch()
    assert second.key == first.key and not second.built
    assert registry.render_count() == renders + 1  # served by the cached module, not rendered
    assert torch.equal(again, out)


def test_varlen_and_decode_kinds_are_built_on_demand(on_demand):  # noqa: F811
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(20, h, 59, generator=gen).half() for h in (6, 2, 2))
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    out = attngen.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True)
    varlen = attngen.last_dispatch()
    assert varlen.built and "_varlen_fp16_d59_causal_br" in varlen.module
    dense = attngen.flash_attn_func(q[None, :8], k[None, :8], v[None, :8], causal=True)
    # fp16 outputs of two kernels (varlen and prefill tiles) summing in other orders: a few
    # fp16 ulps of |out| < 1 (ulp 2**-10 = 9.8e-4 near 1; 2e-3 is two of them).
    assert torch.allclose(out[:8].float(), dense[0].float(), atol=2e-3)
    cache_k, cache_v = (torch.randn(2, 32, 2, 59, generator=gen).half() for _ in range(2))
    step_q = torch.randn(2, 1, 6, 59, generator=gen).half()
    lengths = torch.tensor([5, 17], dtype=torch.int32)
    attngen.flash_attn_with_kvcache(step_q, cache_k, cache_v, cache_seqlens=lengths, causal=True)
    decode = attngen.last_dispatch()
    assert decode.built and "_decode_fp16_d59_causal_br_contig" in decode.module


def test_second_process_reuses_the_cached_module(on_demand):  # noqa: F811
    case = CASES[0]
    q, k, v, _ = _flash_inputs(case)
    attngen.flash_attn_func(q, k, v, causal=True)
    key = attngen.last_dispatch().key
    proc = child(
        f"""
        import torch, attngen
        from attngen.runtime import registry, selection
        q, k, v = (torch.randn(2, n, h, 59).half() for n, h in ((5, 6), (9, 2), (9, 2)))
        attngen.flash_attn_func(q, k, v, causal=True)
        d = attngen.last_dispatch()
        print(d.key == {key!r}, d.source, d.built, registry.render_count())
        """,
        on_demand,
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert stdout.split() == ["True", "cache", "False", "0"]


RACER = """
    import pathlib, time, torch, attngen
    from attngen.runtime import registry, selection
    start = pathlib.Path({start!r})
    while not start.exists():
        time.sleep(0.01)
    q, k, v = (torch.randn(1, n, h, 111).half() for n, h in ((3, 4), (6, 4), (6, 4)))
    out = attngen.flash_attn_func(q, k, v, window_size=(2, 1))
    print(registry.render_count(), attngen.last_dispatch().key, bool(torch.isfinite(out).all()))
"""


def test_racing_processes_both_succeed_and_leave_one_valid_module(on_demand, tmp_path):  # noqa: F811
    start = tmp_path / "start"
    racers = [child(RACER.format(start=str(start)), on_demand) for _ in range(2)]
    start.touch()
    results = []
    for proc in racers:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        results.append(stdout.split())
    assert sorted(int(r[0]) for r in results) == [0, 1]  # one rendered, the other waited
    assert results[0][1] == results[1][1] and results[0][2] == results[1][2] == "True"
    files = module_files(on_demand)
    assert [f.name for f in files] == [results[0][1].rsplit("/", 1)[1]]
    folder = files[0].parent.parent
    (item,) = json.loads((folder / "index.json").read_text())["modules"]
    assert item["sha256"] == hashlib.sha256(files[0].read_bytes()).hexdigest()
    assert not list(folder.rglob("*.tmp"))  # no half-written file left behind


def _tamper(path, marker):
    path.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + path.read_text())


def test_a_tampered_cached_module_is_rebuilt_not_run(on_demand, tmp_path):  # noqa: F811
    case = CASES[3]
    q, k, v, _ = _flash_inputs(case, seqlen_q=9, seqlen_k=9)
    out = attngen.flash_attn_func(q, k, v, causal=True, softcap=50.0)
    path = Path(attngen.last_dispatch().key)
    original = path.read_bytes()
    marker = tmp_path / "ran"
    _tamper(path, marker)
    load_kernels()  # a new registry (as a new process would have) reads the cache's index
    renders = registry.render_count()
    again = attngen.flash_attn_func(q, k, v, causal=True, softcap=50.0)
    assert not marker.exists()
    assert path.read_bytes() == original and torch.equal(again, out)
    assert attngen.last_dispatch().key == str(path) and registry.render_count() == renders + 1


def test_a_foreign_file_or_corrupt_index_in_the_cache_is_replaced(on_demand, tmp_path):  # noqa: F811
    case = CASES[0]
    q, k, v, _ = _flash_inputs(case, seqlen_q=5, seqlen_k=5)
    attngen.flash_attn_func(q, k, v, causal=True)
    path = Path(attngen.last_dispatch().key)
    folder = path.parent.parent
    marker = tmp_path / "ran"
    _tamper(path, marker)
    (folder / "index.json").write_text("{not json")
    load_kernels()
    attngen.flash_attn_func(q, k, v, causal=True)
    assert not marker.exists() and attngen.last_dispatch().built
    index = json.loads((folder / "index.json").read_text())
    assert [item["module"] for item in index["modules"]] == [path.stem]


def test_on_demand_off_refuses_as_before(on_demand):  # noqa: F811
    configure(on_demand=False)
    q, k, v, _ = _flash_inputs(CASES[0], seqlen_q=4, seqlen_k=4)
    with pytest.raises(attngen.NoKernelError, match="On-demand builds are off"):
        attngen.flash_attn_func(q, k, v, causal=True)
    assert module_files(on_demand) == []
    assert all(row.source != "cache" for row in attngen.loaded_kernels())


def test_the_suite_default_is_off_by_environment():
    q, k, v, _ = _flash_inputs(CASES[0], seqlen_q=4, seqlen_k=4)
    with pytest.raises(attngen.NoKernelError, match="ATTNGEN_ON_DEMAND=0"):
        attngen.flash_attn_func(q, k, v, causal=True)


def test_a_call_no_spec_states_is_refused_with_the_reason(on_demand):  # noqa: F811
    q = torch.randn(1, 4, 2, 300).half()
    with pytest.raises(attngen.NoKernelError, match=r"Not built on demand: head_dim: got 300"):
        attngen.flash_attn_func(q, q, q)


def test_warmup_builds_what_a_config_needs_so_the_first_call_renders_nothing(on_demand):  # noqa: F811
    config = {
        "model_type": "llama",
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "hidden_size": 354,
        "head_dim": 59,
        "torch_dtype": "float16",
        "num_hidden_layers": 2,
    }
    warmed = attngen.warmup(config)
    assert [(w.kind, w.source, w.built, w.ran) for w in warmed] == [
        ("prefill", "cache", True, True),
        ("varlen", "cache", True, True),
    ]
    renders = registry.render_count()
    q, k, v = (torch.randn(1, 9, h, 59).half() for h in (6, 2, 2))
    attngen.flash_attn_func(q, k, v, causal=True)
    assert attngen.last_dispatch().module == warmed[0].module
    assert registry.render_count() == renders


def test_a_call_that_needs_gradient_kernels_is_built_with_them():
    """A Need with backward (context parallelism's gradient calls) states `backward: true`, so
    the module built for it carries the gradient kernels; other calls do not."""
    from attngen.runtime.selection import INTERPRETER, Need
    from attngen.spec import CausalAlign, Dtype, KernelKind, Mask

    need = Need(
        kind=KernelKind.prefill,
        dtype=Dtype.fp16,
        head_dim=59,
        head_dim_v=59,
        mask=Mask.causal,
        causal_align=CausalAlign.bottom_right,
        window=None,
        softcap=0.0,
        alibi=False,
        arch=INTERPRETER,
        seqlen_q=8,
        seqlen_k=12,
        same_lengths=False,
        backward=True,
    )
    assert selection.spec_for(need, (6, 2))[0].backward
    assert not selection.spec_for(need._replace(backward=False), (6, 2))[0].backward


def test_the_cache_fingerprint_reads_every_build_source():
    """Each pattern names files (a renamed package would leave its changes out of the key), and
    the packages whose code reaches a module's text are among them."""
    package = Path(attngen.__file__).parent
    for pattern in registry._BUILD_SOURCES:
        assert list(package.glob(pattern)), pattern
    read = {p for pattern in registry._BUILD_SOURCES for p in package.glob(pattern)}
    for needed in ("render/__init__.py", "spec/expressions.py", "host/launch.py"):
        assert package / needed in read, needed
