"""attngen/host as an ordinary module, on the CPU without a kernel: the launch's argument
order, the checks' messages, the kept launches' caching, and the verbatim copy into every
generated module."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attngen.host import (
    MARKER,
    PARTS,
    checks,
    gluon,
    launch,
    plans,
    prefill_plans,
    tma,
    varlen,
    varlen_plans,
)
from attngen.render import ALLOWED_FROM_IMPORTS, ALLOWED_IMPORTS, host_parts

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


def test_a_direct_launch_encodes_each_tma_descriptor_once(monkeypatch) -> None:
    """Triton 3.6's wrapper of the C launcher encodes every descriptor at every launch; the
    direct launch passes the same arguments and encodes once per address, shape and strides."""
    from triton.backends.nvidia import driver

    made, seen = [], []
    monkeypatch.setattr(launch, "_ENCODINGS", {})
    monkeypatch.setattr(
        driver,
        "make_tensordesc_arg",
        lambda d, m: made.append(d) or [f"map{m['swizzle']}", *d.shape, *d.strides],
    )
    signature = {
        "X": "*bf16",
        "K": "tensordesc<bf16[64, 64]>",
        "n": "i32",
        "V": "tensordesc<bf16[64, 64]>",
    }
    metas = [{"swizzle": s, "elem_size": 2, "elem_type": 5, "block_size": [64, 64]} for s in (1, 3)]
    wrapper = driver.wrap_handle_tensordesc(lambda *a: seen.append(a), signature, metas)
    direct = launch._encoded_launch(wrapper)
    t = torch.zeros(8, 64, dtype=torch.bfloat16)
    k, v, k_rows = (SimpleNamespace(base=b, shape=[b.shape[0], 64], strides=[64, 1], padding="zero")
                    for b in (t, t, t[4:]))  # fmt: skip
    base = tuple(range(driver._BASE_ARGS_FORMAT_LEN))
    wrapper(*base, 11, k, 7, v)
    direct(*base, 11, k, 7, v)
    direct(*base, 11, k, 7, v)
    expected = (*base, 11, "map1", 8, 64, 64, 1, 7, "map3", 8, 64, 64, 1)
    assert seen == [expected] * 3
    assert len(made) == 4  # the wrapper's two, then two for the direct launches together
    direct(*base, 11, k_rows, 7, v)  # another address and shape: encoded again
    assert seen[-1][len(base) + 1 : len(base) + 4] == ("map1", 4, 64) and len(made) == 5
    assert launch._encoded_launch(print) is print  # a launcher without descriptors: itself


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
            elif isinstance(node, ast.ImportFrom):  # an earlier part (not copied) or allowed
                for alias in node.names:
                    allowed = (node.module, alias.name) in ALLOWED_FROM_IMPORTS
                    stand_in = node.module in ("typing", *(f"attngen.host.{p}" for p in PARTS))
                    assert allowed or stand_in, node.module  # (stand-ins: not copied)


# A flagged part is in a module exactly where the module's own text shows the flag (one of
# its signs: decode's plans are kept by _remember_launches).
FLAG_SIGNS = {
    "tma": ("\nPOINTER_LOADS_UP_TO = ",),
    "gluon": ("\ndef _gluon_run(", "\ndef _gluon_varlen_run("),
    "call_plans": ("_remember_plan(", "_remember_launches("),
    "expressions": ("\n_TENSORS = ",),
}


def test_every_generated_module_ends_with_its_parts_verbatim() -> None:
    modules = sorted((ROOT / "generated").glob("*/*.py"))
    assert modules
    for path in modules:
        kind = next(k for k in ("decode", "varlen", "prefill") if f"_{k}_" in path.name)
        text = path.read_text()
        own = text[: text.index("\n" + MARKER)]
        flags = {flag: any(sign in own for sign in signs) for flag, signs in FLAG_SIGNS.items()}
        expected = "\n\n\n".join(
            t
            for p, t in host_parts().items()
            if kind in PARTS[p][0] and (PARTS[p][1] is None or flags[PARTS[p][1]])
        )
        assert text.endswith("\n\n\n" + expected + "\n"), path


def test_flagged_parts_are_in_some_module_and_left_out_of_another() -> None:
    texts = [p.read_text() for p in sorted((ROOT / "generated").glob("*/*prefill*.py"))]
    for part in ("tma", "gluon", "plans", "prefill_plans"):
        marker = f"{MARKER} attngen/host/{part}.py"
        assert any(marker in t for t in texts) and not all(marker in t for t in texts), part


# -- TMA --------------------------------------------------------------------------------------
def test_tma_layout_problems_name_the_tensor_and_the_reason() -> None:
    k = torch.zeros(1, 2, 8, D, dtype=torch.float16)
    assert tma.kv_load_path(k, k) == "tma"
    assert tma._tma_layout_fits(k, k) and tma._uses_tma(k, k)
    assert tma._tma_layout_problem("k", (1, 2, 0, D), (0, 0, D, 1)) == "k has no keys"
    strided = torch.zeros(1, 2, 8, 2 * D, dtype=torch.float16)[..., ::2]
    assert tma.kv_load_path(k, strided) == "pointers: v head-dim stride is 2, not 1"
    assert not tma._tma_layout_fits(k, strided)
    odd = torch.zeros(1, 2, 8, D + 1, dtype=torch.float16)[..., :D]
    assert tma.kv_load_path(odd, k).startswith("pointers: k strides (1040, 520, 65, 1) are not")
    shifted = torch.zeros(1 + 2 * 8 * D, dtype=torch.float16)[1:].view(1, 2, 8, D)
    assert tma.kv_load_path(shifted, k) == "pointers: k base address is not 16-byte aligned"
    assert not tma._uses_tma(shifted, k)


def test_descriptor_checked_once_per_block_then_filled_in(monkeypatch) -> None:
    monkeypatch.setattr(tma, "_CHECKED_BLOCKS", set())
    monkeypatch.setattr(tma, "_FAST_LAUNCH", True)
    k = torch.zeros(1, 2, 8, D, dtype=torch.float16)
    first = tma._descriptor(k, (1, 1, 8, D))
    second = tma._descriptor(k.transpose(1, 2).transpose(1, 2), (1, 1, 8, D))
    assert type(first) is type(second) and tma._CHECKED_BLOCKS == {(1, 1, 8, D)}
    assert first.base is k and second.base is not k
    for name in ("shape", "strides", "block_shape", "padding"):
        assert getattr(first, name) == getattr(second, name), name


# -- call plans -------------------------------------------------------------------------------
def test_remembered_plans_start_over_when_full(monkeypatch) -> None:
    monkeypatch.setattr(plans, "_CALL_PLANS", {})
    monkeypatch.setattr(plans, "_LAUNCH_CACHE_SIZE", 2)
    for key in range(3):
        plans._remember_plan((key,), key)
    assert plans._CALL_PLANS == {(2,): 2}


def test_prefill_call_key_is_the_layout_of_plain_calls(monkeypatch) -> None:
    monkeypatch.setattr(prefill_plans, "_FAST_LAUNCH", True)
    q, k, v = _qkv()
    key = prefill_plans._call_key(q, k, v, None, None, False, None)
    assert key == prefill_plans._call_key(*_qkv(), None, None, False, None)
    assert key != prefill_plans._call_key(q, k, v, 0.5, None, False, None)
    assert prefill_plans._call_key(q, k, v, 1, None, False, None) is None  # an int scale
    assert prefill_plans._call_key(q, k, v, None, q, False, None) is None  # slopes
    assert prefill_plans._call_key(q, k, v, None, None, False, []) is None  # out= not a tensor
    monkeypatch.setattr(prefill_plans, "_FAST_LAUNCH", False)
    assert prefill_plans._call_key(q, k, v, None, None, False, None) is None


def _prefill_plan(**fields):
    fields = {
        "config": {"BLOCK_N": 8},
        "longest": 8,
        "grid": 4,
        "ints": (3, 5),
        "qk_scale": 0.5,
        "tail": (0.5, None, None),
        "constexprs": {False: {"USE_TMA": False}, True: {"USE_TMA": True}},
        "options": {"num_warps": 4},
        "out_shape": (2, 4, 8, D),
        "lse_shape": (2, 4, 8),
        **fields,
    }
    return prefill_plans._CallPlan(**fields)


def test_prefill_plan_launches_as_the_full_path_did(monkeypatch) -> None:
    launches = []
    monkeypatch.setattr(prefill_plans, "config_for", lambda longest: {"BLOCK_N": 8})
    monkeypatch.setattr(prefill_plans, "_attn_fwd_kernel", "kernel")
    monkeypatch.setattr(prefill_plans, "_launch", lambda *a: launches.append(a))
    monkeypatch.setattr(prefill_plans, "_descriptor", lambda t, block: ("desc", t.shape, block))
    q, k, v = _qkv()
    out, lse = prefill_plans._run_plan(_prefill_plan(pads=4), q, k, v, None)
    assert out.shape == (2, 4, 8, D) and lse.shape == (2, 4, 8) and lse.dtype == torch.float32
    ((kernel, grid, device, tensors, ints, tail, constexprs, options),) = launches
    assert (kernel, grid, device, ints, tail) == ("kernel", 4, -1, (3, 5), (0.5, None, None))
    assert all(t is x for t, x in zip(tensors, (q, k, v, out, lse, out, q, q, q, q), strict=True))
    assert (constexprs, options) == ({"USE_TMA": False}, {"num_warps": 4})
    # TMA blocks: the descriptors of the [B, H, N, D] views of flash-layout k and v
    flash = _prefill_plan(tma=(1, (1, 1, 8, D), (1, 1, 8, D)), flash=True)
    kf, vf = k.transpose(1, 2), v.transpose(1, 2)
    prefill_plans._run_plan(flash, q, kf, vf, None)
    assert launches[-1][5] == (
        0.5,
        ("desc", k.shape, (1, 1, 8, D)),
        ("desc", v.shape, (1, 1, 8, D)),
    )
    assert launches[-1][6] == {"USE_TMA": True}
    # a config that autotune has changed since: the full path runs
    monkeypatch.setattr(prefill_plans, "config_for", lambda longest: {"BLOCK_N": 16})
    assert prefill_plans._run_plan(_prefill_plan(), q, k, v, None) is None


def test_prefill_plan_checks_an_out_sharing_memory_with_an_input(monkeypatch) -> None:
    monkeypatch.setattr(prefill_plans, "config_for", lambda longest: {"BLOCK_N": 8})
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="out: shares memory with q"):
        prefill_plans._run_plan(_prefill_plan(), q, k, v, q)


def test_prefill_plan_runs_the_compiled_launcher_directly(monkeypatch) -> None:
    runs = []
    monkeypatch.setattr(prefill_plans, "config_for", lambda longest: {"BLOCK_N": 8})
    monkeypatch.setattr(prefill_plans, "_launch", lambda *a: (lambda *b: runs.append(b), ("p",)))
    monkeypatch.setattr(prefill_plans, "_runs_directly", lambda kernel: True)
    monkeypatch.setattr(prefill_plans, "_DRIVER", [lambda: -1, lambda device: "stream"])
    q, k, v = _qkv()
    plan = _prefill_plan(lse_shape=None, pads=2)
    prefill_plans._run_plan(plan, q, k, v, None)  # first: through _launch, runner remembered
    assert len(plan.compiled) == 1 and not runs
    out, lse = prefill_plans._run_plan(plan, q, k, v, None)
    addresses = [t.data_ptr() for t in (q, k, v, out, out, out, q, q)]
    assert lse is None and runs == [(4, 1, 1, "stream", "p", *addresses, 3, 5, 0.5, None, None,
                                     False)]  # fmt: skip


def test_heads_last_plan_keeps_the_launch_with_its_own_output(monkeypatch) -> None:
    plan = _prefill_plan(gluon=("launch", None), pads=4)
    plan.compiled[("slot",)] = "runner"
    kept = {}
    monkeypatch.setattr(prefill_plans, "_CALL_PLANS", {"views": plan})
    prefill_plans._keep_flash_plan(kept, "key", "views", True, (2, 8, 4, D))
    flash = kept["key"]
    assert flash.flash and flash.out_shape == (2, 8, 4, D) and not flash.compiled
    assert (flash.ints, flash.gluon, flash.pads, flash.tail) == (
        plan.ints,
        plan.gluon,
        4,
        plan.tail,
    )
    prefill_plans._keep_flash_plan(kept, "other", "unknown views", True, (2, 8, 4, D))
    assert "other" not in kept


def test_varlen_plan_key_and_launch(monkeypatch) -> None:
    monkeypatch.setattr(varlen_plans, "_FAST_LAUNCH", True)
    monkeypatch.setattr(varlen_plans, "config_for", lambda longest: {"BLOCK_M": 16})
    steps = []
    monkeypatch.setattr(varlen_plans, "_run_step", lambda *a: steps.append(a))
    q = torch.zeros(5, 2, D)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    args = (q, q, q, cu, cu, 3, 3, None, None, True, None, None)
    assert varlen_plans._call_key(*args) == varlen_plans._call_key(*args)
    assert varlen_plans._call_key(*args[:5], 3.0, *args[6:]) is None  # a float length
    plan = ({"BLOCK_M": 16}, 3, (5, 2, D), (2, 5), "step", None)  # no Gluon forward: None
    out, lse = varlen_plans._run_plan(plan, q, q, q, cu, cu, 3, None, None)
    assert out.shape == (5, 2, D) and lse.shape == (2, 5)
    ((step, device, tensors),) = steps
    assert (step, device) == ("step", -1)
    assert all(a is b for a, b in zip(tensors, (q, q, q, out, lse, out, cu, cu, cu), strict=True))
    monkeypatch.setattr(varlen_plans, "_checked", lambda: True)
    with pytest.raises(ValueError, match="more than max_seqlen_q = 2"):
        varlen_plans._run_plan(plan, q, q, q, cu, cu, 2, None, None)
    assert (
        varlen_plans._run_plan(({"BLOCK_M": 32}, *plan[1:]), q, q, q, cu, cu, 3, None, None) is None
    )


# -- the Gluon forward's host side ------------------------------------------------------------
def test_gluon_layout_refuses_under_the_interpreter_and_small_launches(monkeypatch) -> None:
    monkeypatch.setattr(gluon, "_GLUON_PLANS", {})
    monkeypatch.setattr(gluon, "_INTERPRET", True)
    q, k, v = _qkv()
    assert gluon._gluon_layout(q, k, v, q, False) == (None, gluon._INTERPRETED)
    monkeypatch.setattr(gluon, "_GLUON_PLANS", {})
    monkeypatch.setattr(gluon, "_INTERPRET", False)
    monkeypatch.setattr(gluon, "POINTER_LOADS_UP_TO", 512)
    launch, why = gluon._gluon_layout(q, k, v, q, False)
    assert launch is None and why.startswith("a launch of at most 512 (CTA, key block) pairs")


def test_gluon_layout_gives_the_launch_and_its_descriptors(monkeypatch) -> None:
    monkeypatch.setattr(gluon, "_GLUON_PLANS", {})
    monkeypatch.setattr(gluon, "_INTERPRET", False)
    monkeypatch.setattr(gluon, "_GLUON_CONSTEXPRS", ({"STORE_LSE": False}, {"STORE_LSE": True}))
    q, k, v = _qkv()
    q = torch.zeros(2, 4, 300, D, dtype=torch.float16)  # 3 CTAs of 128 rows per head
    (grid, ints, constexprs, descs), why = gluon._gluon_layout(q, k, v, q, True)
    assert why is None and grid == 3 * 2 * 4 and constexprs == {"STORE_LSE": True}
    assert ints == (300, 8, 4, 2, 8 - 300, 3)  # _GLUON_DIAG: counted from the keys' end
    shape, strides, block, _ = descs[1]
    assert (shape, strides, block) == ([2, 8, 2, D], [1024, D, 512, 1], [1, 128, 1, D])
    assert (
        gluon._gluon_layout(q, k, v, q, True) is gluon._GLUON_PLANS[next(iter(gluon._GLUON_PLANS))]
    )


def test_gluon_why_records_the_reason_for_forward_path() -> None:
    q, k, v = _qkv()
    assert gluon._gluon_why(("launch", None), q, k, v, q) is None
    assert gluon._gluon_why((None, "a reason"), q, k, v, q) == "a reason"
    assert gluon.forward_path() == "tile-level: a reason"
    shifted = torch.zeros(1 + q.numel(), dtype=q.dtype)[1:].view(q.shape)
    assert gluon._gluon_why(("launch", None), shifted, k, v, q) == (
        "a base address is not 16-byte aligned"
    )


def test_transposed_lists_are_kept_while_the_block_mask_is_unchanged() -> None:
    """The dK/dV kernel's lists of one block mask are computed once while its tensors stay
    the same and unchanged (a model's layers share a mask); an in-place change or other heads
    recompute them, and inference tensors (no version counter) are never kept."""
    from attngen.host import expressions

    counts = torch.tensor([[[2, 1]]], dtype=torch.int32)
    indices = torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32)
    mask = (counts, indices, None, None, 128, 128)
    q, k = torch.zeros(1, 2, 256, D), torch.zeros(1, 1, 256, D)
    first = expressions._transposed_block_mask(mask, q, k)
    assert expressions._transposed_block_mask(mask, q, k) is first
    indices[0, 0, 1, 0] = 0  # in place: the second q-block now lists key block 0
    again = expressions._transposed_block_mask(mask, q, k)
    assert again is not first and again[0][0].tolist() != first[0][0].tolist()
    assert again[0][0].tolist() == expressions._transposed_lists(mask, q, k)[0][0].tolist()
    assert expressions._transposed_block_mask(mask, q, q) is not again  # MHA: another group
    with torch.inference_mode():
        frozen = (counts.clone(), indices.clone(), None, None, 128, 128)
    kept = expressions._transposed_block_mask(frozen, q, k)
    assert expressions._transposed_block_mask(frozen, q, k) is not kept
