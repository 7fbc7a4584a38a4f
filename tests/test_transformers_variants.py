"""Tiny random models whose attention is not plain causal/window attention, run with
attn_implementation="attngen": each either computes what eager computes or raises, by name.

- Llama 4's chunked layers (attention_chunk_size): their chunks live in the mask, which the
  "attngen" mask function replaces by the padding mask: refused.
- gpt-oss's learned sinks (s_aux): refused.
- DeepSeek-V3's multi-head latent attention: transformers hands the attention function the
  decompressed q/k/v (head dim qk_nope + qk_rope, value head dim v_head_dim), plain attention
  that a spec with those dims serves exactly: logits match eager.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import attngen
from attngen.build import plan_build, write_build
from attngen.runtime.hf import attngen_attention
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import specs_from_data

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=128, dtype="float32")


@pytest.fixture()
def kernels(tmp_path):
    """build(spec fields...) -> loads a folder of prefill+varlen fp32 kernels for them."""
    saved = current_registry()
    attngen.register_transformers()

    def build(**fields):
        data = dict(name="tiny", archs=["sm90"], dtype="fp32", mask="causal",
                    causal_align="bottom_right", kernels=["prefill", "varlen"], **fields)
        folder = tmp_path / "kernels"
        write_build(plan_build(specs_from_data(data)), folder)
        load_kernels(folder, replace=True)

    yield build
    use_registry(saved)


def _logits(model, implementation, ids):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ids(length):
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(1))


def test_llama4_chunked_layers_are_refused(kernels):
    """Chunk size 8, sequence 24: plain causal attention (what the kernels built for these
    dims compute) differs from the chunked attention eager computes, so the call must raise."""
    config = transformers.Llama4TextConfig(
        **TINY, intermediate_size_mlp=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1)
    assert config.layer_types[0] == "chunked_attention"
    kernels(head_dim=16, num_q_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    with pytest.raises(attngen.NoKernelError, match="layer 0 is a 'chunked_attention' layer"):
        _logits(model, "attngen", _ids(24))


def test_gpt_oss_sinks_are_refused(kernels):
    config = transformers.GptOssConfig(
        **TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
        num_experts_per_tok=1, sliding_window=8)
    kernels(head_dim=16, num_q_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with pytest.raises(attngen.NoKernelError, match="s_aux: attention sinks"):
        _logits(model, "attngen", _ids(12))


def test_deepseek_v3_latent_attention_runs_decompressed(kernels):
    config = transformers.DeepseekV3Config(
        **TINY, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with pytest.raises(attngen.spec.SpecError, match="config q_lora_rank: got 32"):
        attngen.spec_from_config(config)  # no MLA variant in the spec language yet
    kernels(head_dim=32, head_dim_v=16, num_q_heads=4, num_kv_heads=4)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    ids = _ids(12)
    expected = _logits(model, "eager", ids)
    with attngen.dispatch_log() as log:
        got = _logits(model, "attngen", ids)
    assert [d.module for d in log] == ["sm90/tiny_prefill_fp32_d32_dv16_causal_br"] * 2
    # Note: fp32 throughout; the attention outputs differ from eager's in summation order
    # only (a few fp32 ulps), which two layers of a 64-wide model keep far below 1e-4 in the
    # logits, while a wrong mask or head dim moves them by O(0.1).
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


class _Layer(torch.nn.Module):
    def __init__(self, layer_types=None, chunk=None, layer_idx=0):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.config.layer_types, self.config.attention_chunk_size = layer_types, chunk
        self.layer_idx, self.is_causal = layer_idx, True


@pytest.mark.parametrize(("layer", "kwargs", "message"), [
    (_Layer(), dict(position_bias=torch.zeros(1)), "position_bias: a position bias"),
    (_Layer(), dict(indices=torch.zeros(1)), "indices: sparse attention"),
    (_Layer(), dict(sinks=torch.zeros(4)), "sinks: attention sinks"),
    (_Layer(["full_attention", "compressed_sparse_attention"], layer_idx=1), {},
     "layer 1 is a 'compressed_sparse_attention' layer"),
    (_Layer(chunk=8), {}, "attention_chunk_size=8"),
])
def test_score_changing_arguments_and_layers_are_refused(layer, kwargs, message):
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with pytest.raises(attngen.NoKernelError, match=message):
        attngen_attention(layer, q, k, v, None, **kwargs)
