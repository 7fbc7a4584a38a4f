"""End to end: a small random-weight Llama from transformers generates through attngen kernels.

The spec comes from the model's config (attngen.spec_from_config), the kernels are built into
a temporary folder and loaded, and greedy generate() with attn_implementation="attngen" must
give the tokens of attn_implementation="sdpa", for a batch of prompts of different lengths
(left padding: prefill and decode run unpadded through the varlen kind) and for a batch
without padding (the prefill kind). The dispatch log must show generated kernels for the
prefill and for every decode step, and no fallback.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import attngen
from attngen.build import plan_build, write_build
from attngen.runtime import ops
from attngen.runtime.registry import current_registry, load_kernels, use_registry

NEW_TOKENS = 6
LAYERS = 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        dtype="float32",
    )
    specs = attngen.spec_from_config(config, archs=["sm90"], name="tiny_llama")
    folder = tmp_path_factory.mktemp("llama_kernels")
    write_build(plan_build(specs), folder)
    saved = current_registry()
    load_kernels(folder, replace=True)
    assert attngen.register_transformers() == "attngen"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    yield model
    use_registry(saved)


def _generate(model, implementation, ids, mask):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )


def _prompts(padded: bool):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    if padded:  # the first prompt is 5 tokens, left-padded to 9
        ids[0, :4], mask[0, :4] = 0, 0
    return ids, mask


@pytest.mark.parametrize(("padded", "kind"), [(True, "varlen"), (False, "prefill")])
def test_generate_matches_sdpa(llama, padded, kind):
    ids, mask = _prompts(padded)
    expected = _generate(llama, "sdpa", ids, mask)
    ops.reset_run_counts()
    with attngen.dispatch_log() as log:
        got = _generate(llama, "attngen", ids, mask)
    assert torch.equal(got.sequences, expected.sequences)
    # Note: both runs are fp32; the attention outputs differ only in summation order (blocked
    # online softmax against SDPA's kernel), a few fp32 ulps, and two layers of a 64-wide
    # model keep the logits within about 1e-6 of each other (1.2e-7 measured). 1e-4 leaves
    # that a wide margin while a key seen wrongly (a padded or future token) moves logits by
    # far more.
    for step, (a, b) in enumerate(zip(got.logits, expected.logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"logits of step {step}")
    # one prefill forward and NEW_TOKENS - 1 decode forwards, each through every layer
    assert len(log) == LAYERS * NEW_TOKENS
    assert all(
        d.fallback is None and d.module == f"sm90/tiny_llama_{kind}_fp32_d16_causal_br" for d in log
    )
    prefill, decode = log[:LAYERS], log[LAYERS:]
    assert all(d.need.seqlen_q == 9 and d.api == "transformers" for d in prefill)
    assert all(d.need.seqlen_q == 1 for d in decode)
    assert list(ops.run_counts().values()) == [LAYERS * NEW_TOKENS]


def test_refusals_name_the_feature(llama):
    layer = llama.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with pytest.raises(attngen.NoKernelError, match="attention_mask: got shape"):
        attngen.runtime.hf.attngen_attention(layer, q, k, v, torch.zeros(1, 1, 3, 3))
    with pytest.raises(attngen.NoKernelError, match="output_attentions"):
        attngen.runtime.hf.attngen_attention(layer, q, k, v, None, output_attentions=True)
    packed = torch.tensor([[0, 1, 0]])
    with pytest.raises(attngen.NoKernelError, match="position_ids restart"):
        attngen.runtime.hf.attngen_attention(layer, q, k, v, None, position_ids=packed)


def test_position_ids_are_read_once_per_tensor_version(llama, monkeypatch):
    """Every layer of a forward gets the same position_ids: the monotone check reads the
    device once for it (a host read per layer stalls eager prefill), and again after an
    in-place write."""
    layer = llama.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    positions = torch.tensor([[0, 1, 2]])
    reads = []
    check = attngen.runtime.hf._CheckedPositions.remember
    monkeypatch.setattr(
        attngen.runtime.hf._CheckedPositions,
        "remember",
        classmethod(lambda cls, p: (reads.append(1), check.__func__(cls, p))),
    )
    for _ in range(3):
        attngen.runtime.hf.attngen_attention(layer, q, k, v, None, position_ids=positions)
    assert len(reads) == 1
    positions[0, 2] = 0  # the same tensor, now packed: its version moved, so it is read again
    with pytest.raises(attngen.NoKernelError, match="position_ids restart"):
        attngen.runtime.hf.attngen_attention(layer, q, k, v, None, position_ids=positions)


def test_inference_mode_position_ids_are_read_on_every_call(llama):
    """An inference tensor has no version counter: its in-place writes cannot be seen, so the
    check reads it on every call (and does not fail on the missing counter)."""
    layer = llama.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with torch.inference_mode():
        positions = torch.tensor([[0, 1, 2]])
        attngen.runtime.hf.attngen_attention(layer, q, k, v, None, position_ids=positions)
        positions[0, 2] = 0
        with pytest.raises(attngen.NoKernelError, match="position_ids restart"):
            attngen.runtime.hf.attngen_attention(layer, q, k, v, None, position_ids=positions)
