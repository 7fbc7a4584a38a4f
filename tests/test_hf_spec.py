"""Specs from transformers configs (attngen.spec_from_config, `attngen spec-from-hf`):
plain dicts shaped like the config.json files of Llama, Mistral, Gemma-2 and Qwen2, and
transformers' own config classes of each family whose attention a spec expresses or must refuse
(Llama 4 chunking, DeepSeek-V2/V3 latent attention, gpt-oss sinks, ALiBi, unknown layer types)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import attngen
from attngen.cli import app
from attngen.spec import SpecError, load_spec_file, specs_from_data
from attngen.spec.hf import spec_data_from_config
from attngen.tuning.database import NOT_TUNED_ON

ROOT = Path(__file__).resolve().parent.parent

LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}
GEMMA2_9B = {
    "model_type": "gemma2",
    "hidden_size": 3584,
    "head_dim": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "query_pre_attn_scalar": 256,
    "torch_dtype": "bfloat16",
}
QWEN2_5_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def _same_attention(specs, example: str) -> None:
    """The specs equal the example's in every field a kernel depends on (the examples also
    ask for decode, with a KV-cache layout, which a model config does not say)."""
    expected = load_spec_file(ROOT / "examples" / f"{example}.yaml")
    assert len(specs) == len(expected)
    for got, want in zip(specs, expected, strict=True):
        ignore = NOT_TUNED_ON
        assert set(got.kernels) <= set(want.kernels)
        assert {k: v for k, v in got.canonical().items() if k not in ignore} == {
            k: v for k, v in want.canonical().items() if k not in ignore
        }


@pytest.mark.parametrize(
    ("config", "example"),
    [
        (LLAMA3_8B, "llama3_8b"),
        (MISTRAL_7B, "mistral_7b"),
        (GEMMA2_9B, "gemma2_9b"),
        (QWEN2_5_7B, "qwen2_5_7b"),
    ],
)
def test_configs_give_the_example_specs(config, example) -> None:
    _same_attention(attngen.spec_from_config(config), example)


def test_layer_types_decide_the_variants() -> None:
    mixed = {**MISTRAL_7B, "layer_types": ["sliding_attention", "full_attention"] * 2}
    data = spec_data_from_config(mixed, name="hybrid")
    assert set(data["variants"]) == {"local", "global"}
    assert data["variants"]["local"]["window_left"] == 4095
    full = {**MISTRAL_7B, "layer_types": ["full_attention"] * 4}
    assert spec_data_from_config(full)["mask"] == "causal"


def test_fields_and_errors() -> None:
    data = spec_data_from_config(
        {**LLAMA3_8B, "torch_dtype": None, "dtype": "float16"}, archs=["sm90"]
    )
    assert data["dtype"] == "fp16" and data["archs"] == ["sm90"] and data["name"] == "llama"
    assert data["head_dim"] == 128 and data["kernels"] == ["prefill", "varlen"]
    with pytest.raises(SpecError, match="dtype/torch_dtype: got None"):
        spec_data_from_config({**LLAMA3_8B, "torch_dtype": None})
    with pytest.raises(SpecError, match="num_attention_heads: got 0"):
        spec_data_from_config({**LLAMA3_8B, "num_attention_heads": 0})
    with pytest.raises(SpecError, match="head_dim"):  # 4096 / 5 is no spec head dim
        attngen.spec_from_config({**LLAMA3_8B, "num_attention_heads": 5, "num_key_value_heads": 5})


def test_cli_writes_a_spec_that_builds(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2_9B))
    out = tmp_path / "gemma.yaml"
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "spec-from-hf",
            str(tmp_path),
            "--name",
            "gemma2_9b",
            "--archs",
            "sm90",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    _same_attention(load_spec_file(out), "gemma2_9b")
    built = runner.invoke(app, ["build", str(out), "--out", str(tmp_path / "gen")])
    assert built.exit_code == 0, built.output
    assert (
        tmp_path / "gen" / "sm90" / "gemma2_9b_local_varlen_bf16_d256_win4095x0_br_cap50.py"
    ).is_file()
    bad = runner.invoke(app, ["spec-from-hf", str(tmp_path / "missing.json")])
    assert bad.exit_code == 1 and "cannot read a config.json" in bad.stderr


# ------------------------------------------------ config families (transformers' own classes)

transformers = pytest.importorskip("transformers")


def _spec_data(config):
    return spec_data_from_config(config, archs=["sm90"], dtype="fp16", name="m")


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (
            lambda: {**LLAMA3_8B, "attention_chunk_size": 8192},
            "config attention_chunk_size: got 8192 and no layer_types",
        ),
        (
            lambda: {**LLAMA3_8B, "layer_types": ["chunked_attention"]},
            "config attention_chunk_size: got None; chunked_attention layers need",
        ),
        (
            lambda: transformers.DeepseekV3Config(v_head_dim=None),
            "config v_head_dim: got None; multi-head latent attention needs all of",
        ),
        (lambda: {**LLAMA3_8B, "v_head_dim": 64}, "config v_head_dim: got 64; a value head dim"),
        (
            lambda: {**LLAMA3_8B, "model_type": "deepseek_v32", "index_topk": 2048},
            "config index_topk: got 2048; a sparse indexer",
        ),
        (
            lambda: {**LLAMA3_8B, "model_type": "granite_swa"},
            "model_type: got 'granite_swa'; .* learned attention sinks",
        ),
        (lambda: {**LLAMA3_8B, "model_type": "falcon", "alibi": True}, "config alibi: got True"),
        (
            lambda: {**LLAMA3_8B, "model_type": "mpt", "attn_config": {"alibi": True}},
            "config attn_config.alibi",
        ),
        (
            lambda: {**LLAMA3_8B, "layer_types": ["full_attention", "deepseek_sparse_attention"]},
            "config layer_types: got 'deepseek_sparse_attention' layers",
        ),
    ],
)
def test_configs_with_attention_no_spec_expresses_are_refused_by_name(make, field) -> None:
    with pytest.raises(SpecError, match=field):
        _spec_data(make())


def test_families_the_spec_expresses() -> None:
    """Gemma-2/3 (softcap, alternating windows; query_pre_attn_scalar is the call's scale),
    Qwen3 (sliding from max_window_layers on), Phi-3, Mistral, Cohere and Cohere-2."""
    gemma2 = _spec_data(transformers.Gemma2Config())
    assert gemma2["softcap"] == 50.0 and gemma2["head_dim"] == 256
    assert gemma2["variants"]["local"]["window_left"] == 4095
    gemma3 = _spec_data(transformers.Gemma3TextConfig(sliding_window=512))
    assert gemma3["variants"] == {
        "local": {
            "mask": "sliding_window",
            "causal_align": "bottom_right",
            "window_left": 511,
            "window_right": 0,
        },
        "global": {"mask": "causal", "causal_align": "bottom_right"},
    }
    encoder = _spec_data(
        transformers.Gemma3TextConfig(sliding_window=512, use_bidirectional_attention=True)
    )
    assert encoder["variants"]["local"]["window_right"] == 511
    assert encoder["variants"]["global"] == {"mask": "none"}
    specs_from_data(encoder)  # a valid spec
    assert _spec_data(transformers.Qwen3Config())["mask"] == "causal"
    qwen3 = _spec_data(
        transformers.Qwen3Config(
            num_hidden_layers=4, use_sliding_window=True, max_window_layers=2, sliding_window=1024
        )
    )
    assert set(qwen3["variants"]) == {"local", "global"}
    raw_qwen = {
        **QWEN2_5_7B,
        "num_hidden_layers": 4,
        "use_sliding_window": True,
        "max_window_layers": 4,
    }  # a config.json without layer_types: no layer slides
    assert spec_data_from_config(raw_qwen)["mask"] == "causal"
    phi3 = _spec_data(transformers.Phi3Config(sliding_window=2047))
    assert (phi3["mask"], phi3["window_left"], phi3["head_dim"]) == ("sliding_window", 2046, 96)
    assert _spec_data(transformers.MistralConfig())["window_left"] == 4095
    assert _spec_data(transformers.CohereConfig())["mask"] == "causal"
    cohere2 = _spec_data(transformers.Cohere2Config(sliding_window=4096))
    assert set(cohere2["variants"]) == {"local", "global"}
    hybrid = {**LLAMA3_8B, "layer_types": ["linear_attention", "full_attention"]}
    assert spec_data_from_config(hybrid)["mask"] == "causal"  # linear layers call no attention


def test_gpt_oss_gets_sinks_and_alternating_windows() -> None:
    data = spec_data_from_config(transformers.GptOssConfig(), archs=["sm90"], dtype="bf16")
    assert (data["head_dim"], data["num_q_heads"], data["num_kv_heads"]) == (64, 64, 8)
    assert data["sinks"] is True
    assert data["variants"] == {
        "local": {
            "mask": "sliding_window",
            "causal_align": "bottom_right",
            "window_left": 127,
            "window_right": 0,
        },
        "global": {"mask": "causal", "causal_align": "bottom_right"},
    }
    _same_attention(specs_from_data(data), "gpt_oss_20b")


def test_llama4_chunked_layers_get_the_chunked_mask() -> None:
    for config in (
        transformers.Llama4TextConfig(),
        transformers.Llama4Config(text_config={"attention_chunk_size": 8192}),
    ):
        data = _spec_data(config)
        assert data["variants"] == {
            "chunked": {"mask": "chunked", "causal_align": "bottom_right", "chunk_size": 8192},
            "global": {"mask": "causal", "causal_align": "bottom_right"},
        }
    only_chunked = {
        **LLAMA3_8B,
        "attention_chunk_size": 8,
        "layer_types": ["chunked_attention"] * 2,
    }
    assert spec_data_from_config(only_chunked)["chunk_size"] == 8
    _same_attention(
        attngen.spec_from_config(transformers.Llama4TextConfig(), dtype="bf16"), "llama4_scout"
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformers.DeepseekV3Config(),
        lambda: transformers.DeepseekV2Config(
            q_lora_rank=None, num_attention_heads=128, num_key_value_heads=128
        ),
        lambda: {
            **transformers.DeepseekV3Config().to_dict(),
            "model_type": "kimi_k2",
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
        },  # Kimi K2's config.json
    ],
)
def test_latent_attention_gets_the_decompressed_and_absorbed_shapes(make) -> None:
    config = make()
    data = spec_data_from_config(config, archs=["sm90"], dtype="bf16")
    heads = data["num_q_heads"]
    assert data["variants"] == {
        "mla": {"head_dim": 192, "head_dim_v": 128, "num_kv_heads": heads},
        "absorbed": {
            "head_dim": 576,
            "head_dim_v": 512,
            "num_kv_heads": 1,
            "kernels": ["decode"],
            "kv_layout": "paged",
            "page_size": 64,
        },
    }
    mla, absorbed = specs_from_data(data)
    assert (mla.head_dim, mla.value_head_dim, absorbed.head_dim) == (192, 128, 576)
    if heads == 128 and data["name"] == "deepseek_v3":
        _same_attention((mla, absorbed), "deepseek_v3")
