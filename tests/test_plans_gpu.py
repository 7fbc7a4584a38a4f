"""varlen's and decode's call plans on a CUDA GPU (the H200): `pytest -m gpu`. A layout's
calls from its plan (the compiled kernels' launchers called directly) give the full path's
outputs, LSEs and appended caches bit for bit, and a plan serves a CUDA graph's capture."""

from __future__ import annotations

import pytest
import torch

from tests.decode_harness import (
    count_plan_hits,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
)
from tests.kernel_harness import load_kernel, make_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


def _gqa_decode_spec(layout, page_size, name):
    """bf16, D 128, GQA 8:2, up to two query tokens a call."""
    return make_decode_spec(
        layout,
        page_size,
        name=name,
        dtype="bf16",
        head_dim=128,
        num_q_heads=8,
        num_kv_heads=2,
        max_query_tokens=2,
    )


def _unplanned(monkeypatch, module):
    monkeypatch.setattr(module, "_call_key", lambda *args, **kwargs: None)


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 16)])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_planned_decode_equals_the_full_path(monkeypatch, layout, page_size, num_splits):
    spec = _gqa_decode_spec(layout, page_size, "gpuplan")
    module = load_decode(spec)
    cache = make_cache(spec, [5, 300, 0], seed=1, room=2, extra_capacity=700).to("cuda")
    q, k_new, v_new, _ = (
        None if t is None else t.cuda() for t in make_queries(spec, 3, 2, seed=2, num_new=2)
    )

    def step():
        k, v = cache.k.clone(), cache.v.clone()
        out, lse = module.decode(
            q,
            k,
            v,
            cache.lengths,
            block_table=cache.block_table,
            k_new=k_new,
            v_new=v_new,
            return_lse=True,
            num_splits=num_splits,
        )
        return out, lse, k, v

    with monkeypatch.context() as patch:
        _unplanned(patch, module)
        expected = step()
    results = [step() for _ in range(3)]  # plans, then runs from the plan
    assert module._CALL_PLANS
    torch.cuda.synchronize()
    for got in results:
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())


# A DynamicCache's steps: one key more each step, across key blocks (64 keys) and split
# counts (at B 3, HKV 2 the rule splits 8 blocks in 2 from 449 keys, 12 in 3 from 705), then
# larger jumps, then a new, shorter cache.
GROWING_POSITIONS = [
    *range(1, 70),
    *range(445, 452),
    *range(700, 710),
    *(1023, 1024, 1025, 2048, 2049, 5000, 16385, 300, 299, 1),
]
GROWING_PAGES = [*range(40, 52), 63, 64, 65, 41]  # paged: the pool grows (block_table fixed)


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 16)])
@pytest.mark.parametrize("num_new", [0, 1], ids=["read", "append"])
def test_planned_decode_over_a_growing_cache_equals_the_full_path(
    monkeypatch, layout, page_size, num_new
):
    """New caches at every step, as a DynamicCache's torch.cat makes them (contiguous: one
    position more; paged: a pool of one page more): from the one plan of the layout, the
    outputs, LSEs and appended caches equal the full path's bit for bit at every size, and
    the full path runs only for each launch class's first call (split count, the size ints'
    classes)."""
    spec = _gqa_decode_spec(layout, page_size, "gpugrow")
    module = load_decode(spec)
    monkeypatch.setattr(module, "_CALL_PLANS", {})
    hits = count_plan_hits(monkeypatch, module)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 8, 1, 128, generator=gen).bfloat16().cuda()
    new = {}
    if num_new:
        new = {f"{n}_new": torch.randn(3, 2, num_new, 128).bfloat16().cuda() for n in "kv"}
    if layout == "contiguous":
        sizes, most = GROWING_POSITIONS, max(GROWING_POSITIONS)
        all_k, all_v = (torch.randn(3, 2, most, 128).bfloat16().cuda() for _ in range(2))
        table = None
    else:
        sizes, most = GROWING_PAGES, max(GROWING_PAGES)
        all_k, all_v = (torch.randn(most, 16, 2, 128).bfloat16().cuda() for _ in range(2))
        pages = torch.randperm(40, generator=gen).to(torch.int32)
        table = pages[:39].view(3, 13).cuda()  # 208 positions a sequence
    counts = []
    for size in sizes:
        length = (size if layout == "contiguous" else 208) - num_new
        lengths = [length, length // 2, min(length, 5)]
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        dim = 2 if layout == "contiguous" else 0
        k, v = (t.narrow(dim, 0, size).clone(memory_format=torch.contiguous_format)
                for t in (all_k, all_v))  # fmt: skip

        def step(k=k, v=v, seqlens=seqlens):
            k, v = k.clone(), v.clone()
            out = torch.empty(3, 1, 8, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
            _, lse = module.decode(
                q, k, v, seqlens, block_table=table, **new, return_lse=True, out=out
            )
            return out, lse, k, v

        with monkeypatch.context() as patch:
            _unplanned(patch, module)
            expected = step()
        got = step()
        counts.append(module.LAST_NUM_SPLITS)
        torch.cuda.synchronize()
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), size
    (plan,) = module._CALL_PLANS.values()
    assert hits.count(False) == len(plan.launches) - 1
    assert hits.count(True) >= len(sizes) - len(plan.launches)
    if layout == "contiguous":
        assert len(set(counts)) >= 4, counts  # the sizes crossed split counts


def test_planned_varlen_equals_the_full_path(monkeypatch):
    spec = make_spec(
        name="gpuplanv",
        dtype="bf16",
        head_dim=128,
        num_q_heads=8,
        num_kv_heads=2,
        kernels=["varlen"],
    )
    module = load_kernel(spec, kind="varlen")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(300, 8, 128, generator=gen).bfloat16().cuda()
    k = torch.randn(300, 2, 128, generator=gen).bfloat16().cuda()
    cu = torch.tensor([0, 17, 140, 280], dtype=torch.int32, device="cuda")

    def call():
        return module.attention_varlen(q, k, k, cu, cu, 140, 140, return_lse=True)

    with monkeypatch.context() as patch:
        _unplanned(patch, module)
        expected = call()
    results = [call() for _ in range(3)]
    assert module._CALL_PLANS
    for got in results:
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


@pytest.mark.parametrize("load_path", ["pointers", "tma"])
def test_planned_attention_flash_equals_attention_on_the_views(monkeypatch, load_path):
    """attention_flash (flash_attn_func's entry point) from its plan, on [B, N, H, D] tensors
    none of which is contiguous, equals attention() on their [B, H, N, D] views bit for bit,
    and so does attention_flash_out (the transformers function's) on the views: the pointer
    path, and the TMA path whose descriptors take the views' strides."""
    spec = make_spec(name="gpuflash", dtype="bf16", head_dim=128, num_q_heads=8, num_kv_heads=2)
    module = load_kernel(spec)
    monkeypatch.setattr(module, "POINTER_LOADS_UP_TO", 0 if load_path == "tma" else 2**40)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 300, 8, 256, generator=gen).bfloat16().cuda()[..., ::2]
    kv = torch.randn(2, 500, 4, 128, generator=gen).bfloat16().cuda()
    k, v = kv[:, :, :2], kv[:, :, 2:]
    views = [t.transpose(1, 2) for t in (q, k, v)]
    assert module.kv_load_path(views[1], views[2]) == "tma"  # the layout allows it
    with monkeypatch.context() as patch:
        _unplanned(patch, module)
        expected = module.attention(*views, return_lse=True)
    given = torch.empty(2, 300, 8, 128, dtype=torch.bfloat16, device="cuda")
    results = [module.attention_flash(q, k, v, return_lse=True) for _ in range(3)]
    results += [module.attention_flash_out(*views, return_lse=True) for _ in range(3)]
    written = [module.attention_flash(q, k, v, out=given) for _ in range(3)]
    for plans in module._FLASH_PLANS:  # attention_flash's and attention_flash_out's
        assert plans and all(p.compiled for p in plans.values())
    torch.cuda.synchronize()
    for out, lse in results:
        assert out.is_contiguous() and out.shape == (2, 300, 8, 128)
        assert torch.equal(out.transpose(1, 2), expected[0]) and torch.equal(lse, expected[1])
    assert all(w is given for w in written)
    assert torch.equal(given.transpose(1, 2), expected[0])


def _flash_decode_case(layout, spec, seed):
    """decode_flash's tensors on the GPU: q [3, 2, 8, 128] a slice of a wider tensor, caches
    [3, L, 2, 128] (paged: as decode() takes them), new keys [3, 2, 2, 128] halves of one
    packed tensor; cache_seqlens and block_table."""
    cache = make_cache(spec, [5, 300, 0], seed=seed, room=2, extra_capacity=700).to("cuda")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 2, 8, 256, generator=gen).bfloat16().cuda()[..., ::2]
    new = torch.randn(3, 2, 4, 128, generator=gen).bfloat16().cuda()
    k_cache, v_cache = cache.k, cache.v
    if layout == "contiguous":
        k_cache, v_cache = (t.transpose(1, 2).contiguous() for t in (k_cache, v_cache))
    return q, k_cache, v_cache, cache.lengths, cache.block_table, new[:, :, :2], new[:, :, 2:]


def _heads_first(layout, q, k_cache, v_cache, k_new, v_new):
    views = [t.transpose(1, 2) for t in (q, k_cache, v_cache, k_new, v_new)]
    if layout == "paged":
        views[1:3] = k_cache, v_cache
    return views


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 16)])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_planned_decode_flash_equals_decode_on_the_views(monkeypatch, layout, page_size,
                                                         num_splits):  # fmt: skip
    """decode_flash (flash_attn_with_kvcache's entry point) from its plan, on [B, N, H, D]
    tensors (q and the new keys not contiguous), equals decode() on their [B, H, N, D] views
    bit for bit: output, LSE and appended caches; so does decode_flash_out (transformers'
    decode step's) on the views; out [B, NQ, HQ, DV] contiguous."""
    spec = _gqa_decode_spec(layout, page_size, "gpudflash")
    module = load_decode(spec)
    q, k_cache, v_cache, lengths, table, k_new, v_new = _flash_decode_case(layout, spec, 7)
    options = {"block_table": table, "return_lse": True, "num_splits": num_splits}

    def step(entry, flash):
        k, v = k_cache.clone(), v_cache.clone()
        tensors = (q, k, v, k_new, v_new) if flash else _heads_first(layout, q, k, v, k_new, v_new)
        out, lse = entry(*tensors[:3], lengths, k_new=tensors[3], v_new=tensors[4], **options)
        return out, lse, k, v

    with monkeypatch.context() as patch:
        _unplanned(patch, module)
        expected = step(module.decode, False)
    results = [step(module.decode_flash, True) for _ in range(3)]  # plans, then their runs
    results += [step(module.decode_flash_out, False) for _ in range(3)]
    for plans in module._FLASH_PLANS:  # decode_flash's and decode_flash_out's
        assert plans and all(plan.launches for plan in plans.values())
    torch.cuda.synchronize()
    for out, lse, k, v in results:
        assert out.is_contiguous() and out.shape == (3, 2, 8, 128)
        assert torch.equal(out.transpose(1, 2).nan_to_num(), expected[0].nan_to_num())
        assert torch.equal(lse.nan_to_num(), expected[1].nan_to_num())
        assert torch.equal(k.nan_to_num(), expected[2].nan_to_num())
        assert torch.equal(v.nan_to_num(), expected[3].nan_to_num())


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 16)])
def test_decode_flash_captured_in_a_cuda_graph_replays_decode(layout, page_size):
    """decode_flash from its plan captured in a CUDA graph (append included): a replay gives
    decode()'s output and appended caches on the views bit for bit, and a second replay on
    new inputs copied into the static tensors gives theirs."""
    spec = _gqa_decode_spec(layout, page_size, "gpudflashg")
    module = load_decode(spec)
    q, k_cache, v_cache, lengths, table, k_new, v_new = _flash_decode_case(layout, spec, 8)
    graph_k, graph_v = k_cache.clone(), v_cache.clone()

    def flash_step(k, v):
        return module.decode_flash(q, k, v, lengths, block_table=table, k_new=k_new, v_new=v_new)

    def expected_step(q_, k_new_, v_new_):
        k, v = k_cache.clone(), v_cache.clone()
        views = _heads_first(layout, q_, k, v, k_new_, v_new_)
        out = module.decode(*views[:3], lengths, block_table=table, k_new=views[3],
                            v_new=views[4])  # fmt: skip
        return out.transpose(1, 2), k, v

    for _ in range(2):  # compiled, and the plan kept
        flash_step(k_cache.clone(), v_cache.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flash_step(graph_k, graph_v)
    for step in range(2):
        graph_k.copy_(k_cache)  # capture records, it does not run; each replay appends again
        graph_v.copy_(v_cache)
        graph.replay()
        expected = expected_step(q, k_new, v_new)
        torch.cuda.synchronize()
        for a, b in zip((static_out, graph_k, graph_v), expected, strict=True):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), step
        gen = torch.Generator().manual_seed(9 + step)
        q.copy_(torch.randn(q.shape, generator=gen).bfloat16())
        k_new.copy_(torch.randn(k_new.shape, generator=gen).bfloat16())
        v_new.copy_(torch.randn(v_new.shape, generator=gen).bfloat16())
