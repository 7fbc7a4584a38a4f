"""Tree drafts for speculative decoding: decode()'s `tree_mask` (CPU interpreter).

A step with NQ draft tokens per sequence (EAGLE / Medusa verify a tree of them at once): draft
token i sees every key before the step's own (the committed prefix) as the module's mask says,
and of the step's own keys (the sequence's last NQ, draft j at L_b - NQ + j) only those where
tree_mask[b, i, j] is True, ANDed with that mask. The float64 reference is the decode
reference with the same visibility (decode_harness.tree_key_mask ANDed into the spec's).
Trees are drawn as the callers make them: each token's parent a random earlier token (or none),
the mask its ancestors and itself. A chain (every parent the token before) is the causal
step, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from attngen.runtime import registry as registry_module
from attngen.runtime.registry import load_kernels
from tests.decode_harness import (
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
    same_bits,
)
from tests.runtime_harness import build_folder


def random_tree(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[NQ, NQ] bool: each token's ancestors and itself, its parent a random earlier token (or
    none: another root, as a Medusa head's first tokens)."""
    mask = torch.eye(num_tokens, dtype=torch.bool)
    for i in range(1, num_tokens):
        parent = int(torch.randint(-1, i, (), generator=gen))
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def chain(num_tokens: int) -> torch.Tensor:
    return torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()


# ----------------------------------------------------------------------- against float64


@st.composite
def tree_case(draw):
    layout = draw(st.sampled_from(["contiguous", "paged"]))
    page_size = draw(st.sampled_from([1, 4, 16])) if layout == "paged" else None
    mask = draw(st.sampled_from(["none", "causal", "causal", "sliding_window", "chunked"]))
    max_tokens = draw(st.sampled_from([4, 8, 16]))
    fields = dict(
        dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
        head_dim=draw(st.sampled_from([16, 40])),
        mask=mask,
        max_query_tokens=max_tokens,
    )
    kv_heads = draw(st.integers(1, 2))
    fields["num_kv_heads"] = kv_heads
    fields["num_q_heads"] = kv_heads * draw(st.sampled_from([1, 2, 4]))
    if mask != "none":
        fields["causal_align"] = "bottom_right"
    if mask == "sliding_window":
        fields["window_left"] = draw(st.sampled_from([3, 16]))
        if draw(st.booleans()):
            fields["sink_tokens"] = 2
    if mask == "chunked":
        fields["chunk_size"] = draw(st.sampled_from([8, 32]))
    if draw(st.integers(0, 4)) == 0:
        fields["softcap"] = 30.0
    if draw(st.integers(0, 4)) == 0:
        fields["sinks"] = True
    block_n = draw(st.sampled_from([16, 32]))
    boundary = page_size or block_n
    length = st.sampled_from(sorted({0, 1, boundary - 1, boundary, boundary + 1, 37}))
    lengths = draw(st.lists(length, min_size=1, max_size=3))
    num_q = draw(st.integers(1, max_tokens))
    # the drafts' keys appended by the call (the usual step), or already in the cache
    num_new = draw(st.sampled_from([num_q, num_q, 0]))
    shared = draw(st.booleans())  # [NQ, NQ] for the batch, else [B, NQ, NQ]
    splits = draw(st.sampled_from([None, 1, 2, 3]))
    seed = draw(st.integers(0, 2**16))
    return layout, page_size, fields, block_n, lengths, (num_q, num_new), shared, splits, seed


def run_tree_case(case, device="cpu"):
    """(problems against the float64 reference, out, lse) for one tree_case on `device`."""
    layout, page_size, fields, block_n, lengths, steps, shared, splits, seed = case
    num_q, num_new = steps
    spec = make_decode_spec(layout, page_size, **fields)
    kernel = load_decode(spec, block_n)
    if num_new == 0:  # the drafts' keys are the cache's last NQ
        lengths = [n + num_q for n in lengths]
    cache = make_cache(spec, lengths, seed=seed, room=num_new)
    q, k_new, v_new, _ = make_queries(spec, len(lengths), num_q, seed=seed, num_new=num_new)
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(num_q, gen) for _ in lengths]
    tree = trees[0] if shared else torch.stack(trees)
    sinks = torch.randn(spec.num_q_heads, generator=gen) if spec.sinks else None
    extra = {"sinks": sinks.to(device)} if spec.sinks else {}

    def on(t):
        return None if t is None else t.to(device)

    kernel.FORCE_NUM_SPLITS = splits
    try:
        out, lse = run_decode(kernel, cache.to(device), on(q), on(k_new), on(v_new),
                              tree_mask=on(tree), **extra)  # fmt: skip
    finally:
        kernel.FORCE_NUM_SPLITS = None
    out, lse = out.cpu(), lse.cpu()
    problems = decode_problems(spec, cache, out, lse, q, k_new, v_new, sinks=sinks, tree=tree)
    return problems, out, lse


@given(tree_case())
@example(  # GQA 4:1, 16 drafts over pages of 4 (the drafts straddle pages and key blocks), splits
    (
        "paged",
        4,
        dict(
            dtype="bf16",
            head_dim=40,
            mask="causal",
            causal_align="bottom_right",
            num_kv_heads=2,
            num_q_heads=8,
            max_query_tokens=16,
        ),
        16,
        [5, 0, 37],
        (16, 16),
        False,
        3,
        1,
    )  # fmt: skip
)
@example(  # contiguous, mask none (the tree alone among the drafts), shared tree, sinks
    (
        "contiguous",
        None,
        dict(
            dtype="fp16",
            head_dim=16,
            mask="none",
            num_kv_heads=1,
            num_q_heads=2,
            max_query_tokens=8,
            sinks=True,
        ),
        16,
        [33, 16],
        (8, 8),
        True,
        2,
        2,
    )  # fmt: skip
)
@example(  # a window with sink tokens, pages of 1, the drafts already in the cache
    (
        "paged",
        1,
        dict(
            dtype="fp32",
            head_dim=16,
            mask="sliding_window",
            causal_align="bottom_right",
            window_left=3,
            sink_tokens=2,
            num_kv_heads=1,
            num_q_heads=2,
            max_query_tokens=8,
        ),
        16,
        [20, 1],
        (6, 0),
        False,
        None,
        3,
    )  # fmt: skip
)
def test_tree_decode_matches_the_float64_reference(case):
    problems, _, _ = run_tree_case(case)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("layout,page_size", [("contiguous", None), ("paged", 1), ("paged", 16)])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_chain_is_the_causal_step_bit_for_bit(layout, page_size, splits):
    spec = make_decode_spec(layout, page_size, dtype="bf16", head_dim=16, mask="causal",
                            causal_align="bottom_right", num_q_heads=4, num_kv_heads=2,
                            max_query_tokens=8)  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [3, 40], seed=5, room=8)
    q, k_new, v_new, _ = make_queries(spec, 2, 8, seed=5, num_new=8)
    kernel.FORCE_NUM_SPLITS = splits
    try:
        causal = run_decode(kernel, cache.clone(), q, k_new, v_new)
        trees = (chain(8), chain(8)[None].expand(2, 8, 8), chain(8).T.contiguous().T)
        for tree in trees:  # shared, per sequence (stride 0), column-major
            got = run_decode(kernel, cache.clone(), q, k_new, v_new, tree_mask=tree)
            assert same_bits(got[0], causal[0]) and same_bits(got[1], causal[1])
        # an upper triangle is ANDed away by the causal mask: the same step again
        full = torch.ones(8, 8, dtype=torch.bool)
        got = run_decode(kernel, cache.clone(), q, k_new, v_new, tree_mask=full)
        assert same_bits(got[0], causal[0])
    finally:
        kernel.FORCE_NUM_SPLITS = None


def test_the_tree_changes_only_the_rows_it_restricts():
    """Only the draft rows whose tree differs from the chain change: here token 3, a root of
    its own (it sees the prefix and itself, not drafts 0-2)."""
    spec = make_decode_spec("paged", 4, dtype="fp32", head_dim=16, mask="causal",
                            causal_align="bottom_right", num_q_heads=2, num_kv_heads=2,
                            max_query_tokens=4)  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [9], seed=2, room=4)
    q, k_new, v_new, _ = make_queries(spec, 1, 4, seed=2, num_new=4)
    tree = chain(4)
    tree[3, :3] = False  # token 3 a root of its own: sees the prefix and itself
    causal, _ = run_decode(kernel, cache.clone(), q, k_new, v_new)
    got, _ = run_decode(kernel, cache.clone(), q, k_new, v_new, tree_mask=tree)
    assert torch.equal(got[:, :, :3], causal[:, :, :3])
    assert not torch.allclose(got[:, :, 3], causal[:, :, 3])


def test_fp8_cache_with_a_tree_matches_the_dequantized_reference():
    from tests.test_decode_fp8 import fp8_cache, fp8_problems, quantize

    spec = make_decode_spec("paged", 4, kv_dtype="fp8_e4m3", dtype="bf16", head_dim=16,
                            mask="causal", causal_align="bottom_right", num_q_heads=4,
                            num_kv_heads=2, max_query_tokens=8)  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = fp8_cache(spec, [5, 30], seed=4, room=8)
    q, k_new, v_new, _ = make_queries(spec, 2, 8, seed=4, num_new=8)
    kd = torch.rand(2, 2, generator=torch.Generator().manual_seed(4)) + 0.1
    tree = torch.stack([random_tree(8, torch.Generator().manual_seed(s)) for s in (1, 2)])
    before = cache.clone()
    kernel.FORCE_NUM_SPLITS = 2
    try:
        out, lse = run_decode(kernel, cache, q, k_new, v_new, k_descale=kd, v_descale=kd,
                              tree_mask=tree)  # fmt: skip
    finally:
        kernel.FORCE_NUM_SPLITS = None
    k8, v8 = quantize(k_new, kd[:, :, None, None]), quantize(v_new, kd[:, :, None, None])
    problems = fp8_problems(spec, before, out, lse, q, k8, v8, kd, kd, tree=tree)
    assert not problems, "; ".join(problems)


# ----------------------------------------------------------- entry points, plans, arguments


def _small_step(seed=7, mask="causal", **fields):
    spec = make_decode_spec("paged", 4, dtype="bf16", head_dim=16, mask=mask,
                            causal_align="bottom_right", num_q_heads=4, num_kv_heads=2,
                            max_query_tokens=4, **fields)  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [6, 13], seed=seed, room=4)
    q, k_new, v_new, slopes = make_queries(spec, 2, 4, seed=seed, num_new=4)
    tree = torch.stack([random_tree(4, torch.Generator().manual_seed(s)) for s in (3, 4)])
    return spec, kernel, cache, q, k_new, v_new, slopes, tree


def test_decode_flash_entry_points_and_plans_take_the_tree():
    """decode_flash / decode_flash_out give decode()'s bits with a tree; the calls after the
    first (from their plans) read the tree's current contents, and a call without a tree
    after one with it (or the other way) is not served by the other's plan."""
    spec, kernel, cache, q, k_new, v_new, _, tree = _small_step()
    results = []
    for t in (tree, chain(4), tree, None, tree):
        c = cache.clone()
        results.append(kernel.decode(q, c.k, c.v, c.lengths, block_table=c.block_table,
                                     k_new=k_new, v_new=v_new, tree_mask=t))  # fmt: skip
    causal = results[3]
    assert torch.equal(results[0], results[2]) and torch.equal(results[0], results[4])
    assert same_bits(results[1], causal) and not torch.equal(results[0], causal)
    c = cache.clone()
    flash_out = kernel.decode_flash_out(q, c.k, c.v, c.lengths, block_table=c.block_table,
                                        k_new=k_new, v_new=v_new, tree_mask=tree)  # fmt: skip
    assert same_bits(flash_out.transpose(1, 2), results[0])
    for _ in range(2):  # the second from its plan
        c = cache.clone()
        flash = kernel.decode_flash(q.transpose(1, 2), c.k, c.v, c.lengths,
                                    block_table=c.block_table, k_new=k_new.transpose(1, 2),
                                    v_new=v_new.transpose(1, 2), tree_mask=tree)  # fmt: skip
        assert same_bits(flash.transpose(1, 2), results[0])


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t, q: t.to(torch.uint8), "torch.bool tensor [2, 4, 4] or [4, 4]"),
        (lambda t, q: t[:, :3, :3], "got [2, 3, 3]"),
        (lambda t, q: t[0, :, :3], "got [4, 3]"),
        (lambda t, q: t[:1], "got [1, 4, 4]"),
        (lambda t, q: t.to("meta"), "on cpu, got [2, 4, 4] torch.bool on meta"),
        (lambda t, q: t.tolist(), "got list"),
    ],
)
def test_bad_tree_masks_raise_naming_them(change, message):
    _, kernel, cache, q, k_new, v_new, _, tree = _small_step()
    before = cache.clone()
    with pytest.raises(ValueError, match=r"^tree_mask: ") as info:
        run_decode(kernel, cache, q, k_new, v_new, tree_mask=change(tree, q))
    assert message in str(info.value)
    assert same_bits(cache.k, before.k)  # refused before the append


def test_tree_mask_is_refused_with_rotary_and_in_alibi_modules():
    _, kernel, cache, q, k_new, v_new, _, tree = _small_step()
    cos = sin = torch.ones(64, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^tree_mask: not with rotary_cos: .*tree depth"):
        run_decode(kernel, cache, q, k_new, v_new, tree_mask=tree, rotary_cos=cos, rotary_sin=sin)
    _, kernel, cache, q, k_new, v_new, slopes, tree = _small_step(alibi=True)
    with pytest.raises(ValueError, match=r"^tree_mask: not in an ALiBi module"):
        run_decode(kernel, cache, q, k_new, v_new, slopes, tree_mask=tree)


class _Reads(TorchDispatchMode):
    """Records every aten op whose arguments hold `watched` (a read of its data on the host
    would be one: .item(), .tolist(), .any(), a copy to the CPU)."""

    def __init__(self, watched):
        super().__init__()
        self.watched, self.ops = watched, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = list(args) + list((kwargs or {}).values())
        if any(a is self.watched for a in flat):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_call_never_reads_the_tree_on_the_host(monkeypatch):
    """CUDA-graph friendliness: the host checks read tree_mask's metadata only (no op on it:
    no sync); the kernel takes its address. Launches are stubbed, so every op seen would be
    the host's."""
    _, kernel, cache, q, k_new, v_new, _, tree = _small_step()
    launched = []
    monkeypatch.setattr(kernel, "_run_step", lambda step, device, tensors, *a: launched.append(
        [t.data_ptr() for t in tensors]))  # fmt: skip
    for _ in range(2):  # the full path, then the plan
        with _Reads(tree) as reads:
            run_decode(kernel, cache, q, k_new, v_new, tree_mask=tree)
        assert set(reads.ops) <= {"aten.view.dtype"}, reads.ops  # the kernel's uint8 view
    assert any(tree.data_ptr() in ptrs for ptrs in launched)


# ---------------------------------------------------------------- flash_attn_with_kvcache


@pytest.fixture(scope="module")
def tree_kernels(tmp_path_factory):
    common = dict(dtype="bf16", num_q_heads=4, num_kv_heads=2, mask="causal",
                  causal_align="bottom_right")  # fmt: skip
    specs = [
        dict(
            name="treec",
            kv_layout="contiguous",
            kernels=["decode"],
            head_dim=16,
            max_query_tokens=4,
            **common,
        ),
        dict(name="treev", kernels=["varlen"], head_dim=32, **common),
    ]
    folder = build_folder(tmp_path_factory.mktemp("tree_kernels"), specs)
    saved = registry_module._current
    yield load_kernels(folder, replace=True)
    registry_module._current = saved


def _flash_tensors(head_dim=16, seed=3):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(2, 12, 2, head_dim, generator=gen).bfloat16() for _ in "kv")
    q, k, v = (torch.randn(2, 4, h, head_dim, generator=gen).bfloat16() for h in (4, 2, 2))
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    return q, k_cache, v_cache, k, v, lengths


def test_flash_attn_with_kvcache_takes_tree_mask(tree_kernels):
    import attngen

    q, k_cache, v_cache, k, v, lengths = _flash_tensors()
    tree = torch.stack([random_tree(4, torch.Generator().manual_seed(s)) for s in (5, 6)])
    direct = (k_cache.clone(), v_cache.clone())
    for _ in range(2):
        caches = (k_cache.clone(), v_cache.clone())
        out = attngen.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lengths,
                                              causal=True, tree_mask=tree)  # fmt: skip
        assert attngen.last_dispatch().need.kind.value == "decode"
        module = tree_kernels.module(attngen.last_dispatch().key)
        expected = module.decode_flash(q, *direct if _ == 0 else (k_cache.clone(),
                                       v_cache.clone()), lengths, k_new=k, v_new=v,
                                       tree_mask=tree)  # fmt: skip
        assert same_bits(out, expected)
    plain = attngen.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                            cache_seqlens=lengths, causal=True)  # fmt: skip
    assert not torch.equal(plain, out)


def test_flash_attn_with_kvcache_refuses_trees_it_cannot_serve(tree_kernels):
    import attngen

    q, k_cache, v_cache, k, v, lengths = _flash_tensors()
    tree = chain(4)
    cos = sin = torch.ones(16, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^tree_mask: not with rotary_cos"):
        attngen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lengths,
                                        causal=True, tree_mask=tree)  # fmt: skip
    with pytest.raises(ValueError, match=r"^tree_mask: needs a decode module"):
        attngen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                        cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32),
                                        causal=True, tree_mask=tree)  # fmt: skip
    q, k_cache, v_cache, k, v, lengths = _flash_tensors(head_dim=32)  # the varlen module only
    before = k_cache.clone()
    with pytest.raises(ValueError, match=r"^tree_mask: needs a decode module"):
        attngen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                        causal=True, tree_mask=tree)  # fmt: skip
    assert torch.equal(k_cache, before)  # refused before route 2's append


def test_the_absorbed_mla_decode_takes_a_tree():
    """DeepSeek-V3's latent + rope decode (values its keys' first 512 dims), 4 drafts already in
    the cache as a tree, two splits: against the float64 reference."""
    from tests.test_mla_decode import LATENT, ROPE, latent_cache

    spec = make_decode_spec("paged", 64, dtype="bf16", head_dim=LATENT + ROPE, head_dim_v=LATENT,
                            num_q_heads=16, num_kv_heads=1, kernels=["decode"], mask="causal",
                            causal_align="bottom_right", max_query_tokens=4)  # fmt: skip
    kernel = load_decode(spec, 32)
    cache = latent_cache(spec, [70, 5], seed=8)
    q, _, _, _ = make_queries(spec, 2, 4, seed=8)
    tree = torch.stack([random_tree(4, torch.Generator().manual_seed(s)) for s in (7, 8)])
    kernel.FORCE_NUM_SPLITS = 2
    try:
        out, lse = run_decode(kernel, cache, q, tree_mask=tree)
    finally:
        kernel.FORCE_NUM_SPLITS = None
    problems = decode_problems(spec, cache, out, lse, q, tree=tree)
    assert not problems, "; ".join(problems)


def test_the_op_path_passes_the_tree(tree_kernels):
    """Inputs that need a gradient take the attngen::decode op (as torch.compile does): the
    tree reaches the module there too."""
    import attngen

    q, k_cache, v_cache, k, v, lengths = _flash_tensors()
    tree = torch.stack([random_tree(4, torch.Generator().manual_seed(s)) for s in (5, 6)])
    options = dict(cache_seqlens=lengths, causal=True, tree_mask=tree)
    direct = attngen.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, **options)
    q.requires_grad_()
    op = attngen.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, **options)
    assert op.requires_grad and same_bits(op.detach(), direct)
