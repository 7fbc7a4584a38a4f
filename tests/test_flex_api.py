"""attngen.flex_attention against torch's flex_attention (eager, on the CPU; the kernels under
Triton's interpreter): the attention-gym masks and score mods, GQA, Nq != Nk, head_dim !=
head_dim_v, fully masked rows, batch-1 keys, both kinds of BlockMask; arguments refused by
name; no silent fallback (on-demand builds off, a device without kernels). Gradients:
tests/test_flex_grad.py."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, and_masks
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attngen
from attngen.runtime import NoKernelError, last_dispatch
from tests.ondemand_harness import on_demand  # noqa: F401 - a fixture

B, HQ, HKV, L, S, D, DV = 2, 4, 2, 37, 45, 16, 24
torch.manual_seed(0)
prefix = torch.tensor([5, 30])
docs = torch.sort(torch.randint(0, 4, (B, S)), dim=-1).values.to(torch.int32)
slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
bias = torch.randn(HQ, L + S)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 8)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < prefix[b]) | (q_idx >= kv_idx)


def document(b, h, q_idx, kv_idx):
    return docs[b, q_idx] == docs[b, kv_idx]


def late_keys(b, h, q_idx, kv_idx):  # rows q_idx < 10 see no key: out 0, lse -inf
    return (kv_idx >= 40) & (q_idx >= 10)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(score / 3.0)


def relative(score, b, h, q_idx, kv_idx):
    return score + bias[h, q_idx - kv_idx + S]


def masking_score(score, b, h, q_idx, kv_idx):
    return torch.where(kv_idx % 3 == 0, -float("inf"), score)


CASES = [
    (None, causal),
    (None, sliding),
    (None, prefix_lm),
    (None, document),
    (None, late_keys),
    (alibi, None),
    (softcap, None),
    (relative, and_masks(causal, document)),
    (masking_score, sliding),
]


def _inputs(dtype=torch.float32, kv_batch=B):
    q = torch.randn(B, HQ, L, D, dtype=dtype)
    k = torch.randn(kv_batch, HKV, S, D, dtype=dtype)
    v = torch.randn(kv_batch, HKV, S, DV, dtype=dtype)
    return q, k, v


def _torch(q, k, v, score_mod, mask_mod, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lengths = (q.shape[-2], k.shape[-2])
        block = (
            None if mask_mod is None else torch_block_mask(mask_mod, B, None, *lengths, q.device)
        )
        return torch_flex(q, k, v, score_mod, block, enable_gqa=True, return_lse=True, **options)


def _check(out, lse, q, k, v, score_mod, mask_mod, factor=2.0):
    """RELIABILITY.md's rule: |attngen - float64| <= factor * |torch fp32 - float64| + floor;
    -inf LSE (and 0 output) exactly where the float64 reference has them."""
    golden, golden_lse = _torch(q.double(), k.double(), v.double(), score_mod, mask_mod)
    lowp, lowp_lse = _torch(q, k, v, score_mod, mask_mod)
    for got, want, ref in ((out, golden, lowp), (lse, golden_lse, lowp_lse)):
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and not got.isnan().any()
        finite = ~torch.isinf(want)
        err = (got.double() - want)[finite].abs()
        bound = (ref.double() - want)[finite].abs()
        floor = 2 * torch.finfo(got.dtype).eps * want[finite].abs().max().clamp_min(1)
        assert err.max() <= factor * bound.max() + floor, (err.max(), bound.max())
        assert err.mean() <= 1.5 * factor * bound.mean() + floor
    rows = torch.isinf(golden_lse)
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))


@pytest.mark.parametrize(("score_mod", "mask_mod"), CASES, ids=lambda f: getattr(f, "__name__", f))
def test_flex_attention_equals_torchs(on_demand, score_mod, mask_mod) -> None:  # noqa: F811
    q, k, v = _inputs()
    block = None if mask_mod is None else attngen.create_block_mask(mask_mod, B, None, L, S, "cpu")
    out, lse = attngen.flex_attention(q, k, v, score_mod, block, enable_gqa=True, return_lse=True)
    assert out.shape == (B, HQ, L, DV) and lse.shape == (B, HQ, L) and lse.dtype == torch.float32
    _check(out, lse, q, k, v, score_mod, mask_mod, 3.0 if score_mod is softcap else 2.0)
    dispatch = last_dispatch()
    assert dispatch.api == "flex_attention" and dispatch.built and dispatch.source == "cache"
    assert dispatch.module.startswith("sm80/auto_h4kv2_prefill_fp32_d16_dv24")
    again = attngen.flex_attention(q, k, v, score_mod, block, enable_gqa=True)
    assert torch.equal(again, out)  # bitwise, and from the kept module
    assert not last_dispatch().built and last_dispatch().key == dispatch.key


def test_torchs_block_mask_and_options(on_demand) -> None:  # noqa: F811
    q, k, v = _inputs(torch.float16, kv_batch=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = torch_block_mask(prefix_lm, B, None, L, S, "cpu")
        want = torch_flex(
            q,
            k.expand(B, -1, -1, -1),
            v.expand(B, -1, -1, -1),
            alibi,
            block,
            scale=0.3,
            enable_gqa=True,
        )
    out, aux = attngen.flex_attention(
        q, k, v, alibi, block, scale=0.3, enable_gqa=True, return_aux=AuxRequest(lse=True)
    )
    assert out.dtype == torch.float16 and aux.lse.shape == (B, HQ, L) and aux.max_scores is None
    # fp16 outputs of magnitude <= 1, each side rounded once from an fp32 accumulation in
    # another order: about 1-2 fp16 ulps (2**-10 at 1) apart; 4e-3 is four, a wrong mask O(0.1)
    assert (out.float() - want.float()).abs().max() < 4e-3
    assert "fp16" in last_dispatch().module


def test_a_torch_block_mask_without_mask_mod_keeps_its_blocks(on_demand) -> None:  # noqa: F811
    q, k, v = _inputs()
    rows, cols = -(-L // 16), -(-S // 16)
    listed = torch.rand(B, 1, rows, cols) < 0.5
    num = listed.sum(-1).to(torch.int32)
    indices = torch.argsort(listed.to(torch.int32), dim=-1, descending=True, stable=True)
    block = BlockMask.from_kv_blocks(
        num, indices.to(torch.int32), BLOCK_SIZE=16, seq_lengths=(L, S)
    )
    dense = listed.repeat_interleave(16, 2).repeat_interleave(16, 3)[:, :, :L, :S]

    def blocks_of(b, h, q_idx, kv_idx):
        return dense[b, 0, q_idx, kv_idx]

    out, lse = attngen.flex_attention(q, k, v, None, block, enable_gqa=True, return_lse=True)
    _check(out, lse, q, k, v, None, blocks_of)


def test_the_kernel_skips_the_blocks_a_block_mask_leaves_out(on_demand) -> None:  # noqa: F811
    """A block mask's lists reach the kernel: a block dropped from kv_indices contributes
    nothing (compiled Flex's meaning: the lists win over mask_mod), the dispatch says so."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(B, h, 256, d) for h, d in ((HQ, D), (HKV, D), (HKV, DV)))

    def banded(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 160) & (kv_idx - q_idx <= 160)

    block = attngen.create_block_mask(banded, B, None, 256, 256, "cpu")
    assert int(block.kv_num_blocks[0, 0, 1]) + int(block.full_kv_num_blocks[0, 0, 1]) == 2
    listed = torch.zeros(B, 1, 2, 2, dtype=torch.bool)
    for num, idx in ((block.kv_num_blocks, block.kv_indices),
                     (block.full_kv_num_blocks, block.full_kv_indices)):  # fmt: skip
        for b, r in itertools.product(range(B), range(2)):
            listed[b, 0, r, idx[b, 0, r, : num[b, 0, r]].long()] = True
    row = (0, 0, 1)  # batch 0's second query block loses key block 0
    for num, idx in ((block.kv_num_blocks, block.kv_indices),
                     (block.full_kv_num_blocks, block.full_kv_indices)):  # fmt: skip
        names = idx[row][: num[row]].tolist()
        if 0 in names:
            names.remove(0)
            idx[row][: len(names)] = torch.tensor(names, dtype=idx.dtype)
            num[row] -= 1
    listed[0, 0, 1, 0] = False
    out, lse = attngen.flex_attention(q, k, v, None, block, enable_gqa=True, return_lse=True)
    assert "listed key blocks only" in last_dispatch().reason

    def kept(b, h, q_idx, kv_idx):
        return banded(b, h, q_idx, kv_idx) & listed[b, 0, q_idx // 128, kv_idx // 128]

    _check(out, lse, q, k, v, None, kept)

    def striped(b, h, q_idx, kv_idx):  # not a built-in mask: the expression kernels run it
        return banded(b, h, q_idx, kv_idx) & (kv_idx % 2 == 0)

    fine = attngen.create_block_mask(striped, B, None, 256, 256, "cpu", BLOCK_SIZE=8)
    dense, dense_lse = attngen.flex_attention(q, k, v, None, fine, enable_gqa=True, return_lse=True)
    assert "not used to skip blocks" in last_dispatch().reason  # tiles of 16 or more
    _check(dense, dense_lse, q, k, v, None, striped)


def test_without_on_demand_builds_the_call_is_refused() -> None:
    q, k, v = _inputs()
    with pytest.raises(NoKernelError, match="built on demand, and on-demand builds are off"):
        attngen.flex_attention(q, k, v, softcap, enable_gqa=True)


def test_a_device_without_kernels_is_refused(on_demand) -> None:  # noqa: F811
    q, k, v = (t.to("meta") for t in _inputs())
    with pytest.raises(NoKernelError, match="device type 'meta'"):
        attngen.flex_attention(q, k, v, enable_gqa=True)


def _bad(**change):
    q, k, v = _inputs()
    arguments = dict(query=q, key=k, value=v, enable_gqa=True) | change
    return arguments


BAD = [
    (_bad(scale=0.0), "scale: got 0.0; allowed: None or a finite float > 0"),
    (_bad(scale=math.nan), "scale: got nan"),
    (_bad(scale=True), "scale: got True"),
    (_bad(enable_gqa=1), "enable_gqa: got 1; allowed: True or False"),
    (_bad(enable_gqa=False), "key's heads 2; allowed: 4"),
    (_bad(return_lse="yes"), "return_lse: got 'yes'"),
    (_bad(kernel_options={"BLOCK_M": 64}), "kernel_options: got {'BLOCK_M': 64}; allowed: None"),
    (_bad(return_aux=AuxRequest(lse=True, max_scores=True)), "return_aux: got"),
    (_bad(query=torch.randn(B, HQ, L)), "query: got (2, 4, 37); allowed: a 4-D tensor"),
    (_bad(key=torch.randn(B, HKV, S, D).double()), "key: torch.float64 on cpu; allowed"),
    (_bad(value=torch.randn(B, HKV, S + 1, DV)), "allowed: key [B, HKV, S, 16], value"),
    (_bad(key=torch.randn(3, HKV, S, D), value=torch.randn(3, HKV, S, DV)), "key's batch 3"),
    (_bad(key=torch.randn(B, 3, S, D), value=torch.randn(B, 3, S, DV)), "key's heads 3"),
    (_bad(block_mask="causal"), "block_mask: got str; allowed: None"),
    (_bad(score_mod=3), "score_mod: got 3; allowed: a Python function or None"),
]


@pytest.mark.parametrize(("arguments", "words"), BAD, ids=lambda x: str(x)[:40])
def test_bad_arguments_are_refused_by_name(arguments, words) -> None:
    with pytest.raises(ValueError, match="flex_attention|score_mod") as info:
        attngen.flex_attention(**arguments)
    assert words in str(info.value)


def test_a_block_mask_for_other_lengths_is_refused() -> None:
    q, k, v = _inputs()
    block = attngen.create_block_mask(causal, B, None, L + 1, S, "cpu")
    with pytest.raises(ValueError, match=r"block_mask: made for shape \(2, 1, 38, 45\); allowed"):
        attngen.flex_attention(q, k, v, block_mask=block, enable_gqa=True)


def test_a_captured_tensor_on_another_device_is_refused() -> None:
    q, k, v = (t.to("meta") for t in _inputs())
    with pytest.raises(ValueError, match="captured tensor slopes is on cpu; allowed: query's"):
        attngen.flex_attention(q, k, v, alibi, enable_gqa=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("score_mod", "mask_mod"), CASES, ids=lambda f: getattr(f, "__name__", f))
def test_flex_attention_on_the_gpu_equals_torchs(on_demand, score_mod, mask_mod) -> None:  # noqa: F811
    global prefix, docs, slopes, bias
    saved = prefix, docs, slopes, bias
    prefix, docs, slopes, bias = (t.cuda() for t in saved)
    try:
        q, k, v = (t.cuda() for t in _inputs(torch.bfloat16))
        block = None if mask_mod is None else attngen.create_block_mask(mask_mod, B, None, L, S)
        out, lse = attngen.flex_attention(
            q, k, v, score_mod, block, enable_gqa=True, return_lse=True
        )
        _check(out, lse, q, k, v, score_mod, mask_mod, 3.0 if score_mod is softcap else 2.0)
        assert last_dispatch().module.startswith("sm")
    finally:
        prefix, docs, slopes, bias = saved


def test_an_identity_score_mod_and_a_keep_all_mask_are_the_plain_module(on_demand) -> None:  # noqa: F811
    q, k, v = _inputs()
    plain = attngen.flex_attention(q, k, v, enable_gqa=True)
    key = last_dispatch().key
    block = attngen.create_block_mask(lambda b, h, i, j: True, None, None, L, S, "cpu")
    same = attngen.flex_attention(q, k, v, lambda s, b, h, i, j: s, block, enable_gqa=True)
    assert last_dispatch().key == key and last_dispatch().need.expressions == ""
    assert torch.equal(plain, same)
