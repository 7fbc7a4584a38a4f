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
  Gemma-2's sliding_window_pattern) get the variants `local` and `global`;
- kernels: prefill and varlen (varlen serves padded batches).
The result is validated like a spec file (attngen.spec), so a config attngen cannot serve
fails with the field that is out of range.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attngen.spec import AttnSpec, SpecError, specs_from_data

DEFAULT_ARCHS = ("sm80", "sm90")
_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_ALTERNATING = frozenset({"gemma2"})  # model types whose layers alternate local and global


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
    causal = {"mask": "causal", "causal_align": "bottom_right"}
    window = cfg.get("sliding_window")
    kinds = set(cfg.get("layer_types") or ())
    if not window or cfg.get("use_sliding_window") is False or kinds == {"full_attention"}:
        return {**data, **causal}
    local = {"mask": "sliding_window", "causal_align": "bottom_right",
             "window_left": int(window) - 1, "window_right": 0}
    # Without layer_types (older config.json files), Gemma-2 alternates by architecture and
    # Gemma-3 and Cohere-2 say so with sliding_window_pattern.
    alternating = len(kinds) > 1 or (not kinds and (
        cfg.get("sliding_window_pattern") or cfg.get("model_type") in _ALTERNATING))
    if alternating:
        return {**data, "variants": {"local": local, "global": causal}}
    return {**data, **local}


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
    if value not in _DTYPES:
        raise SpecError(f"config dtype/torch_dtype: got {value!r}; allowed: "
                        f"{', '.join(_DTYPES)} (or pass --dtype fp16|bf16|fp32)")
    return _DTYPES[value]


def _name(cfg: dict[str, Any]) -> str:
    raw = str(cfg.get("model_type") or "model").lower()
    name = re.sub(r"[^a-z0-9_]+", "_", raw).strip("_")
    return name if re.fullmatch(r"[a-z][a-z0-9_]{0,40}", name) else "model"
