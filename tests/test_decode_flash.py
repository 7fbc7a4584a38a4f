"""The decode modules' entry points in flash-attn's layout, `decode_flash` (q [B, NQ, HQ, D],
contiguous caches [B, L, HKV, D], new keys [B, NNEW, HKV, D]; out [B, NQ, HQ, DV]) and
`decode_flash_out` (decode()'s tensors, out [B, NQ, HQ, DV]), on the CPU: bit for bit decode()
on the [B, H, N, D] views (output, LSE and appended caches, with the real kernels under the
interpreter), the same launches from their plans (growing caches too), their errors named in
the caller's layout; and the public functions that reach them (flash_attn_with_kvcache, the
transformers decode step) with no view of their own, modules built before them keeping
their route."""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.runtime import ops
from attngen.runtime.hf import attngen_attention
from attngen.runtime.hf_cache import CacheLengths
from attngen.runtime.registry import current_registry
from tests.decode_harness import (
    count_plan_hits,
    load_decode,
    make_cache,
    make_decode_spec,
    same_bits,
)
from tests.ondemand_harness import on_demand  # noqa: F401
from tests.test_decode_plans import KERNELS, PAGED
from tests.test_decode_rotary import rotary_tables
from tests.test_fast_launch import DECODE, FakeCompiled, fast, fp16

ROTARY = make_decode_spec(
    "contiguous",
    None,
    name="fldr",
    dtype="fp16",
    head_dim=64,
    num_q_heads=4,
    num_kv_heads=2,
    max_query_tokens=2,
    mask="causal",
    causal_align="bottom_right",
)


def heads_first(*tensors):
    return [None if t is None else t.transpose(1, 2) for t in tensors]


def flash_case(spec, seed=1, num_new=2):
    """decode_flash's tensors: q [2, 2, 4, 64] a slice of a wider tensor (not contiguous),
    caches [2, L, 2, 64] (paged: as decode() takes them) with NaN in unused slots, new keys
    [2, NNEW, 2, 64] halves of one packed tensor; and cache_seqlens, block_table."""
    cache = make_cache(spec, [5, 9], seed=seed, room=num_new, extra_capacity=40)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 4, 128, generator=gen).half()[..., ::2]
    k_cache, v_cache = cache.k, cache.v
    if spec.kv_layout.value == "contiguous":  # [B, L, HKV, D]: the cache's bytes reordered
        k_cache, v_cache = (t.transpose(1, 2).contiguous() for t in (k_cache, v_cache))
    new = torch.randn(2, num_new, 4, 64, generator=gen).half()
    k_new, v_new = (new[:, :, :2], new[:, :, 2:]) if num_new else (None, None)
    return q, k_cache, v_cache, cache.lengths, cache.block_table, k_new, v_new


def as_decode_takes(spec, q, k_cache, v_cache, k_new, v_new):
    """decode()'s [B, H, N, D] views of decode_flash's tensors (paged caches as they are)."""
    q, k_new, v_new = heads_first(q, k_new, v_new)
    if spec.kv_layout.value == "contiguous":
        k_cache, v_cache = heads_first(k_cache, v_cache)
    return q, k_cache, v_cache, k_new, v_new


# ------------------------------------------------------------ the entry points themselves


@pytest.mark.parametrize("spec", [DECODE, PAGED], ids=["contiguous", "paged"])
@pytest.mark.parametrize(
    "options",
    [{}, {"append": True, "return_lse": True, "num_splits": 3}, {"out": True, "sm_scale": 0.3}],
    ids=["read", "append, lse, splits", "out="],
)
def test_decode_flash_is_decode_on_the_views_bit_for_bit(spec, options):
    """The kernels under the interpreter: decode_flash's output, LSE and appended caches equal
    decode()'s on the transposed views bit for bit (NaN included); out [B, NQ, HQ, DV]
    contiguous, or the out= given (strided); decode_flash_out likewise on decode()'s tensors."""
    module = load_decode(spec)
    options = dict(options)
    append, given = options.pop("append", False), options.pop("out", False)
    q, k_cache, v_cache, lengths, table, k_new, v_new = flash_case(spec, num_new=2 if append else 0)
    expected_caches = [t.clone() for t in (k_cache, v_cache)]
    views = as_decode_takes(spec, q, *expected_caches, k_new, v_new)
    expected = module.decode(*views[:3], lengths, block_table=table, k_new=views[3],
                             v_new=views[4], **options)  # fmt: skip
    expected, expected_lse = expected if options.get("return_lse") else (expected, None)
    entries = {
        "decode_flash": (module.decode_flash, lambda c: (q, *c, k_new, v_new)),
        "decode_flash_out": (
            module.decode_flash_out,
            lambda c: as_decode_takes(spec, q, *c, k_new, v_new),
        ),
    }
    for name, (entry, arguments) in entries.items():
        caches = [t.clone() for t in (k_cache, v_cache)]
        q_, k_, v_, kn, vn = arguments(caches)
        out = fp16(2, 2, 4, 96)[..., :64] if given else None
        result = entry(q_, k_, v_, lengths, block_table=table, k_new=kn, v_new=vn, out=out,
                       **options)  # fmt: skip
        got, lse = result if options.get("return_lse") else (result, None)
        assert got.shape == (2, 2, 4, 64), name
        assert got is out if given else got.is_contiguous(), name
        assert same_bits(got, expected.transpose(1, 2)), name
        assert lse is None or same_bits(lse, expected_lse), name
        assert all(same_bits(a, b) for a, b in zip(caches, expected_caches, strict=True)), name


def test_decode_flash_rotates_as_decode_does():
    """flash-attn's rotary embedding (q and the appended keys rotated by the kernels): the
    same bits from decode_flash as from decode() on the views, caches included."""
    module = load_decode(ROTARY)
    q, k_cache, v_cache, lengths, _, k_new, v_new = flash_case(ROTARY, seed=3)
    cos, sin = rotary_tables(k_cache.shape[1], 16, torch.float16, seed=4)
    rotary = {"rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": False}
    expected_caches = [t.clone() for t in (k_cache, v_cache)]
    views = as_decode_takes(ROTARY, q, *expected_caches, k_new, v_new)
    expected = module.decode(*views[:3], lengths, k_new=views[3], v_new=views[4], **rotary)
    got = module.decode_flash(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, **rotary)
    assert same_bits(got, expected.transpose(1, 2))
    assert same_bits(k_cache, expected_caches[0]) and same_bits(v_cache, expected_caches[1])


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda c: dict(c, q=c["q"][0]), r"q: expected a tensor \[B, NQ, HQ, 64\], got \[2, 4, 64\]"),
        (
            lambda c: dict(c, q=fp16(2, 3, 4, 64)),
            r"q: expected at most max_query_tokens=2 query tokens \(dim 1\), got 3",
        ),
        (
            lambda c: dict(c, v_cache=c["v_cache"][:, :20]),
            r"v_cache: expected shape \[2, 51, 2, 64\], got \[2, 20, 2, 64\]",
        ),
        (
            lambda c: dict(c, k_new=fp16(2, 2, 4, 64), v_new=fp16(2, 2, 4, 64)),
            r"k_new: expected shape \[2, \*, 2, 64\], got \[2, 2, 4, 64\]",
        ),
        (
            lambda c: dict(c, v_new=fp16(2, 3, 2, 64)),
            r"v_new: expected shape \[2, 2, 2, 64\], got \[2, 3, 2, 64\]",
        ),
        (
            lambda c: dict(c, k_new=fp16(2, 60, 2, 64), v_new=fp16(2, 60, 2, 64)),
            r"k_new: 60 new keys \(dim 1\) exceed the cache's capacity 51",
        ),
        (lambda c: dict(c, out=fp16(2, 4, 2, 64)), r"out: expected shape \(2, 2, 4, 64\)"),
        (  # the new keys' packed storage seen as an output
            lambda c: dict(c, out=c["k_new"].as_strided((2, 2, 4, 64), (512, 256, 64, 1))),
            "out: shares memory with k_new",
        ),
        (lambda c: dict(c, k_cache="k"), "k_cache: expected a torch.Tensor, got str"),
    ],
    ids=["q rank", "tokens", "v_cache", "k_new", "v_new", "capacity", "out", "out shared", "type"],
)
def test_decode_flash_refuses_with_the_flash_layout_named(make_call, message):
    module = load_decode(DECODE)
    q, k_cache, v_cache, lengths, _, k_new, v_new = flash_case(DECODE)
    call = make_call({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new,
                      "v_new": v_new})  # fmt: skip
    with pytest.raises(ValueError, match=message):
        module.decode_flash(call.pop("q"), call.pop("k_cache"), call.pop("v_cache"), lengths,
                            **call)  # fmt: skip


# ------------------------------------------------------------ their plans (launches faked)


def log_raw_runs(monkeypatch):
    """Every direct launch, as (compiled kernel, grid, its arguments as they were passed)."""
    log, run = [], FakeCompiled.run

    def logged(self, *args):
        run(self, *args)
        log.append((self, self.runs[-1][0], self.runs[-1][1]))

    monkeypatch.setattr(FakeCompiled, "run", logged)
    return log


def known(*tensors):
    return {t.data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def pointers(args, inputs):
    """A launch's arguments as comparable values: the inputs' pointers as they are (the same
    tensors at every call), a new tensor (output, LSE, partials) by its dtype and alignment."""

    def one(a):
        if isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            return ("tensor", a.dtype, ptr if ptr in inputs else ("new", ptr % 16 == 0))
        return a

    return [one(a) for a in args]


def flash_calls(spec):
    """name -> (decode_flash's arguments, keywords): one layout each."""
    q, k_cache, v_cache, lengths, table, k_new, v_new = flash_case(spec)
    base = (q, k_cache, v_cache, lengths)
    new = {"k_new": k_new, "v_new": v_new, "block_table": table}
    return {
        "base": (base, {"block_table": table}),
        "append, scale, lse": (base, dict(new, sm_scale=0.5, return_lse=True)),
        "one split": (base, {"block_table": table, "num_splits": 1}),
        "three splits, append": (base, dict(new, num_splits=3)),
        "out=": (base, {"block_table": table, "out": fp16(2, 2, 4, 64)}),
        "misaligned q": ((fp16(2, 2, 4, 64, offset=1), *base[1:]), {"block_table": table}),
    }


@pytest.mark.parametrize("spec", [DECODE, PAGED], ids=["contiguous", "paged"])
def test_decode_flash_plans_launch_what_decode_launches_for_the_views(monkeypatch, spec):
    """decode_flash's and decode_flash_out's calls from their plans launch what decode()
    launches for the views with an out= view (the route before them): the same compiled
    kernels, grids, pointers and ints, in the same order, for every option and alignment;
    the output they return is the one the kernels wrote."""
    module = load_decode(spec)
    fast(monkeypatch, module, *KERNELS)
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    monkeypatch.setattr(module, "_FLASH_PLANS", ({}, {}))
    log = log_raw_runs(monkeypatch)
    for name, (args, kwargs) in flash_calls(spec).items():
        q, k_cache, v_cache, lengths = args
        views = as_decode_takes(spec, q, k_cache, v_cache, kwargs.get("k_new"), kwargs.get("v_new"))
        given = kwargs.get("out")
        inputs = known(q, k_cache, v_cache, lengths, given, *kwargs.values())
        for _ in range(3):  # the views' plan made, then run from it
            out = torch.empty(2, 2, 4, 64, dtype=torch.float16) if given is None else given
            start = len(log)
            module.decode(*views[:3], lengths, **dict(kwargs, k_new=views[3], v_new=views[4],
                                                      out=out.transpose(1, 2)))  # fmt: skip
        expected = pointers_of(log[start:], inputs)
        entries = {
            "decode_flash": (module.decode_flash, (q, k_cache, v_cache), kwargs),
            "decode_flash_out": (
                module.decode_flash_out,
                views[:3],
                dict(kwargs, k_new=views[3], v_new=views[4]),
            ),
        }
        for entry, (call, tensors, options) in entries.items():
            for _ in range(3):  # the full path (which keeps the plan), then the plan's runs
                start = len(log)
                result = call(*tensors, lengths, **options)
                assert pointers_of(log[start:], inputs) == expected, f"{entry}: {name}"
                out = result[0] if options.get("return_lse") else result
                assert out.shape == (2, 2, 4, 64) and (given is None or out is given)
                written = [a.data_ptr() for a in log[-1][2] if isinstance(a, torch.Tensor)]
                assert out.data_ptr() in written, f"{entry}: {name}: out not the kernel's"
    for plans in module._FLASH_PLANS:
        assert plans and all(
            split.compiled for plan in plans.values() for _, split, _ in plan.launches.values()
        )


def pointers_of(runs, inputs):
    return [(compiled, grid, pointers(args, inputs)) for compiled, grid, args in runs]
