"""Hugging Face transformers: the attention function registered as "attngen".

    attngen.register_transformers()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attngen")

transformers calls `attngen_attention(module, q, k, v, attention_mask, ...)` in each layer
with q [B, HQ, Nq, D] and k/v [B, HKV, Nk, D] (the cache already updated: the causal diagonal
is bottom-right); the registered mask function (`attngen_mask`) hands over the 2D padding
mask. Unpadded calls run on the prefill kind, padded ones unpadded on the varlen kind, decode
steps of a static cache or a DynamicCache on a decode module with the key counts computed on
the device (`CacheLengths`: no host read, capturable), chunked layers with their `kv_offset`
(`ChunkedKeys`); gpt-oss's sinks (`s_aux`), dropout and latent attention's decompressed heads
go to modules built for them. docs/integration.md ("Transformers") gives each route and what
is refused by name (4D masks, output_attentions, unknown layer types, score-changing kwargs).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attngen.runtime import arguments, decode_ops, plans
from attngen.runtime.dispatch import Call, eager_only, probe
from attngen.runtime.launch import run_dense, run_varlen
from attngen.runtime.selection import Dispatch, NoKernelError
from attngen.spec import CausalAlign, KernelKind, KvLayout, Mask

NAME = "attngen"
API = "transformers"


def register_transformers() -> str:
    """Register the attention function and its mask function under "attngen"; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attngen_attention)
    AttentionMaskInterface.register(NAME, attngen_mask)
    return NAME


def attngen_mask(*args, **kwargs):
    """The mask function: a model's mask function with no built-in equivalent as a MaskMod;
    else flash-attention's answer (the 2D padding mask, or None when nothing is padded); for
    a chunked layer whose keys start past position 0, with that offset; for a static cache
    with no padded position, its written keys' counts (CacheLengths)."""
    from transformers.masking_utils import flash_attention_mask

    named = dict(zip(_MASK_ARGUMENTS, args, strict=False)) | kwargs
    if not _built_in(named.get("mask_function")):
        return mask_mod_of(**named)
    lengths = None if args else cache_lengths(kwargs)
    if lengths is not None:
        return lengths
    padding = flash_attention_mask(*args, **kwargs)
    offset, config = kwargs.get("kv_offset", 0), kwargs.get("config")
    chunk = getattr(config, "attention_chunk_size", None)
    if offset and chunk and kwargs.get("local_size") == chunk:
        return ChunkedKeys(padding, int(offset))
    return padding


_MASK_ARGUMENTS: tuple[str, ...] = ("batch_size", "q_length", "kv_length", "q_offset")
_MASK_ARGUMENTS += ("kv_offset", "mask_function", "attention_mask")


@functools.cache
def _built_in_codes() -> tuple[frozenset, object]:
    """The code objects of transformers' mask functions that the layer's own mask (its type,
    window, chunk and causality) applies, and and_masks' code."""
    from transformers import masking_utils as mu

    codes = {mu.causal_mask_function.__code__, mu.bidirectional_mask_function.__code__}
    codes |= {mu.sliding_window_overlay(1).__code__, mu.chunked_overlay(1, torch.zeros(1)).__code__}
    codes |= {mu.sliding_window_bidirectional_overlay(1).__code__}
    return frozenset(codes), mu.and_masks().__code__


def _built_in(mask_function, depth: int = 0) -> bool:
    """Whether a model's mask function is causality, a window, chunks (and_masks of those):
    what the built-in modules apply; None (no mask function: causal) too."""
    if mask_function is None:
        return True
    codes, and_code = _built_in_codes()
    code = getattr(mask_function, "__code__", None)
    if code in codes:
        return True
    if code is not and_code or depth > 3:
        return False
    inner = mask_function.__closure__[0].cell_contents  # and_masks' mask_functions
    return all(_built_in(fn, depth + 1) for fn in inner)


class MaskMod(NamedTuple):
    """What the mask function hands a layer whose mask function has no built-in equivalent
    (packed sequences, prefix-LM, image tokens, a user's): the mask_mod(b, h, q_idx, kv_idx)
    over the layer's query and key indices (padding and offsets included), which the
    attention function traces and runs on an expression module; and the padding mask it
    was made with (for a later call of the mask function that is handed this one)."""

    mask_mod: Callable
    padding: Tensor | None

    @property
    def ndim(self) -> int:
        """1, as CacheLengths' (transformers reads ndim of a mask it is handed back)."""
        return 1


def mask_mod_of(mask_function, attention_mask=None, q_offset=0, kv_offset=0, **kwargs) -> MaskMod:
    """The MaskMod of a mask-function call, as transformers' flex_attention_mask builds its
    mask_mod: the padding mask ANDed in (prepared to kv_length + kv_offset keys), the offsets
    added to the indices; the offsets as 0-d tensors, read at run time (a decode step's new
    offset needs no new trace or module)."""
    from transformers import masking_utils as mu

    padding = attention_mask
    if isinstance(padding, MaskMod | ChunkedKeys):
        padding = padding.padding
    elif isinstance(padding, CacheLengths):
        padding = None  # no padded position
    padded = mu.prepare_padding_mask(padding, kwargs["kv_length"], kv_offset)
    if padded is not None:
        mask_function = mu.and_masks(mask_function, mu.padding_mask_function(padded))
    device = kwargs.get("device") or (padding.device if padding is not None else "cpu")
    index = functools.partial(torch.as_tensor, dtype=torch.int64, device=device)
    offsets = [index(o).reshape(()) for o in (q_offset, kv_offset)]
    return MaskMod(_shifted(mask_function, *offsets), padding)


def _shifted(mask_function, q_offset: Tensor, kv_offset: Tensor) -> Callable:
    def shifted(batch_idx, head_idx, q_idx, kv_idx):
        return mask_function(batch_idx, head_idx, q_idx + q_offset, kv_idx + kv_offset)

    return shifted


def _softcapped(cap: float) -> Callable:
    def softcap(score, batch_idx, head_idx, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap


@eager_only("a mask function's mask_mod is traced in Python")
def _expressed(query, key, value, mask: MaskMod, dropout, scaling, softcap, kwargs):
    """A layer whose mask is a MaskMod: the traced mask_mod (and softcap as a score_mod), sinks
    (s_aux) and dropout on an expression module built on demand, out [B, Nq, HQ, DV]."""
    from attngen.runtime.flex.attention import attend
    from attngen.runtime.flex.cache import traced

    score_mod = _softcapped(float(softcap)) if softcap else None
    score, keep, mask_tree, capture = traced(score_mod, mask.mask_mod)
    trees, sinks = (score, keep, mask_tree), _sinks(kwargs.get("s_aux"), query)
    out = attend(API, query, key, value, trees, capture, scaling, False, None, sinks, dropout)
    return out.transpose(1, 2)


class ChunkedKeys(NamedTuple):
    """What the mask function hands a chunked layer whose cache no longer starts at position
    0: the padding mask (or None) and the position of the first key."""

    padding: torch.Tensor | None
    key_offset: int


def _mask_of(module, query, key, sliding_window, is_causal):
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if _layer_type(module) == "chunked_attention":
        return Mask.chunked, None
    if sliding_window:
        # transformers keeps key j for query i when i - W < j (<= i if causal): left W - 1.
        reach = sliding_window - 1
        return Mask.sliding_window, (reach, 0 if causal else reach)
    return (Mask.causal, None) if causal else (Mask.none, None)


# kwargs some models pass that change the scores; no spec has them (s_aux, gpt-oss's sinks,
# is read by attngen_attention).
_SCORE_KWARGS = {
    "sinks": "attention sinks under a name other than gpt-oss's s_aux (their semantics are "
    "not known to attngen)",
    "position_bias": "a position bias added to the scores (T5-style relative attention)",
    "indices": "sparse attention over selected keys",
    "block_indices": "sparse attention over selected key blocks",
    "topk_indices": "sparse attention over selected keys",
}
_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


def _layer_type(module) -> str | None:
    """The layer's type: its own `layer_type`, else config.layer_types[layer_idx]."""
    layer_type = getattr(module, "layer_type", None)
    if layer_type is not None:
        return layer_type
    config = getattr(module, "config", None)
    layer_types, layer_idx = (
        getattr(config, "layer_types", None),
        getattr(module, "layer_idx", None),
    )
    if layer_types and isinstance(layer_idx, int) and 0 <= layer_idx < len(layer_types):
        return layer_types[layer_idx]
    return None


def _refuse_unexpressed(module, kwargs, expressed: bool = False) -> None:
    """NoKernelError naming what this layer's attention has that no spec expresses; with a
    MaskMod (`expressed`) the mask function states the layer's mask, whatever its type."""
    # a loop over the names, not dict_keys.isdisjoint: Dynamo traces this one (fullgraph)
    for name, what in _SCORE_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NoKernelError(
                f"attngen: {name}: {what} is not in any spec; use another "
                "attn_implementation for this model"
            )
    if expressed:
        return
    config = getattr(module, "config", None)
    layer_type, layer_idx = _layer_type(module), getattr(module, "layer_idx", None)
    if layer_type is not None and layer_type not in _LAYERS:
        raise NoKernelError(
            f"attngen: layer {layer_idx} is a {layer_type!r} layer; its mask is not the "
            "causal/window/padding mask the 'attngen' implementation applies (attngen serves "
            f"{' and '.join(_LAYERS)} layers), so it is refused rather than computed wrongly"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and layer_type is None:
        raise NoKernelError(
            f"attngen: attention_chunk_size={chunk} in the config and no layer "
            "type says whether this layer is chunked (config.layer_types with "
            "chunked_attention), so it is refused rather than guessed"
        )
    if layer_type == "chunked_attention" and not (isinstance(chunk, int) and chunk > 0):
        raise NoKernelError(
            f"attngen: layer {layer_idx} is a chunked_attention layer and "
            f"config.attention_chunk_size is {chunk!r}; expected an int > 0"
        )


def attngen_attention(module, query, key, value, attention_mask, dropout=0.0,
                      scaling=None, sliding_window=None, softcap=None, is_causal=None,
                      **kwargs):  # fmt: skip
    """transformers' attention-function contract: returns (out [B, Nq, HQ, DV], None)."""
    expressed = isinstance(attention_mask, MaskMod)
    _refuse_unexpressed(module, kwargs, expressed)
    if kwargs.get("output_attentions"):
        raise NoKernelError(
            "attngen: output_attentions=True: the kernels never form the "
            "attention probabilities; use attn_implementation='eager'"
        )
    if expressed:
        out = _expressed(query, key, value, attention_mask, dropout, scaling, softcap, kwargs)
        return out, None
    mask, window = _mask_of(module, query, key, sliding_window, is_causal)
    chunk = None
    if mask is Mask.chunked:
        chunk = module.config.attention_chunk_size
        key, value, attention_mask = _chunk_aligned(
            key, value, attention_mask, chunk, query.shape[2]
        )
    elif isinstance(attention_mask, ChunkedKeys):
        attention_mask = attention_mask.padding
    # dropout (the layer's attention_dropout in training) needs a module built with dropout:
    # true; without one the call is refused naming dropout_p (launch.py).
    common = Call(
        mask=mask,
        align=CausalAlign.bottom_right,
        window=window,
        softcap=softcap,
        scale=scaling,
        sinks=_sinks(kwargs.get("s_aux"), query),
        chunk_size=chunk,
        dropout_p=dropout,
        deterministic=torch.are_deterministic_algorithms_enabled(),  # the backward's path
        heads_last=True,  # transformers' [B, N, H, D] (the dense route's; the others ignore it)
    )
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if kwargs.get("cu_seq_lens_q") is not None and attention_mask is None:
        return _packed(query, key, value, kwargs, common), None
    if isinstance(attention_mask, CacheLengths):
        return _cache_call(query, key, value, attention_mask, common), None
    if attention_mask is None:
        _refuse_packed_positions(kwargs.get("position_ids"), seqlen_q, seqlen_k)
        return _dense(query, key, value, common), None
    return _padded(query, key, value, attention_mask, common), None


def _padded(query, key, value, padding, common):
    """A 2D padding mask [B, n]: n = Nk, or a static cache's first n written positions (the
    keys past them dropped); unpadded through the varlen kind."""
    batch, _, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    written = padding.shape[1] if padding.dim() == 2 else -1
    if padding.dim() != 2 or padding.shape[0] != batch or not seqlen_q <= written <= seqlen_k:
        raise NoKernelError(
            f"attngen: attention_mask: got shape {tuple(padding.shape)}; the 'attngen' "
            f"implementation takes the 2D padding mask [{batch}, {seqlen_k}] (call "
            f"attngen.register_transformers() so transformers builds that one; [{batch}, n], "
            f"{seqlen_q} <= n <= {seqlen_k}, for a static cache's first n positions) or None"
        )
    if written < seqlen_k:  # a static cache: its first n positions are the written ones
        key, value = key[:, :, :written], value[:, :, :written]
    return _unpadded(query, key, value, padding.bool(), common)


def _cache_call(query, key, value, lengths: CacheLengths, common):
    """A cache's layer with no padded position (CacheLengths): a step a decode module serves
    runs there, reading no device value on the host; any other (the prefill, a step past the
    module's query tokens, no module) is plain attention over a dynamic cache's keys (all
    written), else takes the varlen route over a static cache's written keys."""
    decode = decode_module(query, key, value, common)
    if decode is not None:
        return run_decode_module(decode, query, key, value, lengths, common)
    if lengths.all_written:
        return _dense(query, key, value, common)
    # the queries are the last Nq written keys (not the last of the cache): all kept
    every_query = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
    return _unpadded(query, key, value, valid_keys(lengths, key.shape[2]), common, every_query)


def _sinks(s_aux, query):
    """gpt-oss's sinks [HQ] as the fp32 contiguous tensor the kernels take, or None."""
    if s_aux is None:
        return None
    if s_aux.shape != (query.shape[1],):
        expected = f"the sinks of the layer's {query.shape[1]} query heads [{query.shape[1]}]"
        raise NoKernelError(f"attngen: s_aux: got shape {tuple(s_aux.shape)}; expected {expected}")
    # Not detached: sinks that need a gradient (gpt-oss's are an nn.Parameter) take the op
    # layer, whose backward returns their gradient from a module built with backward: true.
    return s_aux.to(device=query.device, dtype=torch.float32).contiguous()


def _chunk_aligned(key, value, attention_mask, chunk: int, seqlen_q: int):
    """(key, value, padding mask) whose key 0 starts a chunk: a chunked layer's cache that
    starts at position o > 0 drops its first (-o) mod chunk keys (the end of a chunk that no
    query is in), so the kernel's chunks, counted from key 0, are the sequence's."""
    if not isinstance(attention_mask, ChunkedKeys):
        return key, value, attention_mask
    padding, offset = attention_mask
    drop = -offset % chunk
    if padding is not None:
        raise NoKernelError(
            f"attngen: a chunked_attention layer with padding and a cache "
            f"that starts at position {offset}: the chunks of padded "
            "sequences would start at different keys; use unpadded batches"
        )
    if key.shape[2] - seqlen_q < drop:
        raise NoKernelError(
            f"attngen: chunked_attention: queries in the chunk that the cache "
            f"holds only the end of (cache starts at position {offset}, chunk "
            f"{chunk}); the kernels count chunks from the first key"
        )
    return key[:, :, drop:], value[:, :, drop:], None


def _dense(query, key, value, common):
    """The unpadded call: [B, Nq, HQ, DV] contiguous (in place with a module that takes out=),
    as transformers reshapes it to [B, Nq, HQ * DV] next, which a transposed view would
    copy. Its route is planned per signature (plans.py): the layer's own checks above run on
    every call."""
    plan_key = None
    sinks = common.sinks
    grad = plans.grad_mode(query, key, value, sinks)  # learned sinks that train: None
    if grad is not None and plans.plain(common.scale, common.softcap, common.dropout_p):
        # sinks: a tensor or None (their presence picks the module); chunk_size: an int
        plan_key = (API, query.shape, key.shape, value.shape, query.dtype, query.device,
                    common.mask, common.window, common.softcap, common.scale, sinks is None,
                    common.chunk_size, common.deterministic if grad else None)  # fmt: skip
        plan = plans.find(plan_key)
        if plan is not None:
            ran = (
                plans.run_trained(
                    plan, query, key, value, None, common.deterministic, flash=False, sinks=sinks
                )
                if grad
                else plans.run_dense(plan, query, key, value, None, heads_last=True, sinks=sinks)
            )
            if ran is not None:
                return ran[0]
    out, _ = run_dense(API, query, key, value, common, plan_key=plan_key)
    return out


def _unpadded(query, key, value, keep, common, keep_q=None):
    """Padded [B, H, N, D] -> packed varlen call -> padded [B, Nq, HQ, DV] (0 in padding).
    keep_q: which queries are kept, [B, Nq]; by default those of the last Nq positions."""
    batch, num_q_heads, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    same_rows = keep_q is None and seqlen_q == seqlen_k
    if keep_q is None:
        keep_q = keep[:, seqlen_k - seqlen_q :]  # the queries are the last Nq positions
    rows_k = keep.flatten().nonzero().squeeze(1)
    cu_k = F.pad(keep.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    if same_rows:  # same lengths per sequence: one tensor (the alignments agree)
        rows_q, cu_q = rows_k, cu_k
    else:
        rows_q = keep_q.flatten().nonzero().squeeze(1)
        cu_q = F.pad(keep_q.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))

    def packed(t, rows):
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).index_select(0, rows)

    # max_seqlen: the padded lengths bound every sequence's, so the host reads nothing more.
    qkv = (packed(query, rows_q), packed(key, rows_k), packed(value, rows_k))
    out, _ = run_varlen(
        API, *qkv, cu_q, cu_k, seqlen_q, seqlen_k, common, length_bounds=(seqlen_q, seqlen_k)
    )
    full = out.new_zeros((batch * seqlen_q, num_q_heads, out.shape[-1]))
    full.index_copy_(0, rows_q, out)
    return full.view(batch, seqlen_q, num_q_heads, out.shape[-1])


def _packed(query, key, value, kwargs, common):
    """Sequences packed along one batch row, delimited by transformers' cu_seq_lens kwargs."""
    if query.shape[0] != 1:
        raise NoKernelError(
            f"attngen: cu_seq_lens_q with batch {query.shape[0]}; packed "
            "sequences come as one batch row"
        )

    def flat(t):
        return t[0].transpose(0, 1)

    cu_seqlens = (kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])
    max_seqlens = (int(kwargs["max_length_q"]), int(kwargs["max_length_k"]))
    out, _ = run_varlen(API, flat(query), flat(key), flat(value), *cu_seqlens, *max_seqlens, common)
    return out[None]


class _CheckedPositions:
    """The last position_ids found monotone, by identity and version counter: transformers
    hands every layer of a forward the same tensor, and the check reads the device, so a
    forward pays one host read (its first layer's) instead of one per layer, which stalled
    the host behind the previous layers' GPU work each time (8 reads cost a Llama-3-8B-shaped
    prefill of 1k tokens a fifth of its time). An in-place write bumps the version: checked
    again."""

    last: tuple[weakref.ref, int] | None = None  # one attribute: threads see both or neither

    @classmethod
    def seen(cls, position_ids: torch.Tensor) -> bool:
        last = cls.last
        return (
            last is not None
            and last[0]() is position_ids  # never an inference tensor: remember skips those
            and position_ids._version == last[1]
        )

    @classmethod
    def remember(cls, position_ids: torch.Tensor) -> None:
        # An inference-mode tensor has no version counter, so an in-place write would go
        # unseen: such position_ids are read on every call.
        if not position_ids.is_inference():
            cls.last = (weakref.ref(position_ids), position_ids._version)


def _refuse_packed_positions(position_ids, seqlen_q, seqlen_k) -> None:
    """Sequences packed into one row are marked only by position_ids restarting at 0; attending
    across them as one sequence would be silently wrong, so it is refused."""
    if position_ids is None or seqlen_q != seqlen_k or seqlen_q < 2:
        return
    if torch.compiler.is_compiling():  # the check reads the device; compiled prefill skips it
        return
    if _CheckedPositions.seen(position_ids):
        return
    if bool((position_ids[..., 1:] < position_ids[..., :-1]).any()):
        raise NoKernelError(
            "attngen: position_ids restart inside a row (packed sequences) "
            "without cu_seq_lens_q/k; pass those (DataCollatorWithFlattening "
            "does) or an attention mask"
        )
    _CheckedPositions.remember(position_ids)


# -------------------------------------------------------------- static and dynamic caches
#
# A StaticCache's decode steps (generate(cache_implementation="static")), and a DynamicCache's,
# run on a generated decode module with no host read, so that a step can be captured: the
# "attngen" mask function turns such a call into `CacheLengths`, each sequence's written keys
# (q_offset + Nq) computed on the device, which the decode module takes as cache_seqlens
# (contiguous cache, nothing appended: the layer wrote the step's keys already). The decode
# kernel attends to keys [0, cache_seqlens[b]), so a padding mask with any padded position (left
# padding) is not a CacheLengths: that step takes the varlen route (exact, unpadded with a host
# read, as transformers' flash-attention path does). What transformers does with these caches,
# and the host reads: docs/architecture.md, "transformers' caches".


class CacheLengths(NamedTuple):
    """What the mask function hands a layer of a static cache, or a dynamic cache's decode
    step, with no padded position: the keys each sequence has written, int32 [B] on the device
    (the cache's first positions). all_written: the layer's keys are exactly those (a dynamic
    cache), so a step no decode module serves is plain attention over them."""

    seqlens: Tensor
    all_written: bool = False

    @property
    def ndim(self) -> int:
        """1: transformers converts a mask it is handed back with ndim == 2 to bool, and reads
        ndim of it (generate() hands the model the mask function's answer)."""
        return 1


def cache_lengths(kwargs: dict) -> CacheLengths | None:
    """CacheLengths for a mask-function call that sizes a static cache's full-attention mask,
    or a dynamic cache's after its prefill (see the module docstring), with no padded
    position; None for any other call."""
    q_offset, q_length = kwargs.get("q_offset", 0), kwargs.get("q_length")
    kv_length, padding = kwargs.get("kv_length"), kwargs.get("attention_mask")
    if not (isinstance(q_length, int) and isinstance(kv_length, int)):
        return None
    if kwargs.get("local_size") is not None or kwargs.get("kv_offset", 0) != 0:
        return None  # sliding and chunked layers' caches do not start at position 0
    from transformers.masking_utils import causal_mask_function

    if kwargs.get("mask_function", causal_mask_function) is not causal_mask_function:
        return None  # a mask with more than causality and padding (image tokens, packing)
    if isinstance(q_offset, Tensor):
        if q_offset.numel() != 1:
            return None
    elif not isinstance(q_offset, int) or kv_length < q_offset + q_length:
        return None
    elif kv_length == q_offset + q_length and q_offset == 0:
        return None  # a dynamic cache's prefill (nothing cached before it): plain attention
    if isinstance(padding, CacheLengths):
        padding = None  # generate()'s first call said no padding; recomputed from the cache
    if padding is not None and not _pads_nothing(padding):
        return None
    batch = kwargs.get("batch_size")
    if not isinstance(batch, int):
        return None
    written = q_offset + q_length
    if isinstance(written, Tensor):  # a static cache: how many are written is device data
        seqlens = written.reshape(1).to(torch.int32).expand(batch).contiguous()
        return CacheLengths(seqlens)
    seqlens = torch.full((batch,), written, dtype=torch.int32, device=kwargs.get("device"))
    return CacheLengths(seqlens, all_written=written == kv_length)


def _pads_nothing(padding) -> bool:
    """Whether a 2D padding mask keeps every position: read on the host, as transformers'
    flash_attention_mask does, except while compiling or capturing (then False: kept)."""
    if not isinstance(padding, Tensor) or padding.dim() != 2:
        return False
    if torch.compiler.is_compiling():
        return False
    if padding.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return bool(padding.all())


def decode_module(query, key, value, common: Call) -> Dispatch | None:
    """The decode-kind module (contiguous cache) that serves a static-cache step of these
    tensors and options, recorded (last_dispatch), or None: then the varlen route serves it.
    Decode is forward-only: dropout and inputs that need a gradient take the varlen route."""
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value) if t is not None
    )
    if common.dropout_p or needs_grad:
        return None
    lengths = (query.shape[2], key.shape[2])
    need = common.need(
        KernelKind.decode, query, value, lengths, False, kv_layout=KvLayout.contiguous
    )
    return probe("transformers", need, (query.shape[1], key.shape[1]))


def run_decode_module(decode: Dispatch, query, key, value, lengths: CacheLengths, common):
    """out [B, Nq, HQ, DV] contiguous from the decode module: q [B, HQ, Nq, D] and the whole
    static cache [B, HKV, L, D] read in place, cache_seqlens the written keys, no append."""
    assert decode.key is not None  # probe() answers served dispatches only
    scale = arguments.softmax_scale(common.scale, query)
    tensors = (query, key, value, lengths.seqlens, None, None, None)  # no block table, no append
    out, _ = decode_ops.decode(
        decode.key, *tensors, scale, None, False, heads_last=True, sinks=common.sinks
    )
    return out


def valid_keys(lengths: CacheLengths, seqlen_k: int) -> Tensor:
    """The padding mask [B, L] of the lengths: key j of sequence b kept when j < seqlens[b]."""
    positions = torch.arange(seqlen_k, device=lengths.seqlens.device)
    return positions[None, :] < lengths.seqlens[:, None]
