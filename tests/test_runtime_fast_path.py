"""The runtime's fast path: flash-attn layouts written in place (no copy) by modules that take
`out=`, eager calls that skip the op layer (compiled ones go through it), dispatch cached per
registry with correct records, one dtype vocabulary, and selection free of torch. Toy kernels
and stand-in modules (tests/runtime_harness.py) under the CPU interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attngen
from attngen.reference import compare_to_reference
from attngen.runtime import dispatch, ops, selection
from attngen.runtime.arguments import flash_mask
from attngen.runtime.hf import attngen_attention
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import Mask
from attngen.spec.masks import visible
from tests.kernel_harness import make_spec
from tests.runtime_harness import build_folder, build_stand_ins
from tests.test_runtime import _cache_case, qkv, rand

TOY = make_spec(name="toy", dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=2)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def out_modules(tmp_path):
    """Stand-in prefill and decode modules that take out= (ACCEPTS_OUT), as the registry."""
    saved = current_registry()
    yield load_kernels(
        build_stand_ins(tmp_path / "out", ("prefill", "decode"), accepts_out=True), replace=True
    )
    use_registry(saved)


def flash_qkv(batch, seqlen_q, seqlen_k, seed=0):
    """q [B, Nq, 4, 16], k/v [B, Nk, 2, 16] in flash-attn's layout, none of them contiguous:
    q is a slice of a packed q|pad tensor, k and v of one packed k|v tensor."""
    q = rand(batch, seqlen_q, 5, 16, seed=seed)[:, :, :4]
    kv = rand(batch, seqlen_k, 4, 16, seed=seed + 1)
    return q, kv[:, :, :2], kv[:, :, 2:]


def heads_first(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def module_of(dispatch_):
    return current_registry().module(dispatch_.key)


# --------------------------------------------------------------- flash layouts, in place


def test_flash_attn_func_writes_the_flash_layout_in_place(out_modules):
    q, k, v = flash_qkv(2, 5, 9)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out, lse, _ = attngen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    chosen = attngen.last_dispatch()
    assert chosen.writes_out and "in place (out=)" in chosen.reason
    assert out.shape == (2, 5, 4, 16) and out.is_contiguous() and lse.shape == (2, 4, 5)
    assert module_of(chosen).WROTE == [out.data_ptr()]  # the kernel wrote the caller's tensor
    assert not compare_to_reference(TOY, out.transpose(1, 2), lse, *heads_first(q, k, v))


def test_generated_modules_write_flash_attn_func_output_in_place(toy_kernels, monkeypatch):
    """Generated modules take out= (ACCEPTS_OUT): flash_attn_func's [B, N, H, D] output is the
    tensor the kernel wrote through its strides, from strided inputs (no copy)."""
    q, k, v = flash_qkv(2, 5, 9)
    out, lse, _ = attngen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    chosen = attngen.last_dispatch()
    assert chosen.writes_out and "in place (out=)" in chosen.reason
    module = module_of(chosen)
    given = []
    real = module.attention
    monkeypatch.setattr(
        module, "attention", lambda *a, **kw: given.append(kw["out"]) or real(*a, **kw)
    )
    again, lse_again, _ = attngen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert len(given) == 1 and given[0].data_ptr() == again.data_ptr()
    assert given[0].shape == (2, 4, 5, 16) and again.shape == (2, 5, 4, 16)
    assert again.is_contiguous() and torch.equal(again, out) and torch.equal(lse_again, lse)
    assert not compare_to_reference(TOY, out.transpose(1, 2), lse, *heads_first(q, k, v))


def test_flash_attn_func_from_a_module_without_out_copies_once_and_says_so(tmp_path):
    """A module that takes no out= (one built by an older attngen): the output is still one
    contiguous tensor in flash-attn's layout, and the Dispatch says it was copied."""
    saved = current_registry()
    load_kernels(build_stand_ins(tmp_path / "plain", ("prefill",)), replace=True)
    try:
        q, k, v = flash_qkv(2, 5, 9)
        out = attngen.flash_attn_func(q, k, v, causal=True)
        chosen = attngen.last_dispatch()
        assert not chosen.writes_out and "is copied" in chosen.reason
        assert module_of(chosen).WROTE == [None]
        assert out.shape == (2, 5, 4, 16) and out.is_contiguous()
    finally:
        use_registry(saved)


def test_transformers_attention_returns_its_layout_contiguous(out_modules):
    """transformers reshapes the output to [B, N, H * D] next: it must come contiguous (a
    transposed view would be copied there), written in place by an out= module."""
    q, k, v = heads_first(*flash_qkv(2, 6, 6))  # [B, H, N, D] views, as transformers passes
    layer = SimpleNamespace(is_causal=True)
    out, _ = attngen_attention(layer, q, k, v, None)
    assert out.shape == (2, 6, 4, 16) and out.is_contiguous()
    assert module_of(attngen.last_dispatch()).WROTE == [out.data_ptr()]
    expected = attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, expected.transpose(1, 2))


def test_kvcache_decode_output_in_place_or_a_view(out_modules, tmp_path):
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
    out = attngen.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True
    )
    chosen = attngen.last_dispatch()
    assert chosen.module == "sm90/toy_decode_out" and chosen.writes_out
    assert out.shape == (2, 2, 4, 16) and out.is_contiguous()
    assert module_of(chosen).WROTE == [out.data_ptr()]
    # A decode module without out=: the output is a view of its [B, HQ, Nq, DV] result.
    load_kernels(build_stand_ins(tmp_path / "plain", ("decode",)), replace=True)
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
    view = attngen.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True
    )
    assert module_of(attngen.last_dispatch()).WROTE == [None]
    assert not view.is_contiguous() and torch.equal(view, out)


def test_compiled_calls_keep_the_in_place_layouts(out_modules):
    """Under torch.compile the ops' fake implementations give the in-place outputs' strides,
    so the compiled result is the eager one, contiguous."""
    q, k, v = flash_qkv(1, 4, 6)

    def prefill(q, k, v):
        return attngen.flash_attn_func(q, k, v, causal=True)

    eager = prefill(q, k, v)
    compiled = torch.compile(prefill, fullgraph=True, backend="aot_eager")(q, k, v)
    assert compiled.is_contiguous() and torch.equal(compiled, eager)

    def step(q, k_cache, v_cache, k_new, v_new, seqlens):
        return attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True
        )

    case_eager, case_compiled = _cache_case(), _cache_case()
    eager = step(*case_eager)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*case_compiled)
    assert compiled.is_contiguous() and torch.equal(compiled, eager)
    assert torch.equal(case_compiled[1].nan_to_num(), case_eager[1].nan_to_num())


# ----------------------------------------------------------- the op layer, compiled only


class _Subclass(torch.Tensor):
    pass


def test_eager_calls_skip_the_op_layer_and_compiled_calls_use_it(toy_kernels, monkeypatch):
    q, k, v = qkv(1, 6, 6)
    through_op = []
    real_op = ops.prefill_op
    monkeypatch.setattr(
        ops, "prefill_op", lambda *args: through_op.append(args[0]) or real_op(*args)
    )

    def layer(q, k, v):
        return attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    ops.reset_run_counts()
    with torch.no_grad():
        eager = layer(q, k, v)
    layer(q, k, v)  # grad mode on, but no input needs a gradient
    key = attngen.last_dispatch().key
    assert through_op == [] and ops.run_counts() == {key: 2}
    # An input that needs a gradient needs gradient kernels: these forward-only modules
    # refuse it before any run (its op layer runs on them: test_backward_runtime.py).
    with pytest.raises(attngen.NoKernelError, match="backward: needs true"):
        layer(q.clone().requires_grad_(), k, v)
    assert through_op == [] and ops.run_counts() == {key: 2}
    layer(q.as_subclass(_Subclass), k, v)  # a tensor subclass goes through the op
    assert through_op == [key] and ops.run_counts() == {key: 3}
    monkeypatch.undo()

    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(layer, fullgraph=True, backend=backend)(q, k, v)
    targets = {str(node.target) for g in graphs for node in g.graph.nodes}
    assert "attngen.prefill.default" in targets
    assert torch.equal(compiled, eager) and ops.run_counts() == {key: 4}


# -------------------------------------------------------------------- dispatch cache


def test_a_repeated_call_reuses_its_dispatch_and_still_records_it(toy_kernels, monkeypatch):
    q, k, v = qkv(1, 6, 6)

    def sdpa():
        return attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    sdpa()
    first = attngen.last_dispatch()
    attngen.flash_attn_func(*heads_first(q, k, v), causal=True)
    assert attngen.last_dispatch().api == "flash_attn_func"

    def no_selection(*args):
        raise AssertionError("selection ran for a call whose Dispatch is cached")

    monkeypatch.setattr(dispatch, "best_entry", no_selection)
    with attngen.dispatch_log() as log:
        sdpa()
        attngen.flash_attn_func(*heads_first(q, k, v), causal=True)
    assert attngen.last_dispatch().api == "flash_attn_func"
    assert log[0] is first and [d.api for d in log] == [
        "scaled_dot_product_attention",
        "flash_attn_func",
    ]
    with pytest.raises(AssertionError, match="selection ran"):  # another length: another Need
        attngen.scaled_dot_product_attention(
            q[:, :, :5], k[:, :, :5], v[:, :, :5], is_causal=True, enable_gqa=True
        )


def test_a_planned_call_reaches_its_module_through_three_files(out_modules):
    """flash_attn_func (public function), attngen/runtime/plans.py (the plan) and the module:
    no other attngen frame is entered by a planned call (tools/call_path.py measures the
    generated modules), and the call is still recorded and counted."""
    import sys

    q, k, v = flash_qkv(2, 5, 9)
    attngen.flash_attn_func(q, k, v, causal=True)  # the full path leaves the plan
    entered = set()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and ("attngen" in name or str(out_modules.folders[0]) in name):
            entered.add(Path(name).name)

    planned = attngen.last_dispatch()
    attngen.flash_attn_func(*flash_qkv(1, 3, 3), causal=True)  # another call recorded between
    before = ops.run_counts()
    sys.setprofile(profile)
    try:
        attngen.flash_attn_func(q, k, v, causal=True)
    finally:
        sys.setprofile(None)
    assert attngen.last_dispatch() is planned
    assert entered - {"api.py", "plans.py"} == {Path(module_of(planned).__file__).name}, entered
    assert ops.run_counts()[planned.key] == before[planned.key] + 1


def test_a_replaced_registry_never_serves_from_its_cache(toy_folder, tmp_path):
    other = build_folder(
        tmp_path / "other",
        [
            dict(
                name="other",
                dtype="fp32",
                head_dim=16,
                num_q_heads=4,
                num_kv_heads=2,
                mask="causal",
                causal_align="bottom_right",
                kernels=["prefill"],
            )
        ],
    )
    q, k, v = qkv(1, 4, 4)
    saved = current_registry()
    chosen = []
    try:
        for folder in (toy_folder, other, toy_folder):
            load_kernels(folder, replace=True)
            for _ in range(2):
                attngen.flash_attn_func(*heads_first(q, k, v), causal=True)
                chosen.append(attngen.last_dispatch().module)
    finally:
        use_registry(saved)
    toy, new = "sm90/toy_prefill_fp32_d16_causal_br", "sm90/other_prefill_fp32_d16_causal_br"
    assert chosen == [toy, toy, new, new, toy, toy]


def test_the_dispatch_cache_is_bounded(toy_kernels, monkeypatch):
    monkeypatch.setattr(selection, "ROUTE_CACHE_SIZE", 2)
    for n in (3, 4, 5, 6, 7):
        q, k, v = qkv(1, n, n)
        attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert attngen.last_dispatch().module == "sm90/toy_prefill_fp32_d16_causal_br"
        assert len(selection.routes(toy_kernels)) <= 2


# ---------------------------------------------------------------- vocabulary and purity


def test_a_dtype_without_kernels_is_refused_by_name(toy_kernels):
    q, k, v = (t.double() for t in qkv(1, 4, 4, hkv=4))
    with pytest.raises(
        attngen.NoKernelError,
        match=r"q: dtype torch.float64 has no generated "
        r"kernels; allowed: torch.float16",
    ):
        attngen.scaled_dot_product_attention(q, k, v)
    with pytest.warns(UserWarning, match="torch.float64"):
        out = attngen.scaled_dot_product_attention(q, k, v, fallback="sdpa")
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_flash_window_sizes_map_to_one_mask_however_spelled():
    assert flash_mask(False, (-1, -1)) == flash_mask(False, [-1, -1]) == (Mask.none, None)
    assert flash_mask(True, (-1, -1)) == flash_mask(True, [-1, -1]) == (Mask.causal, None)
    assert flash_mask(True, (3, 0)) == (Mask.sliding_window, (3, 0))
    with pytest.raises(ValueError, match=r"window_size: got \(-2, 0\)"):
        flash_mask(False, (-2, 0))


def test_visibility_is_defined_once_by_aligned_position():
    assert visible("none", None, None, 2, 4) is None
    assert visible("causal", "bottom_right", None, 2, 4).tolist() == [
        [True, True, True, False],
        [True, True, True, True],
    ]
    assert visible("causal", "top_left", None, 2, 4).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
    ]
    assert visible(Mask.sliding_window, "bottom_right", (1, 0), 2, 4).tolist() == [
        [False, True, True, False],
        [False, False, True, True],
    ]


@pytest.mark.parametrize("module", ["selection", "registry"])
def test_selection_imports_no_torch(module):
    """Selection (with the dispatch record), the registry and the cache are plain Python: no
    torch or triton import (attngen.spec.expressions, for a call's expression key, is plain too)."""
    tree = ast.parse((ROOT / "attngen" / "runtime" / f"{module}.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.col_offset == 0
    }
    assert not {name for name in imported if name.split(".")[0] in ("torch", "triton")}
    assert all(
        name.split(".")[0] != "attngen"
        or name
        in (
            "attngen.spec",
            "attngen.spec.expressions",
            "attngen.arch",
            "attngen.spec.files",
            "attngen.spec.names",
            "attngen.runtime.registry",
            "attngen.runtime.selection",
        )
        for name in imported
    )


def test_a_first_call_imports_neither_dynamo_nor_sympy() -> None:
    """A process that never compiles pays neither torch._dynamo's import (about 1 s: the
    runtime sets torch.compiler's marks itself, and its disabled functions run as they are
    until dynamo is imported) nor the renderer's and sympy's (a loaded module's header is
    checked through attngen.host)."""
    code = (
        "import sys, torch, attngen\n"
        "q = torch.randn(1, 64, 2, 64, dtype=torch.float16)\n"
        "attngen.flash_attn_func(q, q, q, causal=True)\n"
        "attngen.runtime.dispatch.eager_only('a disabled function')(abs)(-1)\n"
        "print([m for m in ('torch._dynamo', 'sympy', 'attngen.render') if m in sys.modules])"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]"


def test_the_lazy_compiler_marks_are_torch_compilers() -> None:
    marked = torch.compiler.assume_constant_result(lambda: 0)
    assert vars(marked) == vars(dispatch._constant_when_compiled(lambda: 0))
    assert vars(marked) == {"_dynamo_marked_constant": True}


def test_an_eager_only_function_runs_eagerly_when_first_called_compiled() -> None:
    compiling = []

    @dispatch.eager_only("a test of the lazy disable")
    def doubled(x):
        compiling.append(torch.compiler.is_compiling())
        return x * 2

    step = torch.compile(lambda x: doubled(x + 1) - 1, backend="eager")
    assert torch.equal(step(torch.ones(3)), torch.full((3,), 3.0))
    assert torch.equal(step(torch.ones(3)), torch.full((3,), 3.0)) and compiling == [False] * 2
    whole = torch.compile(lambda x: doubled(x) + 1, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="disable"):
        whole(torch.ones(2))
