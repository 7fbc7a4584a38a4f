"""Tiny random models whose attention is not plain causal/window attention, run with
attn_implementation="attngen" on kernels built from the specs spec-from-hf derives from their
configs: each computes what eager computes (logits, and the greedy tokens of a generation
whose caches outgrow a window or a chunk), or raises, by name.

- gpt-oss's learned sinks (s_aux) on alternating sliding-window and full layers.
- Llama 4's chunked layers (attention_chunk_size 8, sequence 24: three chunks), whose chunks
  live in the mask transformers builds; generation past the chunk drops the keys of the
  layer's sliding cache that precede a chunk boundary (runtime/hf.py, ChunkedKeys).
- DeepSeek-V3's multi-head latent attention: transformers hands the attention function the
  decompressed q/k/v (head dim qk_nope + qk_rope, value head dim v_head_dim), the spec's
  `mla` variant.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import attngen
from attngen.build import plan_build, write_build
from attngen.runtime.hf import ChunkedKeys, attngen_attention
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import specs_from_data
from attngen.spec.hf import spec_data_from_config

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=128,
    dtype="float32",
)


def _logits(model, implementation, ids):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ids(length):
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(1))


def _build_from_config(tmp_path, config):
    """Kernels for the fp32 specs spec-from-hf derives from `config`, loaded alone."""
    folder = tmp_path / "from_config"
    specs = attngen.spec_from_config(config, archs=["sm90"], dtype="fp32", name="tiny")
    write_build(plan_build(specs), folder)
    load_kernels(folder, replace=True)
    return specs


def _same_as_eager(model, prompt: int, new_tokens: int):
    """Logits of a prompt and greedy tokens after it: attngen's equal eager's."""
    ids = _ids(prompt)
    expected = _logits(model, "eager", ids)
    with attngen.dispatch_log() as log:
        got = _logits(model, "attngen", ids)
    # Note: fp32 throughout; the attention outputs differ from eager's in summation order
    # only (a few fp32 ulps), which two layers of a 64-wide model keep far below 1e-4 in the
    # logits, while a wrong mask, chunk or sink moves them by O(0.1).
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    tokens = {}
    for implementation in ("eager", "attngen"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            tokens[implementation] = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(tokens["attngen"], tokens["eager"])
    return [d.module for d in log]


@pytest.fixture()
def registry_saved():
    saved = current_registry()
    attngen.register_transformers()
    yield
    use_registry(saved)


def test_llama4_chunked_layers_equal_eager(tmp_path, registry_saved):
    """Chunk size 8, sequence 24 (three chunks; plain causal attention differs), then greedy
    tokens past the prompt, where the chunked layers' caches keep only the last 7 keys."""
    config = transformers.Llama4TextConfig(
        **TINY,
        intermediate_size_mlp=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_chunk_size=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["chunked_attention", "full_attention"],
    )
    specs = _build_from_config(tmp_path, config)
    assert [s.name for s in specs] == ["tiny_chunked", "tiny_global"]
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    modules = _same_as_eager(model, 24, 6)
    assert modules == [
        "sm90/tiny_chunked_prefill_fp32_d16_chunk8_br",
        "sm90/tiny_global_prefill_fp32_d16_causal_br",
    ]


def test_gpt_oss_sinks_equal_eager(tmp_path, registry_saved):
    config = transformers.GptOssConfig(
        **TINY,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=8,
    )
    _build_from_config(tmp_path, config)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # sinks that matter: N(0, 2) against scores of O(1)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    modules = _same_as_eager(model, 20, 6)
    assert modules == [
        "sm90/tiny_local_prefill_fp32_d16_win7x0_br_sinks",
        "sm90/tiny_global_prefill_fp32_d16_causal_br_sinks",
    ]
    # Training through forward-only modules is refused by name, at the forward.
    model.set_attn_implementation("attngen")
    with pytest.raises(attngen.NoKernelError, match=r"backward: needs true .*\(forward-only\)"):
        model(input_ids=_ids(12)).logits.sum()


def test_gpt_oss_training_equals_eager(tmp_path, registry_saved):
    """loss.backward() through modules built with backward: true: every parameter's gradient,
    the layers' sinks (an nn.Parameter, s_aux) among them, equals eager's."""
    config = transformers.GptOssConfig(
        **TINY,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=8,
    )
    data = spec_data_from_config(config, archs=["sm90"], dtype="fp32", name="tiny")
    folder = tmp_path / "trained"
    write_build(plan_build(specs_from_data({**data, "backward": True})), folder)
    load_kernels(folder, replace=True)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).train()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    ids = _ids(20)
    grads = {}
    for implementation in ("eager", "attngen"):
        model.zero_grad()
        model.set_attn_implementation(implementation)
        with attngen.dispatch_log() as log:
            model(input_ids=ids, labels=ids).loss.backward()
        grads[implementation] = {
            name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
        }
    assert [d.module for d in log] == [
        "sm90/tiny_local_prefill_fp32_d16_win7x0_br_sinks_bwd",
        "sm90/tiny_global_prefill_fp32_d16_causal_br_sinks_bwd",
    ]
    assert grads["attngen"].keys() == grads["eager"].keys()
    sinks = [name for name in grads["eager"] if name.endswith("self_attn.sinks")]
    assert len(sinks) == 2 and all(grads["eager"][name].abs().max() > 1e-3 for name in sinks)
    # Note: fp32 throughout; the attention's gradients differ from eager's in summation order
    # only (a few fp32 ulps of O(1) values), far below 1e-5 in the parameters' gradients,
    # while a missing sink term or a wrong mask moves them by O(1e-2).
    for name, expected in grads["eager"].items():
        torch.testing.assert_close(grads["attngen"][name], expected, rtol=1e-4, atol=1e-5, msg=name)


def test_deepseek_v3_latent_attention_equals_eager(tmp_path, registry_saved):
    config = transformers.DeepseekV3Config(
        **TINY,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    mla, absorbed = _build_from_config(tmp_path, config)
    assert (mla.head_dim, mla.value_head_dim, absorbed.head_dim, absorbed.value_head_dim) == (
        32,
        16,
        48,
        32,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    modules = _same_as_eager(model, 12, 4)
    assert modules == ["sm90/tiny_mla_prefill_fp32_d32_dv16_causal_br"] * 2


class _Layer(torch.nn.Module):
    def __init__(self, layer_types=None, chunk=None, layer_idx=0):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.config.layer_types, self.config.attention_chunk_size = layer_types, chunk
        self.layer_idx, self.is_causal = layer_idx, True


@pytest.mark.parametrize(
    ("layer", "kwargs", "message"),
    [
        (_Layer(), dict(position_bias=torch.zeros(1)), "position_bias: a position bias"),
        (_Layer(), dict(indices=torch.zeros(1)), "indices: sparse attention"),
        (_Layer(), dict(sinks=torch.zeros(4)), "sinks: attention sinks under a name"),
        (_Layer(), dict(s_aux=torch.zeros(3)), r"s_aux: got shape \(3,\)"),
        (
            _Layer(["full_attention", "compressed_sparse_attention"], layer_idx=1),
            {},
            "layer 1 is a 'compressed_sparse_attention' layer",
        ),
        (_Layer(chunk=8), {}, "attention_chunk_size=8"),
        (_Layer(["chunked_attention"]), {}, "config.attention_chunk_size is None"),
    ],
)
def test_score_changing_arguments_and_layers_are_refused(layer, kwargs, message):
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with pytest.raises(attngen.NoKernelError, match=message):
        attngen_attention(layer, q, k, v, None, **kwargs)


@pytest.mark.parametrize(
    ("padding", "seqlen_q", "message"),
    [
        (
            torch.ones(1, 8, dtype=torch.bool),
            1,
            "with padding and a cache that starts at position 17",
        ),
        (None, 3, "queries in the chunk that the cache holds only the end of"),
    ],
)
def test_chunked_caches_the_kernels_cannot_count_from_are_refused(padding, seqlen_q, message):
    """A chunked layer's cache that starts at position 17 (chunk 8): the first 7 keys end the
    chunk of positions 16..23, and the kernels count chunks from key 0."""
    layer = _Layer(["chunked_attention"], chunk=8)
    q = torch.randn(1, 4, seqlen_q, 16)
    k = v = torch.randn(1, 2, 8, 16)
    with pytest.raises(attngen.NoKernelError, match=message):
        attngen_attention(layer, q, k, v, ChunkedKeys(padding, 17))
