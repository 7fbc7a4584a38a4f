"""transformers' static and dynamic caches through the "attngen" implementation
(attngen/runtime/hf.py).

A tiny random-weight Llama (fp32) with kernels built from its config plus a contiguous decode
module generates greedily with cache_implementation="static": the tokens and logits are
eager attention's, the decode steps run on the decode module (dispatch), a left-padded batch
takes the varlen route and is exact too, and a decode step of a hand-driven StaticCache
reads no device value on the host (the property a CUDA-graph capture needs) and traces with
torch.compile(fullgraph=True). With transformers' DynamicCache the decode steps run on the
same decode module (the prefill on the prefill kind), and on the prefill kind without one.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import attngen
from attngen.build import plan_build, write_build
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import specs_from_data
from attngen.spec.hf import spec_data_from_config

NEW_TOKENS = 4
LAYERS = 2
DECODE = "sm90/tiny_llama_decode_fp32_d16_causal_br_contig"
PREFILL = "sm90/tiny_llama_prefill_fp32_d16_causal_br"
VARLEN = "sm90/tiny_llama_varlen_fp32_d16_causal_br"


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
    data = spec_data_from_config(config, archs=["sm90"], name="tiny_llama")
    data.update(kernels=["prefill", "varlen", "decode"], kv_layout="contiguous")
    folder = tmp_path_factory.mktemp("llama_static_kernels")
    write_build(plan_build(specs_from_data(data)), folder)
    saved = current_registry()
    load_kernels(folder, replace=True)
    attngen.register_transformers()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    yield model
    use_registry(saved)


def _generate(model, implementation, ids, mask, cache="static"):
    """Greedy tokens and logits; cache "static" or "dynamic" (transformers' default)."""
    model.set_attn_implementation(implementation)
    options = {"cache_implementation": "static"} if cache == "static" else {}
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
            **options,
        )


def _prompts(padded: bool):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 7), generator=gen)
    mask = torch.ones(2, 7, dtype=torch.long)
    if padded:  # the first prompt is 4 tokens, left-padded to 7
        ids[0, :3], mask[0, :3] = 0, 0
    return ids, mask


def _assert_same_generation(got, expected):
    """The same greedy tokens and, at every step, the same logits within 1e-4."""
    assert torch.equal(got.sequences, expected.sequences)
    # Note: fp32 both; the outputs differ in summation order only (split-KV or blocked online
    # softmax against eager's matmul-softmax-matmul), a few fp32 ulps, and two layers of a
    # 64-wide model keep the logits within about 1e-6 (1.2e-7 measured). A key seen wrongly
    # (padding, or a cache position not written yet) moves them by far more than 1e-4.
    for step, (a, b) in enumerate(zip(got.logits, expected.logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"logits of step {step}")


@pytest.mark.parametrize(("padded", "step_module"), [(False, DECODE), (True, VARLEN)])
def test_static_cache_generate_matches_eager(llama, padded, step_module):
    ids, mask = _prompts(padded)
    expected = _generate(llama, "eager", ids, mask)
    with attngen.dispatch_log() as log:
        got = _generate(llama, "attngen", ids, mask)
    _assert_same_generation(got, expected)
    assert len(log) == LAYERS * NEW_TOKENS and all(d.fallback is None for d in log)
    prefill, steps = log[:LAYERS], log[LAYERS:]
    assert all(d.module == VARLEN and d.need.seqlen_q == 7 for d in prefill)
    assert all(d.module == step_module and d.need.seqlen_q == 1 for d in steps)


def _static_step(model, batch=2, prompt=5, capacity=12):
    """A StaticCache filled by a prefill without attention_mask (as a hand-written decode loop
    does), and the next step's inputs."""
    model.set_attn_implementation("attngen")
    cache = transformers.StaticCache(config=model.config, max_cache_len=capacity)
    ids = torch.randint(3, 128, (batch, prompt), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache).logits
    return cache, ids, logits[:, -1:].argmax(-1)


class _HostRead(AssertionError):
    pass


def test_static_step_reads_nothing_on_the_host(llama, monkeypatch):
    """A decode step of a static cache given no attention_mask: the decode module serves every
    layer, and no Tensor.item/tolist/bool/nonzero runs (each would block on the device, and
    none can be captured in a CUDA graph); the step's logits are eager attention's."""
    cache, ids, token = _static_step(llama)
    reference_cache, _, _ = _static_step(llama)
    llama.set_attn_implementation("eager")
    with torch.no_grad():
        expected = llama(input_ids=token, past_key_values=reference_cache).logits
    llama.set_attn_implementation("attngen")

    def host_read(*args, **kwargs):
        raise _HostRead("a device value was read on the host during the step")

    for name in ("item", "tolist", "__bool__", "nonzero", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    with attngen.dispatch_log() as log, torch.no_grad():
        got = llama(input_ids=token, past_key_values=cache).logits
    monkeypatch.undo()
    assert [d.module for d in log] == [DECODE] * LAYERS
    # Note: as in test_static_cache_generate_matches_eager (fp32, summation order only).
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_static_step_traces_fullgraph(llama):
    """torch.compile(fullgraph=True) traces a whole decode step of the static cache (a host
    read would be a graph break, an error with fullgraph) and gives the eager step's logits."""
    cache, _, token = _static_step(llama)
    reference_cache, _, _ = _static_step(llama)
    with torch.no_grad():
        expected = llama(input_ids=token, past_key_values=reference_cache).logits
    torch._dynamo.reset()
    step = torch.compile(llama, fullgraph=True, backend="eager")
    with attngen.dispatch_log() as log, torch.no_grad():
        got = step(input_ids=token, past_key_values=cache).logits
    assert {d.module for d in log} == {DECODE}
    # Note: the same kernels on the same inputs as the eager step: equal up to fp32 ulps.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_static_cache_padded_mask_of_written_positions(llama):
    """A padding mask [B, n] shorter than the static cache (its first n positions, as
    transformers hands it) runs unpadded over those n keys; a longer one is refused by name."""
    layer = llama.model.layers[0].self_attn
    q = torch.randn(2, 4, 1, 16)
    k = v = torch.randn(2, 2, 9, 16)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :2] = False
    out, _ = attngen.runtime.hf.attngen_attention(layer, q, k, v, keep)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :6], v[:, :, :6], attn_mask=keep[:, None, None, :], enable_gqa=True
    )
    # Note: fp32, one query row per head: summation order only.
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-5)
    with pytest.raises(attngen.NoKernelError, match="attention_mask: got shape"):
        attngen.runtime.hf.attngen_attention(layer, q, k, v, torch.ones(2, 10, dtype=torch.bool))


def test_static_cache_without_decode_module_takes_varlen(llama, monkeypatch):
    """With no decode module for the spec, a static cache's steps run through the varlen kind
    over the written keys (the dispatch says so) and still give eager's tokens and logits."""
    monkeypatch.setattr(attngen.runtime.hf, "decode_module", lambda *args: None)
    ids, mask = _prompts(False)
    expected = _generate(llama, "eager", ids, mask)
    with attngen.dispatch_log() as log:
        got = _generate(llama, "attngen", ids, mask)
    _assert_same_generation(got, expected)
    assert [d.module for d in log] == [VARLEN] * (LAYERS * NEW_TOKENS)


@pytest.mark.parametrize(
    ("padded", "prefill_module", "step_module"),
    [(False, PREFILL, DECODE), (True, VARLEN, VARLEN)],
)
def test_dynamic_cache_generate_matches_eager(llama, padded, prefill_module, step_module):
    """A DynamicCache's decode steps with nothing padded run on the decode module (each KV
    head read once) with every length the cache's; a padded batch's on the varlen kind."""
    ids, mask = _prompts(padded)
    expected = _generate(llama, "eager", ids, mask, cache="dynamic")
    with attngen.dispatch_log() as log:
        got = _generate(llama, "attngen", ids, mask, cache="dynamic")
    _assert_same_generation(got, expected)
    assert len(log) == LAYERS * NEW_TOKENS and all(d.fallback is None for d in log)
    prefill, steps = log[:LAYERS], log[LAYERS:]
    assert all(d.module == prefill_module and d.need.seqlen_q == 7 for d in prefill)
    assert all(d.module == step_module and d.need.seqlen_q == 1 for d in steps)
    if not padded:  # the step's keys are the cache's, prompt + tokens so far
        assert [d.need.seqlen_k for d in steps[::LAYERS]] == list(range(8, 8 + NEW_TOKENS - 1))


def test_dynamic_cache_without_decode_module_takes_prefill(llama, monkeypatch):
    """With no decode module for the spec, a DynamicCache's steps run on the prefill kind over
    its keys as they are, and give eager's tokens and logits."""
    monkeypatch.setattr(attngen.runtime.hf, "decode_module", lambda *args: None)
    ids, mask = _prompts(False)
    expected = _generate(llama, "eager", ids, mask, cache="dynamic")
    with attngen.dispatch_log() as log:
        got = _generate(llama, "attngen", ids, mask, cache="dynamic")
    _assert_same_generation(got, expected)
    assert [d.module for d in log] == [PREFILL] * (LAYERS * NEW_TOKENS)


@pytest.mark.parametrize(
    ("q_offset", "q_length", "kv_length", "expected"),
    [
        (0, 7, 7, None),  # a dynamic cache's prefill: plain attention
        (7, 1, 8, (8, True)),  # its decode step: every key written
        (7, 2, 9, (9, True)),  # a step of two tokens
        (0, 7, 12, (7, False)),  # a static cache's prefill: the written keys come first
        (9, 1, 12, (10, False)),  # a static cache's step (an int offset)
        (7, 1, 6, None),  # fewer keys than the step needs: not a cache this function knows
    ],
)
def test_mask_function_hands_cache_lengths(q_offset, q_length, kv_length, expected):
    """What the mask function hands the layers of a full-attention cache with nothing padded:
    the written keys' counts, and whether the layer's keys are exactly those (a dynamic
    cache), or nothing for a call that is plain attention."""
    from attngen.runtime.hf import cache_lengths

    got = cache_lengths(
        {
            "batch_size": 2,
            "q_offset": q_offset,
            "q_length": q_length,
            "kv_length": kv_length,
            "attention_mask": torch.ones(2, q_offset + q_length, dtype=torch.bool),
            "device": "cpu",
        }
    )
    if expected is None:
        assert got is None
    else:
        assert got.seqlens.tolist() == [expected[0]] * 2 and got.all_written is expected[1]
    padded = torch.ones(2, q_offset + q_length, dtype=torch.bool)
    padded[0, 0] = False  # a padded position: the varlen route decides, never lengths
    sizes = {"batch_size": 2, "q_offset": q_offset, "q_length": q_length, "kv_length": kv_length}
    assert cache_lengths({**sizes, "attention_mask": padded}) is None
