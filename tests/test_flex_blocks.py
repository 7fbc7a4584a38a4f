"""attngen.create_block_mask gives torch's block tensors (create_block_mask on the CPU,
uncompiled) for every mask function, shape and block size, in chunks of any size."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, or_masks
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

import attngen
from attngen.runtime.flex import blocks
from attngen.runtime.flex.trace import TraceError

LENGTH = 300
docs = torch.tensor([0] * 70 + [1] * 130 + [2] * 100, dtype=torch.int32)
docs_b = torch.tensor([[0] * 150 + [1] * 150, [0] * 20 + [1] * 280])
prefix = torch.tensor([40, 200])


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 64)


def document(b, h, q_idx, kv_idx):
    return docs[q_idx] == docs[kv_idx]


def document_batched(b, h, q_idx, kv_idx):
    return docs_b[b, q_idx] == docs_b[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < prefix[b]) | (q_idx >= kv_idx)


def per_head(b, h, q_idx, kv_idx):
    return (q_idx + 37 * h) % 7 != 0


def nothing(b, h, q_idx, kv_idx):
    return q_idx < 0


def past_the_end(b, h, q_idx, kv_idx):  # reads past docs for kv_idx >= 250: masked in both
    return docs[kv_idx + 50] >= 0


MASKS = [causal, sliding, document, document_batched, prefix_lm, per_head, nothing]
MASKS += [and_masks(causal, document), or_masks(sliding, prefix_lm)]
SHAPES = [
    (2, 3, LENGTH, LENGTH, 128),
    (None, None, LENGTH, 200, 64),
    (2, None, 257, 129, (32, 64)),
    (None, 2, 100, LENGTH, 128),
    (1, 1, 1, 1, 16),
]
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask_mod", MASKS, ids=lambda f: f.__name__)
def test_block_tensors_equal_torchs(mask_mod, shape, monkeypatch) -> None:
    batch, heads, q_len, kv_len, block = shape
    expected = torch_block_mask(mask_mod, batch, heads, q_len, kv_len, "cpu", block)
    for chunk in (blocks.CHUNK_ELEMENTS, 1 << 12):  # one step, and many rows and (b, h) pairs
        monkeypatch.setattr(blocks, "CHUNK_ELEMENTS", chunk)
        got = attngen.create_block_mask(mask_mod, batch, heads, q_len, kv_len, "cpu", block)
        for field in FIELDS:
            want, have = getattr(expected, field), getattr(got, field)
            assert have.dtype == want.dtype == torch.int32, field
            assert torch.equal(have, want), (field, chunk)
        assert got.BLOCK_SIZE == expected.BLOCK_SIZE and got.shape == expected.shape
        assert got.seq_lengths == (q_len, kv_len) and got.mask_mod is mask_mod


def test_a_read_past_a_tensor_masks_as_torch_would_pad() -> None:
    got = attngen.create_block_mask(past_the_end, None, None, LENGTH, LENGTH, "cpu", 50)
    assert got.kv_num_blocks.sum() == 0
    assert got.full_kv_num_blocks[0, 0, 0].item() == 5  # key blocks 0..4 (keys < 250) kept


def test_the_mask_tree_and_its_tensors_are_kept() -> None:
    got = attngen.create_block_mask(document, 1, 1, LENGTH, LENGTH, "cpu")
    assert str(got.expr) == "(docs[q_idx] == docs[kv_idx])"
    assert [t.name for t in got.tensors] == ["docs"]
    assert "docs[q_idx]" in repr(got)


BAD_ARGUMENTS = [
    (dict(B=0), "B: got 0; allowed: None (broadcast) or an int >= 1"),
    (dict(H=2.0), "H: got 2.0"),
    (dict(Q_LEN=True), "Q_LEN: got True; allowed: an int >= 1"),
    (dict(KV_LEN=-3), "KV_LEN: got -3"),
    (dict(BLOCK_SIZE=(64,)), "BLOCK_SIZE: got (64,); allowed: an int >= 1 or a pair"),
    (dict(BLOCK_SIZE=0), "BLOCK_SIZE: got 0"),
]


@pytest.mark.parametrize(("change", "words"), BAD_ARGUMENTS, ids=str)
def test_bad_arguments_are_refused_by_name(change, words) -> None:
    arguments = dict(mask_mod=causal, B=1, H=1, Q_LEN=8, KV_LEN=8, device="cpu") | change
    with pytest.raises(ValueError, match="create_block_mask: ") as info:
        attngen.create_block_mask(**arguments)
    assert words in str(info.value)


def test_a_mask_mod_the_tracer_cannot_express_is_refused() -> None:
    def branchy(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if b > 0 else True

    with pytest.raises(TraceError, match="mask_mod .*branchy: a traced value used as a Python"):
        attngen.create_block_mask(branchy, 1, 1, 8, 8, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tensor_on_another_device_is_refused() -> None:
    with pytest.raises(ValueError, match="reads docs on cpu; allowed: tensors on the device"):
        attngen.create_block_mask(document, 1, 1, LENGTH, LENGTH, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_masks_on_the_gpu_equal_torchs_without_a_host_sync() -> None:
    on_gpu = docs.cuda()

    def document_gpu(b, h, q_idx, kv_idx):
        return on_gpu[q_idx] == on_gpu[kv_idx]

    expected = torch_block_mask(document_gpu, 2, 4, LENGTH, LENGTH, "cuda")
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        got = attngen.create_block_mask(document_gpu, 2, 4, LENGTH, LENGTH, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(expected, field)), field
