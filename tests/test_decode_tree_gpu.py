"""Tree drafts on a CUDA GPU (the H200): `pytest -m gpu tests/test_decode_tree_gpu.py`.

The CPU file's property test on the device (tests/test_decode_tree.py: random trees against the
float64 reference with the same visibility), Llama-3's decode shapes with 8 and 16 draft tokens
as a tree (contiguous and paged 16, L 4k and 32k, splits from the rule), a chain bit for bit
equal to the causal step, and a CUDA graph that captures a tree step and replays it with the
tree's contents changed in place (the kernel reads the mask on the device; the host never
does). The speed against a chain is tools/bench_decode_tree.py's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from tests.decode_harness import (
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
)
from tests.test_decode_tree import chain, random_tree, run_tree_case, tree_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]

LLAMA = dict(dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8, mask="causal",
             causal_align="bottom_right", max_query_tokens=16)  # fmt: skip


@given(tree_case())
def test_tree_properties_on_the_gpu(case):
    problems, _, _ = run_tree_case(case, "cuda")
    assert not problems, "; ".join(problems)


def _trees(batch, tokens, seed):
    return torch.stack([random_tree(tokens, torch.Generator().manual_seed(seed + b))
                        for b in range(batch)])  # fmt: skip


def _step(kernel, cache, q, k_new, v_new, tree):
    return kernel.decode(q, cache.k, cache.v, cache.lengths, block_table=cache.block_table,
                         k_new=k_new, v_new=v_new, return_lse=True, tree_mask=tree)  # fmt: skip


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 16)])
@pytest.mark.parametrize("length", [4096, 32768])
@pytest.mark.parametrize("tokens", [8, 16])
def test_llama3_tree_steps_against_float64(layout, page_size, length, tokens):
    spec = make_decode_spec(layout, page_size, **LLAMA)
    kernel = load_decode(spec)
    cache = make_cache(spec, [length - tokens, length // 3], seed=length + tokens, room=tokens)
    q, k_new, v_new, _ = make_queries(spec, 2, tokens, seed=tokens, num_new=tokens)
    tree = _trees(2, tokens, seed=tokens)
    on = cache.to("cuda")
    out, lse = _step(kernel, on, q.cuda(), k_new.cuda(), v_new.cuda(), tree.cuda())
    problems = decode_problems(spec, cache, out.cpu(), lse.cpu(), q, k_new, v_new, tree=tree)
    assert not problems, "; ".join(problems)
    # A chain is the causal step: against float64 as a tree, and beside the causal step within
    # two bf16 ulps (bf16's epsilon 2**-7; RELIABILITY's floor at the output's mean magnitude)
    # and, for lse, the rounding of fp32 sums taken in another order. Not bit for bit as under
    # the interpreter (tests/test_decode_tree.py): TREE is a constexpr, so the two are
    # different compiled programs whose reduction layouts and contractions Triton chooses
    # (seen on the H100: the outputs differ in their last bits).
    causal = _step(kernel, cache.to("cuda"), q.cuda(), k_new.cuda(), v_new.cuda(), None)
    chained = _step(kernel, cache.to("cuda"), q.cuda(), k_new.cuda(), v_new.cuda(),
                    chain(tokens).cuda())  # fmt: skip
    problems = decode_problems(spec, cache, chained[0].cpu(), chained[1].cpu(), q, k_new, v_new,
                               tree=chain(tokens))  # fmt: skip
    assert not problems, "; ".join(problems)
    ulps = 2 * 2**-7
    torch.testing.assert_close(
        chained[0], causal[0], rtol=ulps, atol=ulps * causal[0].abs().mean().item()
    )
    torch.testing.assert_close(chained[1], causal[1], rtol=0, atol=1e-5)


def test_a_tree_step_replays_from_a_cuda_graph_with_the_tree_changed_in_place():
    """The append rewrites the same slots at each replay (cache_seqlens unchanged), so every
    replay is the eager step over the tree's current contents."""
    spec = make_decode_spec("paged", 16, **LLAMA)
    kernel = load_decode(spec)
    cache = make_cache(spec, [5000, 300, 8191], seed=3, room=8).to("cuda")
    q, k_new, v_new, _ = make_queries(spec, 3, 8, seed=3, num_new=8)
    q, k_new, v_new = q.cuda(), k_new.cuda(), v_new.cuda()
    first, second = _trees(3, 8, seed=1).cuda(), _trees(3, 8, seed=50).cuda()
    assert not torch.equal(first, second)
    tree = first.clone()
    _step(kernel, cache.clone(), q, k_new, v_new, tree)  # compiled and planned before the capture
    graph, replayed = torch.cuda.CUDAGraph(), cache.clone()
    with torch.cuda.graph(graph):
        out, lse = _step(kernel, replayed, q, k_new, v_new, tree)
    for contents in (first, second):
        tree.copy_(contents)
        graph.replay()
        torch.cuda.synchronize()
        expected = _step(kernel, cache.clone(), q, k_new, v_new, contents.clone())
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
