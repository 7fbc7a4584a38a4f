"""A spec from a transformers model config (config.json), without importing transformers.

    attngen spec-from-hf path/to/config.json --out model.yaml
    attngen.spec_from_config(model.config)   # a dict, a config.json path or a PretrainedConfig

Fields, with transformers' names:
- head_dim: `head_dim`, else hidden_size / num_attention_heads;
- num_q_heads, num_kv_heads: num_attention_heads, num_key_value_heads (default: MHA);
- dtype: `dtype` (transformers >= 5) or `torch_dtype`;
- softcap: attn_logit_softcapping (Gemma-2);
- mask: causal, bottom_right (the KV-cache diagonal transformers uses); sliding_window W
  keeps key j for query i when i - W < j <= i, so window_left = W - 1 (examples/mistral_7b.yaml);
- models whose layers alternate (layer_types with sliding_attention and full_attention, or
  Gemma-2's sliding_window_pattern, or Qwen's max_window_layers) get the variants `local` and
  `global`;
- use_bidirectional_attention (Gemma-2/3 encoders): mask none, and a symmetric window;
- kernels: prefill and varlen (varlen serves padded batches).
The softmax scale is not a spec field: it is a call argument (transformers passes the
module's `scaling`, which carries query_pre_attn_scalar, attention_multiplier and the like).

A config whose attention no spec can express yet is refused by name, never turned into a spec
that computes something else: attention_chunk_size (Llama 4), the multi-head latent attention
dims (q_lora_rank, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim: DeepSeek-V2/V3
and others), learned attention sinks (gpt-oss and other model types in _SINK_MODELS), ALiBi
(alibi, use_alibi, attn_config.alibi, Bloom), and layer types other than full_attention and
sliding_attention (chunked, sparse, compressed ...; layers that are not attention, like
linear_attention, are skipped). The result is validated like a spec file (attngen.spec), so
a config attngen cannot serve fails with the field that is out of range.
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
_MLA = ("multi-head latent attention (keys and values decompressed from a shared latent; "
        "the spec has no such variant yet)")
_ALIBI = ("ALiBi position biases (spec-from-hf does not map them; write the spec by hand "
          "with alibi: true and pass the slopes at call time)")
_UNEXPRESSED_FIELDS = {
    "attention_chunk_size": "chunked attention (a query sees only the keys of its own chunk)",
    "q_lora_rank": _MLA, "kv_lora_rank": _MLA, "qk_rope_head_dim": _MLA,
    "qk_nope_head_dim": _MLA, "v_head_dim": _MLA,
    "alibi": _ALIBI, "use_alibi": _ALIBI,
}
_SINK_MODELS = frozenset({"gpt_oss", "granite_swa", "granitemoe_swa", "hy_v4",
                          "mimo_v2_flash", "openai_privacy_filter", "deepseek_v4"})
_MODEL_FEATURES = {**{m: "learned attention sinks (an extra per-head logit in the softmax)"
                      for m in _SINK_MODELS}, "bloom": _ALIBI}
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
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
    raise SpecError(f"config: got {type(source).__name__}; allowed: a dict, a config.json "
                    "path or folder, or a transformers config")


def spec_data_from_config(config: Any, *, archs: Sequence[str] = DEFAULT_ARCHS,
                          name: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The spec as YAML-ready data (with `variants` for alternating local/global layers)."""
    cfg = _text_config(read_config(config))
    refuse_unexpressed(cfg)
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
    data["kernels"] = ["prefill", "varlen"]
    bidirectional = bool(cfg.get("use_bidirectional_attention"))
    causal = ({"mask": "none"} if bidirectional
              else {"mask": "causal", "causal_align": "bottom_right"})
    window = cfg.get("sliding_window")
    kinds = _layer_kinds(cfg) - NON_ATTENTION_LAYERS
    if not window or cfg.get("use_sliding_window") is False or kinds == {"full_attention"}:
        return {**data, **causal}
    # Gemma's bidirectional window keeps |i - j| < W: W - 1 on both sides.
    local = {"mask": "sliding_window", "causal_align": "bottom_right",
             "window_left": int(window) - 1, "window_right": int(window) - 1 if bidirectional
             else 0}
    # Without layer_types (older config.json files), Gemma-2 alternates by architecture and
    # Gemma-3 and Cohere-2 say so with sliding_window_pattern.
    alternating = len(kinds) > 1 or (not kinds and (
        cfg.get("sliding_window_pattern") or cfg.get("model_type") in _ALTERNATING))
    if alternating:
        return {**data, "variants": {"local": local, "global": causal}}
    return {**data, **local}


def refuse_unexpressed(cfg: dict[str, Any]) -> None:
    """SpecError naming the first attention feature of `cfg` that no spec expresses yet."""
    kinds = _layer_kinds(cfg)
    for field, what in _UNEXPRESSED_FIELDS.items():
        value = cfg.get(field)
        if field == "attention_chunk_size" and kinds and "chunked_attention" not in kinds:
            continue  # set, but no layer is chunked
        if field == "v_head_dim" and not cfg.get("kv_lora_rank"):
            what = ("a value head dim of its own, which spec-from-hf does not map (write the "
                    "spec by hand with head_dim_v)")
        if value not in (None, False, 0):
            raise SpecError(f"config {field}: got {value!r}; {what} is not expressible in an "
                            "attngen spec yet, so no spec is written (one without it would "
                            "compute different attention)")
    attn_config = cfg.get("attn_config")
    if isinstance(attn_config, dict) and attn_config.get("alibi"):
        raise SpecError(f"config attn_config.alibi: got {attn_config['alibi']!r}; {_ALIBI}")
    model_type = cfg.get("model_type")
    if model_type in _MODEL_FEATURES:
        raise SpecError(f"config model_type: got {model_type!r}; its attention has "
                        f"{_MODEL_FEATURES[model_type]}, which is not expressible in an attngen "
                        "spec yet, so no spec is written")
    unknown = sorted(kinds - ATTENTION_LAYERS - NON_ATTENTION_LAYERS)
    if unknown:
        raise SpecError(f"config layer_types: got {', '.join(map(repr, unknown))} layers; "
                        "attngen specs express full_attention and sliding_attention only, so "
                        "no spec is written")


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


def spec_from_config(config: Any, *, archs: Sequence[str] = DEFAULT_ARCHS, name: str | None = None,
                     dtype: str | None = None) -> tuple[AttnSpec, ...]:
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
        raise SpecError(f"config dtype/torch_dtype: got {value!r}; allowed: "
                        f"{', '.join(d.torch_name for d in Dtype)} (or pass --dtype "
                        f"{'|'.join(d.value for d in Dtype)})")
    return dtype.value


def _name(cfg: dict[str, Any]) -> str:
    raw = str(cfg.get("model_type") or "model").lower()
    name = re.sub(r"[^a-z0-9_]+", "_", raw).strip("_")
    return name if re.fullmatch(r"[a-z][a-z0-9_]{0,40}", name) else "model"
