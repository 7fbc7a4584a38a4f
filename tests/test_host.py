"""attngen/host as an ordinary module, on the CPU without a kernel: the launch's argument
order, the checks' messages, the kept launches' caching, and the verbatim copy into every
generated module."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attngen.host import MARKER, OPTIONAL_PARTS, PARTS, checks, launch, varlen
from attngen.render import ALLOWED_IMPORTS, host_parts

ROOT = Path(__file__).resolve().parent.parent
D = 64


class FakeKernel:
    """`kernel[grid](*args, **kwargs)` recorded; its params are the launch's groups."""

    def __init__(self, names: list[str], constexprs: list[str]) -> None:
        self.calls: list[tuple] = []
        self.pre_run_hooks: list = []
        self.fn = SimpleNamespace(__name__="_fake_kernel")
        self.params = [SimpleNamespace(name=n, is_constexpr=False) for n in names] + [
            SimpleNamespace(name=n, is_constexpr=True) for n in constexprs
        ]

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return SimpleNamespace(run=lambda *a: None, function=1, packed_metadata=2)

        return run


def test_launch_passes_tensors_ints_tail_then_constexprs_and_options() -> None:
    kernel = FakeKernel(["Q", "n", "scale"], ["BLOCK"])
    q = torch.zeros(4)
    assert (
        launch._launch(kernel, 3, -1, (q,), (7,), (0.5,), {"BLOCK": 16}, {"num_warps": 4}) is None
    )
    assert kernel.calls == [((3,), (q, 7, 0.5), {"BLOCK": 16, "num_warps": 4})]


def test_first_launch_refuses_parameters_out_of_the_groups_order() -> None:
    kernel = FakeKernel(["Q", "BLOCK"], ["n"])
    q = torch.zeros(4)
    with pytest.raises(RuntimeError, match="not the launch's groups in order"):
        launch._first_launch(kernel, 1, ("key",), (q,), (5,), (), {"BLOCK": 16}, {})


def test_int_classes_follow_triton_specialization() -> None:
    # 16-divisible, 1 (a constant), other; and values past int32 are their own class
    assert launch._int_classes((32, 1, 7)) == (0, 2, 1)
    assert launch._int_classes((2**31,))[0] != launch._int_classes((2**32,))[0]


def test_kept_step_remembers_its_compiled_kernel_per_alignment(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(launch, "_launch", lambda *a: calls.append(a) or ("run", ()))
    monkeypatch.setattr(launch, "_DRIVER", [lambda: 0, lambda device: "stream"])
    monkeypatch.setattr(launch, "_direct_on", lambda device, kernels: False)
    step = launch._Step("kernel", 2, (8,), (1.0,), {"B": 16}, {})
    t = torch.zeros(8)
    launch._run_step(step, 0, (t,))
    assert len(calls) == 1 and len(step.compiled) == 1
    (slot,) = step.compiled
    assert slot[0] == (t.data_ptr() % 16 == 0,)


def test_no_self_overlap_and_out_checks_name_the_argument() -> None:
    assert launch._no_self_overlap((2, 3), (3, 1))
    assert not launch._no_self_overlap((2, 3), (1, 1))
    q = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="out: expected a torch.Tensor or None, got list"):
        launch._check_out([], (2, 3), q, ())
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 3\)"):
        launch._check_out(torch.zeros(3, 2), (2, 3), q, ())
    with pytest.raises(ValueError, match="out: shares memory with q"):
        launch._check_out(q, (2, 3), q, (("q", q),))
    with pytest.raises(ValueError, match="make elements share memory"):
        launch._check_out(torch.zeros(1, 3).expand(2, 3), (2, 3), q, ())
    with pytest.raises(ValueError, match="exceed the grid"):
        launch._check_grid(2**31)


def _qkv(dtype=torch.float16, hq=4, hkv=2, dv=D):
    b, n = 2, 8
    return (
        torch.zeros(b, hq, n, D, dtype=dtype),
        torch.zeros(b, hkv, n, D, dtype=dtype),
        torch.zeros(b, hkv, n, dv, dtype=dtype),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": torch.float32}, "q: expected dtype torch.float16"),
        ({"hq": 3}, "heads: expected q heads a multiple of k/v heads, got 3 and 2"),
        ({"dv": 32}, f"v: expected head dim {D}, got 32"),
    ],
)
def test_tensor_checks_name_what_fails(monkeypatch, change, message) -> None:
    monkeypatch.setattr(checks, "_INTERPRET", True)
    q, k, v = _qkv(**change)
    assert not checks._tensors_ok(q, k, v, 4, 2, torch.float16, D, D)
    with pytest.raises(ValueError, match=message):
        checks._check_tensors(q, k, v, "[B, H, N, D]", torch.float16, D, D)


def test_tensor_checks_pass_what_the_success_path_passes(monkeypatch) -> None:
    monkeypatch.setattr(checks, "_INTERPRET", True)
    q, k, v = _qkv()
    assert checks._tensors_ok(q, k, v, 4, 2, torch.float16, D, D)
    checks._check_tensors(q, k, v, "[B, H, N, D]", torch.float16, D, D)
    monkeypatch.setattr(checks, "_INTERPRET", False)
    assert not checks._tensors_ok(q, k, v, 4, 2, torch.float16, D, D)
    with pytest.raises(ValueError, match="q: expected CUDA tensors"):
        checks._check_tensors(q, k, v, "[B, H, N, D]", torch.float16, D, D)


def test_varlen_checks_and_validation() -> None:
    q = torch.zeros(5, 2, D)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert varlen._varlen_ok(q, cu, cu, 3, 3, None)
    assert not varlen._varlen_ok(q, cu.long(), cu, 3, 3, None)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected a 1-D int32 tensor"):
        varlen._check_varlen(q, q, cu.long(), cu, 3, 3, None)
    with pytest.raises(ValueError, match="max_seqlen_k: expected a Python int >= 0, got True"):
        varlen._check_varlen(q, q, cu, cu, 3, True, None)
    varlen._validate_varlen(q, q, cu, cu, 3, None)
    with pytest.raises(ValueError, match="sequence 1 has 3 queries, more than max_seqlen_q = 2"):
        varlen._validate_varlen(q, q, cu, cu, 2, None)
    bad = torch.tensor([0, 6, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[1\] = 6: expected 0..5"):
        varlen._validate_varlen(q, q, cu, bad, 3, None)


def test_parts_copy_only_standard_library_torch_and_triton() -> None:
    """Each part's copied text imports nothing and names only what its module or an earlier
    part imports (the generated module imports the same, ALLOWED_IMPORTS)."""
    for part, text in host_parts().items():
        tree = ast.parse(text)
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        source = (ROOT / "attngen" / "host" / f"{part}.py").read_text()
        assert source.count("\n" + MARKER) == 1
        for node in ast.parse(source).body:
            if isinstance(node, ast.Import):
                assert {a.name for a in node.names} <= ALLOWED_IMPORTS
            elif isinstance(node, ast.ImportFrom):
                assert node.module in ("attngen.host.launch",)  # an earlier part, not copied


def test_every_generated_module_ends_with_its_parts_verbatim() -> None:
    modules = sorted((ROOT / "generated").glob("*/*.py"))
    assert modules
    for path in modules:
        kind = next(k for k in ("decode", "varlen", "prefill") if f"_{k}_" in path.name)
        expected = "\n\n\n".join(
            t for p, t in host_parts().items() if kind in PARTS[p] and p not in OPTIONAL_PARTS
        )
        assert path.read_text().endswith("\n\n\n" + expected + "\n"), path
