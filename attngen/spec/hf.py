"""A spec from a transformers model config (config.json), without importing transformers.

    attngen spec-from-hf path/to/config.json --out model.yaml
    attngen.spec_from_config(model.config)   # a dict, a config.json path or a PretrainedConfig

Reads transformers' names: head_dim (else hidden_size / num_attention_heads), the head
counts, `dtype` or `torch_dtype`, attn_logit_softcapping, and the sliding window (transformers
keeps key j for query i when i - W < j <= i, so window_left = W - 1); alternating layers
become the variants `local` and `global`; gpt-oss's sinks, Llama 4's chunks and the latent
attention dims (variants `mla` and `absorbed`) map to their spec fields. A config whose
attention no spec expresses yet (sparse indexers, other models' sinks, ALiBi, unknown layer
types) is refused by name, never turned into a spec that computes something else; the
result is validated like a spec file. docs/integration.md ("From a model to kernels") lists
every field and refusal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attngen.spec import AttnSpec, Dtype, SpecError, specs_from_data

DEFAULT_ARCHS = ("sm80", "sm90")
_ALTERNATING = frozenset({"gemma2"})  # model types whose layers alternate local and global
_ALIBI = (
    "ALiBi position biases (spec-from-hf does not map them; write the spec by hand "
    "with alibi: true and pass the slopes at call time)"
)
_SPARSE = "a sparse indexer choosing the keys each query sees (DeepSeek-V3.2's top-k)"
_UNEXPRESSED_FIELDS = {
    "index_topk": _SPARSE,
    "index_n_heads": _SPARSE,
    "alibi": _ALIBI,
    "use_alibi": _ALIBI,
}
# The multi-head latent attention fields; all four must be there (q_lora_rank is only the
# query projection's rank and changes nothing the attention function sees).
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_PAGE_SIZE = 64  # FlashMLA's and FlashInfer's MLA page size
SINKS_MODELS = frozenset({"gpt_oss"})  # attention layers pass s_aux = sinks (runtime/hf.py)
_SINK_MODELS = frozenset(
    {
        "granite_swa",
        "granitemoe_swa",
        "hy_v4",
        "mimo_v2_flash",
        "openai_privacy_filter",
        "deepseek_v4",
    }
)
_MODEL_FEATURES = {
    **{
        m: "learned attention sinks (an extra per-head logit in the softmax) "
        "handed over in a way attngen's transformers function is not known to "
        "read"
        for m in _SINK_MODELS
    },
    "bloom": _ALIBI,
}
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# Layer types that call no attention function: nothing of theirs goes into the spec.
NON_ATTENTION_LAYERS = frozenset({"linear_attention", "conv", "moe", "sparse", "dense"})


def read_config(source: Any) -> dict[str, Any]:
    """A config as a dict: from a dict, a config.json path, a folder holding one, or any
    object with to_dict() (transformers' PretrainedConfig)."""
    if isinstance(source, dict):
        return dict(source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SpecError(f"{path}: cannot read a config.json ({exc})") from None
        if not isinstance(data, dict):
            raise SpecError(f"{path}: a config.json holds a JSON object")
        return data
    if hasattr(source, "to_dict"):
        return dict(source.to_dict())
    raise SpecError(
        f"config: got {type(source).__name__}; allowed: a dict, a config.json "
        "path or folder, or a transformers config"
    )


def spec_data_from_config(
    config: Any,
    *,
    archs: Sequence[str] = DEFAULT_ARCHS,
    name: str | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """The spec as YAML-ready data (with `variants` for alternating local/global layers)."""
    cfg = _text_config(read_config(config))
    refuse_unexpressed(cfg)
    data = _shared_fields(cfg, archs, name, dtype)
    if _is_mla(cfg):
        return _mla_data(cfg, data, data["num_q_heads"])
    bidirectional = bool(cfg.get("use_bidirectional_attention"))
    bottom_right = {"mask": "causal", "causal_align": "bottom_right"}
    causal = {"mask": "none"} if bidirectional else bottom_right
    kinds = _layer_kinds(cfg) - NON_ATTENTION_LAYERS
    if "chunked_attention" in kinds:
        size = _int(cfg, "attention_chunk_size")
        chunked = {**bottom_right, "mask": "chunked", "chunk_size": size}
        if kinds == {"chunked_attention"}:
            return {**data, **chunked}
        return {**data, "variants": {"chunked": chunked, "global": causal}}
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False or kinds == {"full_attention"}:
        return {**data, **causal}
    # Gemma's bidirectional window keeps |i - j| < W: W - 1 on both sides.
    local = {**bottom_right, "mask": "sliding_window", "window_left": int(window) - 1}
    local["window_right"] = int(window) - 1 if bidirectional else 0
    # Without layer_types (older config.json files), Gemma-2 alternates by architecture and
    # Gemma-3 and Cohere-2 say so with sliding_window_pattern.
    alternating = len(kinds) > 1 or (
        not kinds and (cfg.get("sliding_window_pattern") or cfg.get("model_type") in _ALTERNATING)
    )
    if alternating:
        return {**data, "variants": {"local": local, "global": causal}}
    return {**data, **local}


def _shared_fields(
    cfg: dict[str, Any], archs: Sequence[str], name: str | None, dtype: str | None
) -> dict[str, Any]:
    """The fields every variant of the spec shares: name, archs, dtype, head dim and heads,
    softcap, sinks, and the kernels."""
    heads = _int(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim") or _int(cfg, "hidden_size") // heads
    dtype_name = dtype or _dtype(cfg)
    data: dict[str, Any] = {
        "name": name or _name(cfg),
        "archs": list(archs),
        "dtype": dtype_name,
        "head_dim": head_dim,
        "num_q_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
    }
    cap = cfg.get("attn_logit_softcapping")
    if cap:
        data["softcap"] = float(cap)
    if cfg.get("model_type") in SINKS_MODELS:
        data["sinks"] = True
    data["kernels"] = ["prefill", "varlen"]
    return data


def _is_mla(cfg: dict[str, Any]) -> bool:
    present = [field for field in MLA_FIELDS if cfg.get(field)]
    if present and len(present) < len(MLA_FIELDS):
        missing = [field for field in MLA_FIELDS if field not in present]
        if present != ["v_head_dim"]:
            raise SpecError(
                f"config {missing[0]}: got {cfg.get(missing[0])!r}; multi-head "
                f"latent attention needs all of {', '.join(MLA_FIELDS)} (an int "
                "> 0 each), so no spec is written"
            )
        raise SpecError(
            f"config v_head_dim: got {cfg['v_head_dim']!r}; a value head dim of "
            "its own without latent attention, which spec-from-hf does not map "
            "(write the spec by hand with head_dim_v)"
        )
    return bool(present)


def _mla_data(cfg: dict[str, Any], data: dict[str, Any], heads: int) -> dict[str, Any]:
    """Multi-head latent attention: the decompressed heads for prefill, the absorbed form
    (MQA over the latent cache) for decode."""
    nope, rope = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim")
    latent, value = _int(cfg, "kv_lora_rank"), _int(cfg, "v_head_dim")
    causal = {"mask": "causal", "causal_align": "bottom_right"}
    data = {**data, "head_dim": nope + rope}  # cfg's head_dim is the rope part's
    return {
        **data,
        **causal,
        "variants": {
            "mla": {"head_dim": nope + rope, "head_dim_v": value, "num_kv_heads": heads},
            "absorbed": {
                "head_dim": latent + rope,
                "head_dim_v": latent,
                "num_kv_heads": 1,
                "kernels": ["decode"],
                "kv_layout": "paged",
                "page_size": MLA_PAGE_SIZE,
            },
        },
    }


def refuse_unexpressed(cfg: dict[str, Any]) -> None:
    """SpecError naming the first attention feature of `cfg` that no spec expresses yet."""
    kinds = _layer_kinds(cfg)
    for field, what in _UNEXPRESSED_FIELDS.items():
        value = cfg.get(field)
        if value not in (None, False, 0):
            raise SpecError(
                f"config {field}: got {value!r}; {what} is not expressible in an "
                "attngen spec yet, so no spec is written (one without it would "
                "compute different attention)"
            )
    chunk = cfg.get("attention_chunk_size")
    if chunk and not kinds:
        raise SpecError(
            f"config attention_chunk_size: got {chunk!r} and no layer_types saying "
            "which layers are chunked_attention; no spec is written (give the "
            "layer types, as transformers' Llama4TextConfig derives them)"
        )
    if "chunked_attention" in kinds and not chunk:
        raise SpecError(
            f"config attention_chunk_size: got {chunk!r}; chunked_attention layers need an int > 0"
        )
    attn_config = cfg.get("attn_config")
    if isinstance(attn_config, dict) and attn_config.get("alibi"):
        raise SpecError(f"config attn_config.alibi: got {attn_config['alibi']!r}; {_ALIBI}")
    model_type = cfg.get("model_type")
    if model_type in _MODEL_FEATURES:
        raise SpecError(
            f"config model_type: got {model_type!r}; its attention has "
            f"{_MODEL_FEATURES[model_type]}, which is not expressible in an attngen "
            "spec yet, so no spec is written"
        )
    unknown = sorted(kinds - ATTENTION_LAYERS - NON_ATTENTION_LAYERS)
    if unknown:
        raise SpecError(
            f"config layer_types: got {', '.join(map(repr, unknown))} layers; "
            "attngen specs express full_attention, sliding_attention and "
            "chunked_attention only, so no spec is written"
        )


def _layer_kinds(cfg: dict[str, Any]) -> set[str]:
    """The layer types, from layer_types or, in older Qwen config.json files, derived as
    transformers does: sliding from layer max_window_layers on, when use_sliding_window."""
    kinds = cfg.get("layer_types")
    if kinds:
        return set(kinds)
    layers, first = cfg.get("num_hidden_layers"), cfg.get("max_window_layers")
    if cfg.get("use_sliding_window") and isinstance(layers, int) and isinstance(first, int):
        return {"sliding_attention" if i >= first else "full_attention" for i in range(layers)}
    return set()


def spec_from_config(
    config: Any,
    *,
    archs: Sequence[str] = DEFAULT_ARCHS,
    name: str | None = None,
    dtype: str | None = None,
) -> tuple[AttnSpec, ...]:
    """The validated specs of a transformers config (one, or local and global variants)."""
    return specs_from_data(spec_data_from_config(config, archs=archs, name=name, dtype=dtype))


def spec_yaml(data: dict[str, Any]) -> str:
    """Spec data as YAML 1.2 text that attngen's strict loader reads back as the same data."""

    def scalar(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(scalar(v) for v in value) + "]"
        if isinstance(value, str) and not re.fullmatch(r"[a-z][a-z0-9_]*", value):
            raise SpecError(f"{value!r}: not a plain spec word")
        return str(value)

    lines = ["# Generated by `attngen spec-from-hf` from a transformers config."]
    for key, value in data.items():
        if key == "variants":
            lines.append("variants:")
            for variant, fields in value.items():
                body = ", ".join(f"{k}: {scalar(v)}" for k, v in fields.items())
                lines.append(f"  {variant}: {{{body}}}")
        else:
            lines.append(f"{key}: {scalar(value)}")
    return "\n".join(lines) + "\n"


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # Multimodal configs keep the language model's fields under text_config.
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) and "num_attention_heads" in text else cfg


def _int(cfg: dict[str, Any], field: str) -> int:
    value = cfg.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"config {field}: got {value!r}; allowed: an int > 0")
    return value


def _dtype(cfg: dict[str, Any]) -> str:
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    value = str(value).removeprefix("torch.") if value is not None else None
    dtype = Dtype.from_torch_name(value) if value is not None else None
    if dtype is None:
        raise SpecError(
            f"config dtype/torch_dtype: got {value!r}; allowed: "
            f"{', '.join(d.torch_name for d in Dtype)} (or pass --dtype "
            f"{'|'.join(d.value for d in Dtype)})"
        )
    return dtype.value


def _name(cfg: dict[str, Any]) -> str:
    raw = str(cfg.get("model_type") or "model").lower()
    name = re.sub(r"[^a-z0-9_]+", "_", raw).strip("_")
    return name if re.fullmatch(r"[a-z][a-z0-9_]{0,40}", name) else "model"
