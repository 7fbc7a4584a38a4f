"""The decode modules' entry points in flash-attn's layout, `decode_flash` (q [B, NQ, HQ, D],
contiguous caches [B, L, HKV, D], new keys [B, NNEW, HKV, D]; out [B, NQ, HQ, DV]) and
`decode_flash_out` (decode()'s tensors, out [B, NQ, HQ, DV]), on the CPU: bit for bit decode()
on the [B, H, N, D] views (output, LSE and appended caches, with the real kernels under the
interpreter), the same launches from their plans (growing caches too), their errors named in
the caller's layout; and the public functions that reach them (flash_attn_with_kvcache, the
transformers decode step) with no view of their own."""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.runtime.hf import CacheLengths, attngen_attention
from attngen.runtime.registry import current_registry
from attngen.runtime.selection import routes
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
from tests.test_fast_launch import DECODE, Address, FakeCompiled, fast, fp16

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
    cache = make_cache(spec, [5, 9], seed=seed, room=num_new, extra_capacity=300)
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
        assert module.LAST_NUM_SPLITS == options.get("num_splits", 1), name  # (the combine ran)


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


def test_decode_flash_of_a_module_without_plans_is_decode_on_the_views():
    """A module built with sinks keeps no call plans: its decode_flash (sinks passed on, the
    combine's sink term too) is still decode() on the views, bit for bit."""
    spec = make_decode_spec(
        "contiguous",
        None,
        name="flds",
        dtype="fp16",
        head_dim=64,
        num_q_heads=4,
        num_kv_heads=2,
        max_query_tokens=2,
        mask="causal",
        causal_align="bottom_right",
        sinks=True,
    )
    module = load_decode(spec)
    assert not module._KEEPS_PLANS and not hasattr(module, "_CALL_PLANS")
    q, k_cache, v_cache, lengths, _, k_new, v_new = flash_case(spec, seed=6)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6))
    options = {"sinks": sinks, "return_lse": True, "num_splits": 2}
    expected_caches = [t.clone() for t in (k_cache, v_cache)]
    views = as_decode_takes(spec, q, *expected_caches, k_new, v_new)
    out, lse = module.decode(*views[:3], lengths, k_new=views[3], v_new=views[4], **options)
    got, got_lse = module.decode_flash(
        q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, **options
    )
    assert same_bits(got, out.transpose(1, 2)) and same_bits(got_lse, lse)
    assert same_bits(k_cache, expected_caches[0]) and same_bits(v_cache, expected_caches[1])


@pytest.mark.parametrize(
    "make_call, message",
    [
        (
            lambda c: dict(c, q=c["q"][0]),
            r"q: expected a tensor \[B, NQ, HQ, 64\], got \[2, 4, 64\]",
        ),
        (
            lambda c: dict(c, q=fp16(2, 3, 4, 64)),
            r"q: expected at most max_query_tokens=2 query tokens \(dim 1\), got 3",
        ),
        (
            lambda c: dict(c, v_cache=c["v_cache"][:, :20]),
            r"v_cache: expected shape \[2, 311, 2, 64\], got \[2, 20, 2, 64\]",
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
            lambda c: dict(c, k_new=fp16(2, 320, 2, 64), v_new=fp16(2, 320, 2, 64)),
            r"k_new: 320 new keys \(dim 1\) exceed the cache's capacity 311",
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
        if isinstance(a, (torch.Tensor, Address)):  # (a direct launch passes addresses)
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
                written = [a.data_ptr() for a in log[-1][2] if isinstance(a, Address)]
                assert out.data_ptr() in written, f"{entry}: {name}: out not the kernel's"
    for plans in module._FLASH_PLANS:
        assert plans and all(
            split.compiled for plan in plans.values() for _, split, _ in plan.launches.values()
        )


def pointers_of(runs, inputs):
    return [(compiled, grid, pointers(args, inputs)) for compiled, grid, args in runs]


def test_decode_flash_over_a_growing_cache_runs_from_one_plan(monkeypatch):
    """Caches [B, L, HKV, D] one size after another (a cache that grows, as transformers'
    DynamicCache hands them; across split counts and key-block boundaries): one plan serves
    every size, and at each size decode_flash launches what decode() launches for the views."""
    module = load_decode(DECODE)
    fast(monkeypatch, module, *KERNELS)
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    monkeypatch.setattr(module, "_FLASH_PLANS", ({}, {}))
    log = log_raw_runs(monkeypatch)
    hits = count_plan_hits(monkeypatch, module)
    q = fp16(2, 2, 4, 64)
    lengths = torch.tensor([3, 50], dtype=torch.int32)
    sizes = (60, 61, 127, 128, 129, 256, 513, 2048, 700, 64)
    caches = {size: (fp16(2, size, 2, 64), fp16(2, size, 2, 64)) for size in sizes}
    with monkeypatch.context() as unplanned:  # every kernel compiled: each launch is logged
        unplanned.setattr(module, "_call_key", lambda *args, **keywords: None)
        for k_cache, v_cache in caches.values():
            module.decode(*heads_first(q, k_cache, v_cache), lengths)
    for size, (k_cache, v_cache) in caches.items():
        inputs = known(q, k_cache, v_cache, lengths)
        runs = []
        for _ in range(2):  # the full path at a new launch class, then the plan
            start = len(log)
            out = module.decode_flash(q, k_cache, v_cache, lengths)
            runs.append(pointers_of(log[start:], inputs))
        start = len(log)
        module.decode(*heads_first(q, k_cache, v_cache), lengths, out=out.transpose(1, 2))
        assert runs[0] == runs[1] == pointers_of(log[start:], inputs), size
    assert len(module._FLASH_PLANS[True]) == 1 and len(module._CALL_PLANS) == 1
    assert sum(hits) > len(hits) // 2  # most calls ran from a plan


# ------------------------------------------------------------ the public functions


def kvcache_step(seqlen_q=2, seed=0):
    """flash_attn_with_kvcache's tensors (fp32, d16: a module built on demand): q [2, NQ, 4,
    16], caches [2, 40, 2, 16] (NaN past the lengths), new keys [2, 2, 2, 16]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen_q, 4, 16, generator=gen)
    k_cache, v_cache = (torch.full((2, 40, 2, 16), float("nan")) for _ in range(2))
    k_cache[:, :20], v_cache[:, :20] = torch.randn(2, 2, 20, 2, 16, generator=gen)
    k_new, v_new = torch.randn(2, 2, 2, 2, 16, generator=gen)
    lengths = torch.tensor([7, 20 - 2], dtype=torch.int32)
    return q, k_cache, v_cache, k_new, v_new, lengths


def count_calls(monkeypatch, module, entry):
    calls = []
    real = getattr(module, entry)

    def counted(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, entry, counted)
    return calls


def run_kvcache(case, **options):
    q, k_cache, v_cache, k_new, v_new, lengths = case
    return attngen.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True, **options
    )


@pytest.mark.parametrize("seqlen_q", [2, 1])
def test_flash_attn_with_kvcache_hands_its_tensors_to_decode_flash(
    on_demand,  # noqa: F811
    monkeypatch,
    seqlen_q,
):
    """Full path and planned calls give the module's decode_flash the caller's tensors as
    they are (no view) and no out=, and return the tensor it allocated, contiguous: bit for
    bit what decode() gives on [B, H, N, D] views, appended caches included; last_dispatch
    names the decode module at every call."""
    run_kvcache(kvcache_step(seqlen_q), return_softmax_lse=True)  # the module built and chosen
    module = current_registry().module(attngen.last_dispatch().key)
    routes(current_registry()).clear()
    calls = count_calls(monkeypatch, module, "decode_flash")
    cases = [kvcache_step(seqlen_q) for _ in range(3)]
    for case in cases:  # the full path, then the plan
        out, lse = run_kvcache(case, return_softmax_lse=True)
        assert attngen.last_dispatch().need.kind.value == "decode"
    assert len(calls) == 3
    for (args, kwargs), case in zip(calls, cases, strict=True):
        assert all(a is b for a, b in zip(args, case[:3], strict=False))
        assert kwargs["k_new"] is case[3] and kwargs["v_new"] is case[4]
        assert "out" not in kwargs
    assert out.shape == (2, seqlen_q, 4, 16) and out.is_contiguous()
    q, k_cache, v_cache, k_new, v_new, lengths = (
        t.transpose(1, 2) if t.dim() == 4 else t for t in kvcache_step(seqlen_q)
    )
    expected, expected_lse = module.decode(
        q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, return_lse=True
    )
    assert same_bits(out, expected.transpose(1, 2).contiguous()) and same_bits(lse, expected_lse)
    assert same_bits(cases[-1][1], k_cache.transpose(1, 2))
    assert same_bits(cases[-1][2], v_cache.transpose(1, 2))


def test_a_planned_kvcache_step_makes_no_view(on_demand, monkeypatch):  # noqa: F811
    """With the cached launcher on (launches faked), a planned flash_attn_with_kvcache step
    transposes nothing and calls neither decode() nor decode_flash's full path: decode_flash
    launches from its own plan, from the caller's tensors."""
    case = kvcache_step()
    run_kvcache(case)
    chosen = attngen.last_dispatch()
    module = current_registry().module(chosen.key)
    fast(monkeypatch, module, *KERNELS)
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    monkeypatch.setattr(module, "_FLASH_PLANS", ({}, {}))
    for _ in range(3):
        run_kvcache(case)
    decode_calls = count_calls(monkeypatch, module, "decode")
    hits = count_plan_hits(monkeypatch, module)
    transposes = []
    real_transpose = torch.Tensor.transpose

    def transpose(self, *dims):
        transposes.append(dims)
        return real_transpose(self, *dims)

    monkeypatch.setattr(torch.Tensor, "transpose", transpose)
    out = run_kvcache(case)
    monkeypatch.setattr(torch.Tensor, "transpose", real_transpose)
    assert hits == [True] and not decode_calls and not transposes
    assert out.shape == (2, 2, 4, 16) and out.is_contiguous()
    last = attngen.last_dispatch()
    assert (last.api, last.key, last.need) == (chosen.api, chosen.key, chosen.need)


def test_transformers_decode_step_reaches_decode_flash_out(on_demand, monkeypatch):  # noqa: F811
    """A DynamicCache step (CacheLengths) on the decode module: transformers' [B, H, N, D]
    tensors go as they are to decode_flash_out, whose [B, NQ, HQ, DV] output comes back
    contiguous; bit for bit decode()'s output transposed, and what a module without it gives."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = (torch.randn(2, 2, 9, 16, generator=gen) for _ in range(2))
    lengths = CacheLengths(torch.full((2,), 9, dtype=torch.int32), all_written=True)
    layer = SimpleNamespace(is_causal=True)
    attngen_attention(layer, q, k, v, lengths)
    dispatch = attngen.last_dispatch()
    assert dispatch.need.kind.value == "decode"
    module = current_registry().module(dispatch.key)
    calls = count_calls(monkeypatch, module, "decode_flash_out")
    out, _ = attngen_attention(layer, q, k, v, lengths)
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0][0], (q, k, v), strict=False))
    assert "out" not in calls[0][1]
    assert out.shape == (2, 1, 4, 16) and out.is_contiguous()
    expected = module.decode(q, k, v, lengths.seqlens, sm_scale=0.25)
    assert same_bits(out, expected.transpose(1, 2).contiguous())
