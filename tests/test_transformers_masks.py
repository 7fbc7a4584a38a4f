"""A tiny Llama whose attention is a mask function with no built-in equivalent, run with
attn_implementation="attngen": the "attngen" mask function hands the layers the mask function
as a MaskMod (runtime/hf.py), whose traced mask_mod runs on an expression module built on
demand; the logits (and greedy tokens) equal sdpa's with the same mask function. Built-in
masks (causal, padding) keep the built-in modules.

- packed sequences (position_ids restarting, no cache): transformers' own
  packed_sequence_mask_function over a captured tensor;
- prefix-LM, a user's mask function registered around attngen's: or_masks of causality and
  `kv_idx < prefix[b]` over a captured tensor whose values change between forwards; a
  training step under it (loss and every parameter's gradient against float64 sdpa).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    or_masks,
    packed_sequence_mask_function,
    padding_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

import attngen
from attngen.runtime import hf
from tests.ondemand_harness import on_demand  # noqa: F401 - a fixture

LAYERS = 2
PREFIX = torch.tensor([3, 7])


def prefix_lm(b, h, q_idx, kv_idx):
    return kv_idx < PREFIX[b]


def _with_prefix(mask_interface):
    def mask(*args, mask_function=causal_mask_function, **kwargs):
        kwargs["allow_is_causal_skip"] = False  # sdpa's: else None (plain causal) when unpadded
        return mask_interface(*args, mask_function=or_masks(mask_function, prefix_lm), **kwargs)

    return mask


@pytest.fixture()
def llama(on_demand):  # noqa: F811
    attngen.register_transformers()
    AttentionInterface.register("prefix_attngen", hf.attngen_attention)
    AttentionMaskInterface.register("prefix_attngen", _with_prefix(hf.attngen_mask))
    AttentionInterface.register("prefix_sdpa", AttentionInterface._global_mapping["sdpa"])
    AttentionMaskInterface.register("prefix_sdpa", _with_prefix(sdpa_mask))
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
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _logits(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    with torch.no_grad(), attngen.dispatch_log() as log:
        return model(**inputs).logits, list(log)


def _same(got, want):
    # Note: fp32 throughout; the attention outputs differ from sdpa's in summation order only
    # (a few fp32 ulps, as tests/test_transformers_e2e.py measures), far below 1e-4 in the
    # logits of two 64-wide layers, while one key seen wrongly moves them by O(0.1).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _expressed(log, text):
    assert len(log) == LAYERS
    for d in log:
        assert d.api == "transformers" and d.need.expressions and text in d.reason, d


def test_built_in_masks_are_told_apart():
    p = torch.tensor([[0, 0, 1]])
    for fn in (None, causal_mask_function, sliding_window_causal_mask_function(4)):
        assert hf._built_in(fn)
    assert hf._built_in(chunked_causal_mask_function(8, torch.zeros(2, dtype=torch.long)))
    for fn in (
        and_masks(causal_mask_function, packed_sequence_mask_function(p)),
        or_masks(causal_mask_function, prefix_lm),
        padding_mask_function(p.bool()),
        prefix_lm,
    ):
        assert not hf._built_in(fn)


def test_packed_sequences_run_their_mask_function(llama):
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    inputs = dict(input_ids=ids, position_ids=positions, use_cache=False)
    want, _ = _logits(llama, "sdpa", **inputs)
    got, log = _logits(llama, "attngen", **inputs)
    _same(got, want)
    _expressed(log, "packed_sequence_mask[b, (q_idx + q_offset[0])]")
    assert log[0].built and not log[1].built  # one module for both layers
    plain, log = _logits(llama, "attngen", input_ids=ids, use_cache=False)
    _same(plain, _logits(llama, "sdpa", input_ids=ids, use_cache=False)[0])
    assert [d.need.expressions for d in log] == ["", ""]  # causal: the built-in module
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    padded, log = _logits(llama, "attngen", input_ids=ids.expand(2, 12), attention_mask=mask)
    want, _ = _logits(llama, "sdpa", input_ids=ids.expand(2, 12), attention_mask=mask)
    _same(padded[:, 3:], want[:, 3:])
    assert [(d.need.kind.value, d.need.expressions) for d in log] == [("varlen", "")] * LAYERS


def test_a_registered_prefix_lm_mask_equals_sdpa(llama):
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    for prefix in ([3, 7], [9, 1]):
        PREFIX.copy_(torch.tensor(prefix))  # new values in the captured tensor: no new module
        want, _ = _logits(llama, "prefix_sdpa", input_ids=ids, use_cache=False)
        got, log = _logits(llama, "prefix_attngen", input_ids=ids, use_cache=False)
        _same(got, want)
        _expressed(log, "< prefix[b]")
    assert not log[0].built
    causal, _ = _logits(llama, "sdpa", input_ids=ids, use_cache=False)
    assert (got - causal).abs().max() > 1e-2  # the prefix is seen: the test can fail


def test_generation_with_a_mask_function_equals_sdpa(llama):
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    PREFIX.copy_(torch.tensor([4, 2]))
    tokens = {}
    for implementation in ("prefix_sdpa", "prefix_attngen"):
        llama.set_attn_implementation(implementation)
        with torch.no_grad(), attngen.dispatch_log() as log:
            tokens[implementation] = llama.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens["prefix_attngen"], tokens["prefix_sdpa"])
    assert len(log) == 4 * LAYERS and len({d.key for d in log}) == 1  # offsets read at run time
    assert sum(d.built for d in log) <= 1


def test_sinks_and_dropout_run_on_the_mask_function_path(llama):
    """gpt-oss's s_aux and the layer's dropout go to an expression module built with them: a
    MaskMod of the causal mask function gives what the built-in causal module gives for the
    same sinks and the same generator state (one Philox keep mask: the same seed and offset
    drawn), and the sinks get their gradient."""
    layer = llama.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 9, 16, generator=gen) for h in (4, 2, 2))
    mask = hf.mask_mod_of(causal_mask_function, kv_length=9)
    results = []
    for attention_mask in (mask, None):  # the expression module, then the built-in one
        sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)).requires_grad_()
        torch.manual_seed(7)
        with attngen.dispatch_log() as log:
            out = hf.attngen_attention(layer, q, k, v, attention_mask, dropout=0.25, s_aux=sinks)[0]
        out.sum().backward()
        results.append((out.detach(), sinks.grad, log[0]))
    (got, got_grad, expressed), (want, want_grad, built_in) = results
    assert expressed.need.expressions and expressed.need.sinks and expressed.need.dropout
    assert not built_in.need.expressions and built_in.need.dropout
    # Both modules run the same fp32 kernel step with the same keep mask; the expression
    # module's masked keys add exact zeros, so they agree to the bit today (0.0 measured). The
    # bound is RELIABILITY.md's floor, two fp32 ulps at the magnitude, for each of the two.
    for a, b in ((got, want), (got_grad, want_grad)):
        floor = 4 * torch.finfo(torch.float32).eps * b.abs().max()
        assert (a - b).abs().max() <= floor, ((a - b).abs().max(), floor)
    assert (got == 0).any()  # dropout dropped every key some rows see


def _training_step(model, implementation, ids):
    """The loss and every parameter's gradient of one training step, and the dispatches."""
    model.set_attn_implementation(implementation)
    model.train()
    model.zero_grad()
    with attngen.dispatch_log() as log:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, list(log)


def test_a_training_step_with_a_mask_function_equals_sdpa(llama):
    """The loss and the gradients of a training step under the prefix-LM mask function (the
    expression module's backward) against float64 sdpa by RELIABILITY.md's rule for
    gradients: |attngen - float64| <= 3x |fp32 sdpa - float64| + two ulps."""
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    PREFIX.copy_(torch.tensor([6, 2]))
    golden = copy.deepcopy(llama).double()
    loss, grads, log = _training_step(llama, "prefix_attngen", ids)
    _expressed(log, "< prefix[b]")
    assert all(d.need.backward and d.module.endswith("_bwd") for d in log)
    lowp_loss, lowp, _ = _training_step(llama, "prefix_sdpa", ids)
    want_loss, want, _ = _training_step(golden, "prefix_sdpa", ids)
    causal_loss, _, _ = _training_step(llama, "sdpa", ids)
    assert abs(causal_loss - want_loss) > 1e-3  # the prefix is seen: the test can fail
    for name, got in [("loss", loss), *grads.items()]:
        ref, fp32 = (want_loss, lowp_loss) if name == "loss" else (want[name], lowp[name])
        err, bound = (got.double() - ref).abs(), (fp32.double() - ref).abs()
        floor = 2 * torch.finfo(torch.float32).eps * ref.abs().max().clamp_min(1)
        assert err.max() <= 3 * bound.max() + floor, (name, err.max(), bound.max())
        assert err.mean() <= 4.5 * bound.mean() + floor, (name, err.mean(), bound.mean())
