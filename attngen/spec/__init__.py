"""The attention spec: the validated, frozen description of one attention flavour.

A spec file is untrusted input that ends up as executed Python, so everything about it is
strict: YAML is read by attngen.spec.strict_yaml, which knows only YAML 1.2's plain scalars (no
`no` -> False, `010` -> 8, `12:30` -> 750, dates) and refuses duplicate keys, anchors and
aliases, and every field is checked by pydantic with exact types. An error names the file,
the field, the value and what is allowed, as one line (`SpecError`).

A file describes one model. Fields at the top level apply to every attention flavour of that
model; a model with several flavours (Gemma-2 alternates sliding-window and global layers)
lists them under `variants`, each a mapping of overrides whose name is appended to the model's:

    name: gemma2_9b
    ...common fields...
    variants:
      local: {mask: sliding_window, causal_align: bottom_right, window_left: 4095}
      global: {mask: causal, causal_align: bottom_right}

gives the specs `gemma2_9b_local` and `gemma2_9b_global`.
"""

from __future__ import annotations

import hashlib
import json
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator
from pydantic import ValidationError as PydanticValidationError

from attngen.arch import arch_names
from attngen.spec.checks import MAX_DECODE_HEAD_DIM as MAX_DECODE_HEAD_DIM
from attngen.spec.checks import MAX_HEAD_DIM as MAX_HEAD_DIM
from attngen.spec.checks import check_head_dims, check_kv_dtype, check_model_fields, check_training
from attngen.spec.errors import SpecError as SpecError
from attngen.spec.errors import describe
from attngen.spec.errors import field_error as _field_error
from attngen.spec.expressions import check_expressions, parsed
from attngen.spec.strict_yaml import YamlError, load_yaml

MAX_SPEC_BYTES = 64 * 1024  # a spec is a few hundred bytes; anything larger is a mistake
NAME_PATTERN = r"^[a-z][a-z0-9_]{0,47}$"


class Dtype(str, Enum):
    """A kernel's input and output dtype. The value is the short name of YAML files, module
    names and Triton's type strings; the properties are its other spellings, so that no module
    keeps a map of its own."""

    fp16 = "fp16"
    bf16 = "bf16"
    fp32 = "fp32"

    @property
    def itemsize(self) -> int:
        return 4 if self is Dtype.fp32 else 2

    @property
    def torch_name(self) -> str:
        """The name under torch and triton.language (`torch.bfloat16`, `tl.bfloat16`)."""
        return {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[self.value]

    @property
    def triton_pointer(self) -> str:
        """The type of a pointer to this dtype in a Triton kernel signature (`*bf16`)."""
        return f"*{self.value}"

    @property
    def mantissa_bits(self) -> int:
        """Explicit mantissa bits: the spacing of numbers at magnitude m is
        2 ** (floor(log2 m) - mantissa_bits), and eps is 2 ** -mantissa_bits."""
        return {"fp16": 10, "bf16": 7, "fp32": 23}[self.value]

    @property
    def eps(self) -> float:
        """The spacing of numbers just above 1.0."""
        return 2.0**-self.mantissa_bits

    @classmethod
    def from_torch_name(cls, name: str) -> Dtype | None:
        """The Dtype whose torch_name is `name` ("bfloat16"; a "torch." prefix is allowed),
        or None for a dtype attngen has no kernels for."""
        bare = name.removeprefix("torch.")
        return next((dtype for dtype in cls if dtype.torch_name == bare), None)


class Mask(str, Enum):
    none = "none"
    causal = "causal"
    sliding_window = "sliding_window"
    chunked = "chunked"  # causal within fixed-size chunks of aligned positions (Llama 4)


class CausalAlign(str, Enum):
    """Where the causal diagonal sits when Nq != Nk (i' = i + (Nk - Nq) for bottom_right)."""

    top_left = "top_left"  # SDPA's is_causal
    bottom_right = "bottom_right"  # flash-attn >= 2.1, the KV-cache convention


class KernelKind(str, Enum):
    """What a generated module computes; each kind has its own entry point (render.ENTRY_POINTS).

    prefill: `attention`, padded batches [B, H, N, D]. varlen: `attention_varlen`, packed
    sequences of different lengths [total, H, D] with cu_seqlens (flash-attn's varlen layout).
    """

    prefill = "prefill"
    varlen = "varlen"  # packed sequences delimited by cu_seqlens (the prefill kernel's twin)
    decode = "decode"  # one step of a few query tokens against a KV cache (split-KV)


class KvLayout(str, Enum):
    """How decode's KV cache is stored."""

    contiguous = "contiguous"  # k_cache/v_cache [B, HKV, Lmax, D], any strides
    paged = "paged"  # [num_pages, page_size, HKV, D] and a block table (vLLM/FlashInfer)


class KvDtype(str, Enum):
    """Decode's KV cache element when it is not the spec's dtype: fp8 e4m3 (torch.float8_e4m3fn)
    with per-(sequence, KV head) descales, FA3's `k_descale` / `v_descale`."""

    fp8_e4m3 = "fp8_e4m3"


# Decode-only fields: validated only with `decode` in kernels, absent from canonical() (and so
# from the hash) otherwise, which keeps the hashes of prefill-only specs what they were.
DECODE_FIELDS = ("kv_layout", "page_size", "max_query_tokens", "kv_dtype")
# Training fields: the prefill and varlen modules of a spec with `backward: true` also carry
# the gradient kernels and an autograd Function; `dropout: true` compiles flash-attn's
# dropout_p in (forward and backward). Absent from canonical() (and so from the hash) while
# false, which keeps the hashes of inference specs what they were.
TRAINING_FIELDS = ("backward", "dropout")
# Newer models' fields: absent from canonical() at their defaults, so the hashes (and tuning
# keys) of specs without them stay what they were.
MODEL_FIELDS = ("sinks", "chunk_size", "sink_tokens")
# Programmable attention (attngen.spec.expressions): absent from canonical() while unset; when set,
# the expressions enter it in their normalized form (one spelling per parsed tree).
EXPRESSION_FIELDS = ("score_mod", "mask_mod", "tensors")
MAX_PAGE_SIZE = 1024
MAX_QUERY_TOKENS = 16


TENSOR_NAME = r"^[a-z][a-z0-9_]{0,31}$"
DimName = Annotated[StrictStr, Field(pattern=r"^[A-Z][A-Z0-9_]{0,15}$")]
DimSize = Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]
ArchName = Annotated[StrictStr, Field(pattern=r"^sm[0-9]+$")]
# Head dims: MAX_HEAD_DIM for every kind, up to MAX_DECODE_HEAD_DIM for decode only
# (attngen.spec.checks says why).
HeadDim = Annotated[StrictInt, Field(ge=1, le=MAX_DECODE_HEAD_DIM)]
HeadCount = Annotated[StrictInt, Field(ge=1, le=1024)]
WindowSize = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
ChunkSize = Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]
SinkTokens = Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]
PageSize = Annotated[StrictInt, Field(ge=1, le=MAX_PAGE_SIZE)]
QueryTokens = Annotated[StrictInt, Field(ge=1, le=MAX_QUERY_TOKENS)]


class TensorSpec(BaseModel):
    """A tensor an expression reads: `bias[h, q_idx - kv_idx + 2047]` (attngen.spec.expressions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[StrictStr, Field(pattern=TENSOR_NAME)]
    dtype: Annotated[StrictStr, Field(pattern="^(int32|int64|float32|bf16|fp16|bool)$")]
    shape: Annotated[tuple[DimName | DimSize, ...], Field(min_length=1, max_length=4)]
    trainable: StrictBool = False


class AttnSpec(BaseModel):
    """One attention flavour. Enum fields take their short YAML names; all else is exact-typed."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)

    name: Annotated[StrictStr, Field(pattern=NAME_PATTERN)]
    archs: Annotated[tuple[ArchName, ...], Field(min_length=1)]
    dtype: Dtype
    head_dim: HeadDim
    head_dim_v: HeadDim | None = None
    num_q_heads: HeadCount
    num_kv_heads: HeadCount
    mask: Mask
    causal_align: CausalAlign | None = None
    window_left: WindowSize | None = None
    window_right: WindowSize | None = None
    softcap: Annotated[float, Field(ge=0.0, le=1e4, allow_inf_nan=False, strict=True)] = 0.0
    alibi: StrictBool = False
    sinks: StrictBool = False
    chunk_size: ChunkSize | None = None
    sink_tokens: SinkTokens | None = None
    kernels: Annotated[tuple[KernelKind, ...], Field(min_length=1)]
    kv_layout: KvLayout | None = None
    page_size: PageSize | None = None
    max_query_tokens: QueryTokens | None = None
    kv_dtype: KvDtype | None = None
    backward: StrictBool = False
    dropout: StrictBool = False
    score_mod: StrictStr | None = None
    mask_mod: StrictStr | None = None
    tensors: tuple[TensorSpec, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _softcap_accepts_ints(cls, data: Any) -> Any:
        # `softcap: 50` is a number to any reader; strict float would refuse the int. Bools are
        # ints in Python and must stay refused.
        if isinstance(data, dict):
            cap = data.get("softcap")
            if isinstance(cap, int) and not isinstance(cap, bool):
                data = {**data, "softcap": float(cap)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AttnSpec:
        _check_unique("archs", self.archs)
        _check_unique("kernels", [k.value for k in self.kernels])
        for arch in self.archs:
            if arch not in arch_names():
                raise _field_error("archs", arch, f"one of {', '.join(arch_names())}")
        if self.num_q_heads % self.num_kv_heads:
            allowed = f"a divisor of num_q_heads={self.num_q_heads} (MHA, GQA or MQA)"
            raise _field_error("num_kv_heads", self.num_kv_heads, allowed)
        masked = self.mask is not Mask.none
        if masked and self.causal_align is None:
            allowed = f"top_left or bottom_right (required with mask {self.mask.value}: the"
            raise _field_error("causal_align", None, allowed + " diagonal is never guessed)")
        if not masked and self.causal_align is not None:
            raise _field_error("causal_align", self.causal_align.value, "absent with mask none")
        windowed = self.mask is Mask.sliding_window
        if windowed and self.window_left is None:
            raise _field_error("window_left", None, "an int >= 0 (required with sliding_window)")
        for field in ("window_left", "window_right"):
            if not windowed and getattr(self, field) is not None:
                raise _field_error(field, getattr(self, field), "absent unless sliding_window")
        check_model_fields(self)
        check_head_dims(self)
        self._check_decode()
        check_training(self)
        check_expressions(self)
        return self

    def _check_decode(self) -> None:
        if KernelKind.decode not in self.kernels:
            for field in DECODE_FIELDS:
                value = getattr(self, field)
                if value is not None:
                    shown = value.value if isinstance(value, Enum) else value
                    raise _field_error(field, shown, "absent unless kernels includes decode")
            return
        if self.kv_layout is None:
            raise _field_error("kv_layout", None, "contiguous or paged (required with decode)")
        paged = self.kv_layout is KvLayout.paged
        page_size = self.page_size
        if paged and page_size is None:
            allowed = _ALLOWED["page_size"] + " (required with kv_layout paged)"
            raise _field_error("page_size", None, allowed)
        if paged and page_size is not None and page_size & (page_size - 1):
            raise _field_error("page_size", page_size, _ALLOWED["page_size"])
        if not paged and self.page_size is not None:
            raise _field_error("page_size", self.page_size, "absent unless kv_layout is paged")
        if self.causal_align is CausalAlign.top_left:
            # A decode step's queries are the newest tokens of their sequences: the diagonal
            # sits bottom-right by construction, so a top-left spec describes another kernel.
            allowed = "bottom_right with decode (the step's queries are the last tokens of each"
            raise _field_error("causal_align", "top_left", allowed + " sequence)")
        check_kv_dtype(self)

    # Resolved views: templates and the tiler read these, never the optional raw fields.
    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def cache_layout(self) -> KvLayout:
        """Decode's KV cache layout (kv_layout, which validation requires with decode)."""
        if self.kv_layout is None:
            raise ValueError(f"{self.name}: kv_layout is set only when kernels include decode")
        return self.kv_layout

    @property
    def query_tokens(self) -> int:
        """Decode's largest number of query tokens per step (max_query_tokens, default 1)."""
        return self.max_query_tokens or 1

    @property
    def window(self) -> tuple[int, int] | None:
        if self.mask is not Mask.sliding_window:
            return None
        return (self.window_left or 0, self.window_right or 0)

    def canonical(self) -> dict[str, Any]:
        """Every field, defaults resolved, in declaration order: what the hash and headers use."""
        data = self.model_dump(mode="json")
        data["head_dim_v"] = self.value_head_dim
        if self.mask is Mask.sliding_window:
            data["window_right"] = self.window_right or 0
        if KernelKind.decode in self.kernels:
            data["max_query_tokens"] = self.query_tokens
            if self.kv_layout is not KvLayout.paged:
                del data["page_size"]
            if self.kv_dtype is None:  # the caches in the spec's dtype: the hash as before
                del data["kv_dtype"]
        else:
            for field in DECODE_FIELDS:
                del data[field]
        for field in TRAINING_FIELDS + MODEL_FIELDS + EXPRESSION_FIELDS:
            if data[field] in (None, False, []):
                del data[field]
        for field in ("score_mod", "mask_mod"):
            if field in data:
                data[field] = str(parsed(self, field))
        return data

    def spec_hash(self) -> str:
        return _hash(self.canonical())

    def kernel_hash(self, kind: KernelKind) -> str:
        """The hash of what one kernel depends on: the canonical spec with `kernels: [kind]`
        and, for prefill, no decode fields. A prefill kernel's hash (the tuning database's key)
        so stays the same when decode is added to a spec, and equals spec_hash() for a
        prefill-only spec."""
        data = self.canonical()
        data["kernels"] = [kind.value]
        if kind is not KernelKind.decode:
            for field in DECODE_FIELDS:
                data.pop(field, None)
        else:
            for field in TRAINING_FIELDS:
                data.pop(field, None)
        return _hash(data)


# module_name lives beside the spec (attngen/spec/names.py) and is importable from here too.
from attngen.spec.names import module_name as module_name  # noqa: E402


def _hash(canonical: dict[str, Any]) -> str:
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_unique(field: str, values: Any) -> None:
    seen: set[Any] = set()
    for value in values:
        if value in seen:
            raise _field_error(field, value, "each entry at most once")
        seen.add(value)


def parse_yaml(text: str) -> Any:
    """`text` read as strict YAML (attngen.spec.strict_yaml); a SpecError says what is wrong."""
    try:
        return load_yaml(text)
    except YamlError as exc:
        raise SpecError(str(exc)) from None


def specs_from_data(data: Any) -> tuple[AttnSpec, ...]:
    """Validate one parsed spec file into its flavours (one, or one per variant)."""
    if not isinstance(data, dict):
        raise SpecError(f"the file must be a mapping of spec fields, got {type(data).__name__}")
    base = {k: v for k, v in data.items() if k != "variants"}
    if "variants" not in data:
        return (_validate(base, prefix=""),)
    variants = data["variants"]
    if not isinstance(variants, dict) or not variants:
        raise SpecError(f"variants: got {variants!r}; allowed: a non-empty mapping name -> fields")
    specs = []
    for variant, overrides in variants.items():
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,23}", variant):
            raise SpecError(
                f"variants: got name {variant!r}; allowed: [a-z][a-z0-9_]*, at most 24 characters"
            )
        if not isinstance(overrides, dict):
            raise SpecError(f"variants.{variant}: got {overrides!r}; allowed: a mapping of fields")
        if "name" in overrides:
            raise SpecError(f"variants.{variant}.name: not allowed; the variant's key names it")
        merged = {**base, **overrides}
        if isinstance(base.get("name"), str):  # else the missing or mistyped name is reported
            merged["name"] = f"{base['name']}_{variant}"
        specs.append(_validate(merged, prefix=f"variants.{variant}."))
    return tuple(specs)


def _validate(data: dict[str, Any], prefix: str) -> AttnSpec:
    try:
        return AttnSpec.model_validate(data)
    except PydanticValidationError as exc:
        raise SpecError(prefix + describe(exc.errors()[0], _ALLOWED, _KNOWN_KEYS)) from None


_KNOWN_KEYS = ", ".join(AttnSpec.model_fields) + ", variants"
# What each field accepts, in the words of an error message.
_ALLOWED = {
    "name": "a lower-case identifier [a-z][a-z0-9_]*, at most 48 characters",
    "archs": f"a list of targets among {', '.join(arch_names())}",
    "head_dim": f"an int in 1..{MAX_HEAD_DIM} (up to {MAX_DECODE_HEAD_DIM} for decode only)",
    "head_dim_v": f"an int in 1..{MAX_HEAD_DIM} (up to {MAX_DECODE_HEAD_DIM} for decode only)",
    "num_q_heads": "an int in 1..1024",
    "num_kv_heads": "an int in 1..1024 that divides num_q_heads",
    "window_left": "an int in 0..2147483647",
    "window_right": "an int in 0..2147483647",
    "softcap": "a number in 0..10000 (0 disables it); YAML 1.2 form such as 50 or 30.0",
    "alibi": "true or false",
    "sinks": "true or false (true: the module takes sinks [HQ] fp32, one logit per head)",
    "chunk_size": "an int in 1..2147483647",
    "sink_tokens": "an int in 1..2147483647 (the first keys every query sees)",
    "kernels": "a list among prefill, varlen, decode (each at most once)",
    "kv_layout": "contiguous or paged",
    "page_size": f"a power of two in 1..{MAX_PAGE_SIZE}",
    "max_query_tokens": f"an int in 1..{MAX_QUERY_TOKENS} (query tokens per decode step)",
    "kv_dtype": "fp8_e4m3 (an fp8 KV cache with k_descale / v_descale), or absent",
    "backward": "true or false (gradient kernels in the prefill and varlen modules)",
    "dropout": "true or false (flash-attn's dropout_p compiled in; needs backward: true)",
    "score_mod": "an expression string over score, b, h, q_idx, kv_idx and the tensors",
    "mask_mod": "a bool expression string over b, h, q_idx, kv_idx and the tensors",
    "tensors": "a list of {name, dtype, shape, trainable}: name [a-z][a-z0-9_]*, dtype one of "
    "int32, int64, float32, bf16, fp16, bool, shape 1-4 dim names [A-Z][A-Z0-9_]* or ints >= 1",
}


def load_spec_file(path: str | Path) -> tuple[AttnSpec, ...]:
    """Read and validate one spec file; every failure is a SpecError naming the file."""
    path = Path(path)
    try:
        with path.open("rb") as handle:  # bounded: /dev/zero or a huge file is refused, not read
            raw = handle.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(
                f"more than {MAX_SPEC_BYTES} bytes; a spec file is at most {MAX_SPEC_BYTES} bytes"
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError("not UTF-8 text") from None
        return specs_from_data(parse_yaml(text))
    except OSError as exc:
        raise SpecError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply") from None
