"""The generated modules' cached launcher, on the CPU: its key against Triton's own
specialization, and the launches it makes.

On a GPU a module's launch goes through `kernel[grid]` the first time a specialization is
seen and through the compiled kernel's launcher after that. Under the interpreter the modules
always take `kernel[grid]`, so these tests switch the cached path on and stand a fake in for
each @triton.jit kernel: `kernel[grid](...)` computes Triton's specialization of the arguments
(triton's own `native_specialize_impl`, the function its binder calls) and hands back one fake
compiled kernel per specialization; a compiled kernel's `run` checks that the arguments it is
launched with have its specialization. A key that missed anything Triton specializes on would
launch a kernel compiled for other arguments, and fail there.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import re
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.tools.tensor_descriptor import TensorDescriptor

from attngen.tiling.code_paths import POINTER_LOADS_UP_TO
from tests.decode_harness import load_decode, make_cache, make_decode_spec, make_queries
from tests.kernel_harness import load_kernel, make_spec

PREFILL = make_spec(name="fl", dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)
VARLEN = make_spec(
    name="flv", dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2, kernels=["varlen"]
)
DECODE = make_decode_spec(
    "contiguous",
    None,
    name="fld",
    dtype="fp16",
    head_dim=64,
    num_q_heads=4,
    num_kv_heads=2,
    max_query_tokens=2,
)


def triton_specialization(params, args, options):
    """What Triton's binder makes of these arguments (all parameters, in order)."""
    spec = tuple(
        ("constexpr", a)
        if p.is_constexpr
        else native_specialize_impl(BaseBackend, a, False, True, True)
        for p, a in zip(params, args, strict=True)
    )
    return spec, tuple(sorted(options.items()))


class FakeCompiled:
    def __init__(self, kernel, key):
        self.kernel, self.key = kernel, key
        self.function, self.packed_metadata, self.runs = object(), object(), []

    def run(
        self,
        grid_0,
        grid_1,
        grid_2,
        stream,
        function,
        metadata,
        launch_metadata,
        enter_hook,
        exit_hook,
        *args,
    ):
        assert (function, metadata, stream) == (self.function, self.packed_metadata, "stream")
        assert (grid_1, grid_2, launch_metadata, enter_hook, exit_hook) == (1, 1, None, None, None)
        bound = self.key[0]
        # A direct launch passes each pointer as the tensor's address (an int): it specializes
        # as the bound tensor did when its 16-byte alignment is the same.
        assert all(
            type(a) is int for a, b in zip(args, bound, strict=True) if b[0].startswith("*")
        ), "a direct launch passes addresses, not tensors"
        spec, _ = triton_specialization(
            self.kernel.params,
            [0 if b[0].startswith("*") else a for a, b in zip(args, bound, strict=True)],
            {},
        )
        spec = tuple(
            (b[0], "D" if a & 15 == 0 else "") if b[0].startswith("*") else s
            for a, b, s in zip(args, bound, spec, strict=True)
        )
        assert spec == bound, "launched a kernel compiled for another specialization"
        ran = [
            Address(a, b[0]) if b[0].startswith("*") else a
            for a, b in zip(args, bound, strict=True)
        ]
        self.runs.append((grid_0, ran))


class Address:
    """A pointer argument of a direct launch: the tensor's address, and the pointer type the
    compiled kernel has there (its dtype, '*fp16'); data_ptr() as a tensor's."""

    __slots__ = ("address", "dtype")

    def __init__(self, address, dtype):
        self.address, self.dtype = address, dtype

    def data_ptr(self):
        return self.address


class FakeKernel:
    """A @triton.jit kernel's stand-in: `kernel[grid](...)` records the call and returns the
    compiled kernel of Triton's specialization of its arguments (one per specialization)."""

    def __init__(self, real):
        self.fn = real.fn
        self.params = [
            SimpleNamespace(name=name, is_constexpr=p.annotation is tl.constexpr)
            for name, p in inspect.signature(real.fn).parameters.items()
        ]
        self.pre_run_hooks: list = []
        self.compiled: dict = {}
        self.bound: list = []  # (grid, all arguments in order, compiled) per kernel[grid] call

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = {p.name for p in self.params}
            options = {k: v for k, v in kwargs.items() if k not in names}
            ordered = list(args) + [kwargs[p.name] for p in self.params[len(args) :]]
            key = triton_specialization(self.params, ordered, options)
            compiled = self.compiled.setdefault(key, FakeCompiled(self, key))
            self.bound.append((grid[0], ordered, compiled))
            return compiled

        return launch

    def launches(self):
        """Every launch in order: ("bound" | "run", grid, args, compiled)."""
        runs = [("run", g, a, c) for c in self.compiled.values() for g, a in c.runs]
        return [("bound", g, a, c) for g, a, c in self.bound], runs


def fast(monkeypatch, module, *kernel_names):
    """Switch the module's cached launches on, with fakes for the named kernels."""
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)
    monkeypatch.setattr(module, "_DRIVER", [lambda: -1, lambda device: "stream"])
    monkeypatch.setattr(module, "_LAUNCH_CACHE", {})
    monkeypatch.setattr(module, "_EXACT_LAUNCHES", {})
    fakes = []
    for name in kernel_names:
        fake = FakeKernel(getattr(module, name))
        monkeypatch.setattr(module, name, fake)
        fakes.append(fake)
    return fakes


def described(args):
    """Arguments as comparable values: tensors by dtype, shape and strides (outputs are new at
    each call), descriptors by their fields, the rest as they are."""

    def one(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", a.dtype, tuple(a.shape), a.stride())
        if isinstance(a, Address):  # a direct launch's pointer: made anew at each call or not
            return ("address", a.dtype, a.address & 15 == 0)
        if isinstance(a, TensorDescriptor):
            return ("desc", one(a.base), list(a.shape), list(a.strides), list(a.block_shape))
        return a

    return [one(a) for a in args]


def same_launch(run_args, bound_args, inputs=()):
    """A direct launch's arguments are what kernel[grid] was given: the tensors' addresses
    where it had tensors (the very address for a tensor among `inputs`, the same in both
    calls; the same 16-byte alignment for one made anew at each call, an output), the rest
    described alike."""
    assert len(run_args) == len(bound_args)
    for ran, bound in zip(run_args, bound_args, strict=True):
        if isinstance(bound, torch.Tensor):
            assert isinstance(ran, Address), "a direct launch passes addresses"
            if any(bound is t for t in inputs):
                assert ran.address == bound.data_ptr()
            else:
                assert (ran.address & 15 == 0) == (bound.data_ptr() & 15 == 0)
        else:
            assert described([ran]) == described([bound])
    return True


def fp16(*shape, offset=0):
    """A random fp16 tensor; offset elements into its storage (2 bytes each: misaligned)."""
    flat = torch.randn(offset + int(torch.tensor(shape).prod()), dtype=torch.float16)
    return flat[offset:].view(*shape)


# ------------------------------------------------------------------- the key itself


def test_equal_keys_mean_equal_triton_specializations():
    """_specialization over every combination of argument values at the edges Triton
    specializes on (int == 1, % 16, the i32/i64 boundary; pointer alignment and dtype;
    floats, None and TMA descriptors; constexprs; options): equal keys only where Triton's
    specializations are equal, and different keys wherever Triton's differ, value by value."""
    module = load_kernel(PREFILL)
    aligned, misaligned = fp16(4, 16), fp16(4, 16, offset=1)
    wide = torch.zeros(4, 16)
    descs = [
        TensorDescriptor(t, [4, 16], [16, 1], block)
        for t, block in ((aligned, [2, 16]), (aligned, [4, 16]), (wide, [4, 16]))
    ]
    tensors = [aligned, misaligned, wide]
    ints = [0, 1, 2, 15, 16, 17, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40 + 1]
    tails = [1.0, None, *descs]
    constexprs = [{"BLOCK": 16}, {"BLOCK": 32}, {"BLOCK": True}]
    options = [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 4, "num_stages": 2}]
    params = [SimpleNamespace(is_constexpr=c) for c in (False, False, False, True)]
    cases = list(itertools.product(tensors, ints, tails, constexprs, options))
    keys, specs = {}, {}
    for tensor, n, tail, constexpr, option in cases:
        case = (id(tensor), n, id(tail), tuple(constexpr.items()), tuple(option.items()))
        keys[case] = module._specialization(None, 0, (tensor,), (n,), (tail,), constexpr, option)
        specs[case] = triton_specialization(params, [tensor, n, tail, constexpr["BLOCK"]], option)
    for a, b in itertools.combinations(keys, 2):
        if keys[a] == keys[b]:
            assert specs[a] == specs[b], (a, b)
    # Each change Triton specializes on, alone, changes the key (no collapsed classes).
    for a, b in itertools.combinations(keys, 2):
        differing = [i for i in range(5) if a[i] != b[i]]
        if len(differing) == 1 and specs[a] != specs[b]:
            assert keys[a] != keys[b], (a, b)


def test_key_includes_the_kernel_the_device_and_triton_debug(monkeypatch):
    module = load_kernel(PREFILL)
    args = ((fp16(4, 16),), (16,), (1.0,), {"B": 1}, {"num_warps": 4})
    base = module._specialization("kernel", 0, *args)
    assert base != module._specialization("other kernel", 0, *args)
    assert base != module._specialization("kernel", 1, *args)
    monkeypatch.setattr(triton.knobs.runtime, "debug", not triton.knobs.runtime.debug)
    assert base != module._specialization("kernel", 0, *args)


# ------------------------------------------------------------------- launches


def test_prefill_launches_bind_once_per_specialization_then_run_directly(monkeypatch):
    """The second call of each kind runs the compiled kernel directly with exactly the
    arguments kernel[grid] was given; each change Triton specializes on binds again and gets
    the compiled kernel of its own specialization."""
    module = load_kernel(PREFILL)
    (fake,) = fast(monkeypatch, module, "_attn_fwd_kernel")
    q, k, v = fp16(2, 4, 64, 64), fp16(2, 2, 64, 64), fp16(2, 2, 64, 64)
    calls = {
        "base": lambda: module.attention(q, k, v),
        "int % 16 (65 keys)": lambda: module.attention(q, fp16(2, 2, 65, 64), fp16(2, 2, 65, 64)),
        "int == 1 (q heads per kv head)": lambda: module.attention(
            q, fp16(2, 4, 64, 64), fp16(2, 4, 64, 64)
        ),
        "constexpr and LSE dtype": lambda: module.attention(q, k, v, return_lse=True),
        "pointer alignment": lambda: module.attention(fp16(2, 4, 64, 64, offset=1), k, v),
        "pointers instead of TMA": lambda: module.attention(q, fp16(2, 2, 64, 128)[..., ::2], v),
    }
    seen = []
    for name, call in calls.items():
        before = len(fake.bound)
        call()
        assert len(fake.bound) == before + 1, f"{name}: first call binds"
        compiled = fake.bound[-1][2]
        assert compiled not in seen, f"{name}: Triton specializes it apart"
        seen.append(compiled)
        call()
        assert len(fake.bound) == before + 1, f"{name}: second call runs directly"
        grid, args = compiled.runs[-1]
        assert grid == fake.bound[-1][0] and same_launch(args, fake.bound[-1][1], (q, k, v))
    monkeypatch.setitem(module.CONFIG, "num_warps", module.CONFIG["num_warps"] * 2)
    before = len(fake.bound)
    calls["base"]()
    assert len(fake.bound) == before + 1 and fake.bound[-1][2] not in seen  # an option


def test_a_launch_hook_or_the_interpreter_always_binds(monkeypatch):
    module = load_kernel(PREFILL)
    (fake,) = fast(monkeypatch, module, "_attn_fwd_kernel")
    q, k, v = fp16(1, 4, 16, 64), fp16(1, 2, 16, 64), fp16(1, 2, 16, 64)
    for hooks in ("launch_enter_hook", "launch_exit_hook"):
        chain, hook = getattr(triton.knobs.runtime, hooks), lambda metadata: None
        chain.add(hook)
        try:
            module.attention(q, k, v)
            module.attention(q, k, v)
        finally:
            chain.remove(hook)
    assert len(fake.bound) == 4 and not any(c.runs for c in fake.compiled.values())
    module.attention(q, k, v)
    assert len(fake.bound) == 5
    module.attention(q, k, v)
    assert len(fake.bound) == 5  # no hook: run directly
    monkeypatch.setattr(module, "_FAST_LAUNCH", False)
    module.attention(q, k, v)
    assert len(fake.bound) == 6


def test_parameters_out_of_the_launch_order_are_refused(monkeypatch):
    """The launcher passes arguments by position: a kernel whose constexprs are not last (or
    not the ones named) must not be cached."""
    module = load_kernel(PREFILL)
    (fake,) = fast(monkeypatch, module, "_attn_fwd_kernel")
    fake.params[-1], fake.params[-2] = fake.params[-2], fake.params[-1]
    with pytest.raises(RuntimeError, match="rebuild the module"):
        module.attention(fp16(1, 4, 16, 64), fp16(1, 2, 16, 64), fp16(1, 2, 16, 64))


def test_varlen_launch_runs_directly_with_the_bound_arguments(monkeypatch):
    module = load_kernel(VARLEN, kind="varlen")
    (fake,) = fast(monkeypatch, module, "_attn_fwd_kernel")
    q, k = fp16(48, 4, 64), fp16(48, 2, 64)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    for _ in range(2):
        module.attention_varlen(q, k, k, cu, cu, 23, 23)
    ((grid, bound, compiled),) = fake.bound
    ((run_grid, run_args),) = compiled.runs
    assert run_grid == grid and same_launch(run_args, bound, (q, k, cu))
    module.attention_varlen(q[:40], k[:40], k[:40], cu, cu, 23, 23)  # 40 rows: not % 16
    assert len(fake.bound) == 2


def test_decode_launches_append_split_and_combine_directly(monkeypatch):
    module = load_decode(DECODE)
    fakes = fast(
        monkeypatch, module, "_append_kernel", "_decode_split_kernel", "_decode_combine_kernel"
    )
    monkeypatch.setattr(module, "FORCE_NUM_SPLITS", 2)
    cache = make_cache(DECODE, [5, 9], seed=1, room=2, extra_capacity=300)
    q, k_new, v_new, _ = make_queries(DECODE, 2, 2, seed=2, num_new=2)
    for _ in range(2):
        module.decode(q, cache.k, cache.v, cache.lengths, k_new=k_new, v_new=v_new)
    for fake in fakes:
        ((grid, bound, compiled),) = fake.bound
        ((run_grid, run_args),) = compiled.runs
        inputs = (q, cache.k, cache.v, cache.lengths, k_new, v_new)
        assert run_grid == grid and same_launch(run_args, bound, inputs), fake.fn.__name__


def test_direct_launches_call_the_c_launcher_only_where_its_arguments_are_known(monkeypatch):
    """A compiled kernel's _runner: Triton 3.6's C launcher with the fixed arguments its
    CudaLauncher passes, where the kernel needs no scratch memory; otherwise (scratch, another
    launcher, another Triton) the compiled kernel's launcher itself."""
    module = load_kernel(PREFILL)

    class CudaLauncher:  # Triton's launcher class, as _runner knows it by name
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def launch(self, *args):
            pass

        def __call__(self, *args):
            pass

    compiled = SimpleNamespace(run=CudaLauncher(), function="fn", packed_metadata="meta")
    monkeypatch.setattr(module, "_C_LAUNCHER", True)
    launch, prefix = module._runner(compiled)
    assert launch == compiled.run.launch
    assert prefix == ("fn", False, True, None, None, "meta", None, None, None)
    by_launcher = (compiled.run, ("fn", "meta", None, None, None))
    compiled.run.profile_scratch_size = 64
    assert module._runner(compiled) == by_launcher
    compiled.run.profile_scratch_size = 0
    monkeypatch.setattr(module, "_C_LAUNCHER", False)
    assert module._runner(compiled) == by_launcher


def test_the_c_launcher_takes_the_arguments_runner_passes():
    """Where _C_LAUNCHER holds (this Triton), its C launcher parses grid, stream, function,
    the cooperative and PDL flags, the two scratch buffers, the kernel's metadata, the launch
    metadata and the two hooks, then the kernel's arguments, and CudaLauncher passes them so."""
    from triton.backends.nvidia.driver import CudaLauncher, make_launcher

    module = load_kernel(PREFILL)
    assert module._C_LAUNCHER == (triton.__version__.split(".")[:2] == ["3", "6"])
    if not module._C_LAUNCHER:
        return  # another Triton: _runner takes the compiled kernel's launcher
    source = make_launcher({}, {0: "*fp16", 1: "i32"}, None)
    parsed = re.search(r'PyArg_ParseTuple\(args, "[^"]*",(.*?)\)\)', source, re.S)
    assert [a.strip().lstrip("&") for a in parsed.group(1).split(",")] == [
        "gridX", "gridY", "gridZ", "_stream", "_function", "launch_cooperative_grid",
        "launch_pdl", "global_scratch_obj", "profile_scratch_obj", "kernel_metadata",
        "launch_metadata", "launch_enter_hook", "launch_exit_hook", "_arg0", "_arg1",
    ]  # fmt: skip
    call = " ".join(inspect.getsource(CudaLauncher.__call__).split())
    assert (
        "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, "
        "self.launch_pdl, global_scratch, profile_scratch, *args)" in call
    )
    assert "return launcher(*final_args)" in inspect.getsource(
        importlib.import_module("triton.backends.nvidia.driver").wrap_handle_tensordesc
    )


# ------------------------------------------------------------------- TMA descriptors


def test_descriptors_filled_directly_equal_checked_ones(monkeypatch):
    module = load_kernel(PREFILL)
    assert hasattr(module, "_descriptor"), "PREFILL must render a TMA (sm90) module"
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)
    monkeypatch.setattr(module, "_CHECKED_BLOCKS", set())
    k = fp16(2, 2, 64, 128)[..., :64]
    first = module._descriptor(k, (1, 1, 32, 64))  # checked: the block shape is new
    second = module._descriptor(k, (1, 1, 32, 64))
    expected = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, 32, 64])
    for descriptor in (first, second):
        assert descriptor == expected and descriptor.base is k
    with pytest.raises(ValueError, match="power of 2"):  # a bad block shape, caught when new
        module._descriptor(k, (1, 1, 24, 64))


def test_tma_decision_is_remembered_per_layout_but_reads_each_base_address():
    module = load_kernel(PREFILL)
    assert hasattr(module, "_uses_tma"), "PREFILL must render a TMA (sm90) module"
    k, v = fp16(1, 2, 32, 64), fp16(1, 2, 32, 64)
    assert module._uses_tma(k, v) and module.kv_load_path(k, v) == "tma"
    shifted = fp16(1, 2, 32, 64, offset=1)  # same layout, base 2 bytes off
    assert not module._uses_tma(shifted, v)
    assert module.kv_load_path(shifted, v) == "pointers: k base address is not 16-byte aligned"
    strided = fp16(1, 2, 32, 128)[..., ::2]
    assert not module._uses_tma(k, strided) and module.kv_load_path(k, strided).startswith(
        "pointers: v head-dim stride is 2"
    )


def test_small_launches_read_kv_by_pointers_and_larger_ones_by_tma(monkeypatch):
    """As on a GPU (POINTER_LOADS_UP_TO as code_paths sets it; 0 under the interpreter): a
    launch of at most that many (program, key block) pairs passes USE_TMA False and no
    descriptors, one program more passes descriptors; the two paths give equal outputs."""
    module = load_kernel(PREFILL)
    assert module.POINTER_LOADS_UP_TO == 0  # the interpreter keeps testing the TMA path
    block_m, block_n = module.CONFIG["BLOCK_M"], module.CONFIG["BLOCK_N"]
    q, k = fp16(1, 4, block_m, 64), fp16(1, 2, block_n, 64)
    by_tma = module.attention(q, k, k, return_lse=True)
    monkeypatch.setattr(module, "POINTER_LOADS_UP_TO", POINTER_LOADS_UP_TO)
    by_pointers = module.attention(q, k, k, return_lse=True)  # 4 pairs: pointers
    assert all(torch.equal(a, b) for a, b in zip(by_tma, by_pointers, strict=True))
    (fake,) = fast(monkeypatch, module, "_attn_fwd_kernel")
    use_tma = [p.name for p in fake.params].index("USE_TMA")
    batch = POINTER_LOADS_UP_TO // 4  # 4 q heads, one query block, one key block each
    for programs in (batch, batch + 1):
        q, k = fp16(programs, 4, block_m, 64), fp16(programs, 2, block_n, 64)
        module.attention(q, k, k)
        args = fake.bound[-1][1]
        small = programs * 4 <= POINTER_LOADS_UP_TO
        assert args[use_tma] is not small, f"{programs * 4} pairs"
        assert any(isinstance(a, TensorDescriptor) for a in args) is not small


# ------------------------------------------------------------------- call plans


# A score_mod without tensors keeps call plans: its launches pass q as the four block-mask
# pointers (the plan's pads).
EXPRESSION = make_spec(
    name="fle", dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2, score_mod="score * 2"
)


@pytest.mark.parametrize("spec", [PREFILL, EXPRESSION], ids=["prefill", "score_mod"])
def test_call_plans_launch_what_the_full_path_launches(monkeypatch, spec):
    """From a layout's second call, attention() runs from the layout's plan: its launches are
    the full path's (the same compiled kernel, grid and arguments) for every option, out=,
    alignment, load path and TMA threshold."""
    module = load_kernel(spec)
    fast(monkeypatch, module, "_attn_fwd_kernel")
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    log, run = [], FakeCompiled.run
    q, k, v = fp16(2, 4, 64, 64), fp16(2, 2, 64, 64), fp16(2, 2, 64, 64)
    out = fp16(2, 64, 4, 64).transpose(1, 2)
    stable = {t.data_ptr(): name for name, t in (("q", q), ("k", k), ("v", v), ("out", out))}

    def logged(self, *args):
        run(self, *args)
        grid, ran = self.runs[-1]
        # addresses: the tensors' own where they are the same in every call, else (outputs
        # made anew) their alignment
        ran = [stable.get(a.address, a) if isinstance(a, Address) else a for a in ran]
        log.append((self, grid, described(ran)))

    monkeypatch.setattr(FakeCompiled, "run", logged)
    calls = {
        "base": lambda: module.attention(q, k, v),
        "scale, lse": lambda: module.attention(q, k, v, sm_scale=0.5, return_lse=True),
        "out=": lambda: module.attention(q, k, v, out=out),
        "misaligned q": lambda: module.attention(fp16(2, 4, 64, 64, offset=1), k, v),
        "misaligned out=": lambda: module.attention(
            q, k, v, out=fp16(2, 64, 4, 64, offset=1).transpose(1, 2)
        ),
        "pointers (layout)": lambda: module.attention(q, fp16(2, 2, 64, 128)[..., ::2], v),
    }
    for threshold in (0, POINTER_LOADS_UP_TO):
        monkeypatch.setattr(module, "POINTER_LOADS_UP_TO", threshold)
        for name, call in calls.items():
            with monkeypatch.context() as unplanned:
                unplanned.setattr(module, "_call_key", lambda *args, **keywords: None)
                call(), call()
            expected = log[-1]
            for _ in range(3):  # the plan's first launch through _launch, then its own
                call()
                assert log[-1] == expected, f"{name}, threshold {threshold}"
    assert module._CALL_PLANS and all(plan.compiled for plan in module._CALL_PLANS.values())
    assert {plan.pads for plan in module._CALL_PLANS.values()} == {4 if spec is EXPRESSION else 0}


def test_a_planned_layout_still_refuses_out_sharing_memory(monkeypatch):
    module = load_kernel(PREFILL)
    fast(monkeypatch, module, "_attn_fwd_kernel")
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    size = 2 * 4 * 64 * 64
    q, k = fp16(2, 4, 64, 64), fp16(2, 2, 64, 64)
    for _ in range(3):
        module.attention(q, k, k, out=fp16(2, 64, 4, 64).transpose(1, 2))
    (plan,) = module._CALL_PLANS.values()
    assert plan.compiled
    storage = fp16(2 * size)
    q_shared = storage[:size].view(2, 4, 64, 64)
    out_shared = storage[size:].view(2, 64, 4, 64).transpose(1, 2)  # the planned layout
    with pytest.raises(ValueError, match="out: shares memory with q"):
        module.attention(q_shared, k, k, out=out_shared)
    storage = fp16(k.numel() + size)
    k_shared = storage[: k.numel()].view(k.shape)
    out_shared = storage[k.numel() :].view(2, 64, 4, 64).transpose(1, 2)
    with pytest.raises(ValueError, match="out: shares memory with k"):
        module.attention(q, k_shared, k_shared, out=out_shared)
