"""Hugging Face transformers: the attention function registered as "attngen".

    attngen.register_transformers()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attngen")

transformers calls `attngen_attention(module, q, k, v, attention_mask, ...)` in each layer
with q [B, HQ, Nq, D] and k/v [B, HKV, Nk, D] (the KV cache already updated: the queries are
the last Nq of the Nk positions, so the causal diagonal is bottom-right). The mask function
registered with it hands over the 2D padding mask [B, Nk] (None without padding), as for
flash-attention:
- no padding: the prefill kind on the tensors as they are;
- padding (batches of prompts of different lengths, and every decode step after them): the
  tokens are unpadded into packed sequences and run through the varlen kind, as transformers'
  own flash-attention path does; padded query rows get output 0.
Packed-sequence kwargs (cu_seq_lens_q/k, max_length_q/k) go to the varlen kind directly.
Dropout in training (the layer's attention_dropout) runs on a module built with dropout: true,
as flash_attn_func's dropout_p does, and is refused naming dropout_p when none is loaded.
What no generated kernel can do (a 4D mask, attention sinks, output_attentions) is refused by
name, and so is a layer whose attention transformers defines through the mask or
extra arguments that this function never sees applied: a layer type other than
full_attention/sliding_attention (Llama 4's chunked_attention: its chunks live only in the
mask that the "attngen" mask function replaces by the padding mask), a config with
attention_chunk_size on such a layer, and kwargs that change the scores (s_aux/sinks,
position_bias, sparse key indices). Multi-head latent attention (DeepSeek-V3) needs no
refusal here: transformers hands over the decompressed q/k/v, plain attention with
head_dim qk_nope + qk_rope and head_dim_v v_head_dim, and dispatch matches those dims.
A decode step is a prefill/varlen call with Nq = 1 against transformers' own cache; the decode
kind (split-KV, for serving caches) is reached through flash_attn_with_kvcache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attngen.runtime.launch import run_dense, run_varlen
from attngen.runtime.selection import NoKernelError
from attngen.spec import CausalAlign, Mask

NAME = "attngen"
API = "transformers"


def register_transformers() -> str:
    """Register the attention function and its mask function under "attngen"; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attngen_attention)
    # flash-attention's mask function: the 2D padding mask, or None when nothing is padded.
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME


def _mask_of(module, query, key, sliding_window, is_causal):
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window:
        # transformers keeps key j for query i when i - W < j (<= i if causal): left W - 1.
        reach = sliding_window - 1
        return Mask.sliding_window, (reach, 0 if causal else reach)
    return (Mask.causal, None) if causal else (Mask.none, None)


# kwargs some models pass that change the scores; no spec has them.
_SCORE_KWARGS = {
    "s_aux": "attention sinks (an extra per-head logit in the softmax)",
    "sinks": "attention sinks (an extra per-head logit in the softmax)",
    "position_bias": "a position bias added to the scores (T5-style relative attention)",
    "indices": "sparse attention over selected keys",
    "block_indices": "sparse attention over selected key blocks",
    "topk_indices": "sparse attention over selected keys",
}
_LAYERS = ("full_attention", "sliding_attention")


def _refuse_unexpressed(module, kwargs) -> None:
    """NoKernelError naming what this layer's attention has that no spec expresses."""
    if not _SCORE_KWARGS.keys().isdisjoint(kwargs):
        for name, what in _SCORE_KWARGS.items():
            if kwargs.get(name) is not None:
                raise NoKernelError(f"attngen: {name}: {what} is not in any spec; use another "
                                    "attn_implementation for this model")
    config = getattr(module, "config", None)
    layer_type = getattr(module, "layer_type", None)
    layer_types, layer_idx = getattr(config, "layer_types", None), getattr(module, "layer_idx",
                                                                           None)
    if layer_type is None and layer_types and isinstance(layer_idx, int) and (
            0 <= layer_idx < len(layer_types)):
        layer_type = layer_types[layer_idx]
    if layer_type is not None and layer_type not in _LAYERS:
        raise NoKernelError(
            f"attngen: layer {layer_idx} is a {layer_type!r} layer; its mask is not the "
            "causal/window/padding mask the 'attngen' implementation applies (attngen serves "
            f"{' and '.join(_LAYERS)} layers), so it is refused rather than computed wrongly")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and layer_type is None:
        raise NoKernelError(f"attngen: attention_chunk_size={chunk} in the config and no layer "
                            "type says this layer is not chunked; chunked attention is not in "
                            "any spec")


def attngen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention-function contract: returns (out [B, Nq, HQ, DV], None)."""
    _refuse_unexpressed(module, kwargs)
    if kwargs.get("output_attentions"):
        raise NoKernelError("attngen: output_attentions=True: the kernels never form the "
                            "attention probabilities; use attn_implementation='eager'")
    mask, window = _mask_of(module, query, key, sliding_window, is_causal)
    # dropout (the layer's attention_dropout in training) needs a module built with dropout:
    # true; without one the call is refused naming dropout_p (launch.py).
    common = dict(mask=mask, align=CausalAlign.bottom_right, window=window, softcap=softcap,
                  alibi_slopes=None, scale=scaling, return_lse=False, fallback=None,
                  dropout_p=dropout)
    batch, _, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    if kwargs.get("cu_seq_lens_q") is not None and attention_mask is None:
        return _packed(query, key, value, kwargs, common), None
    if attention_mask is None:
        _refuse_packed_positions(kwargs.get("position_ids"), seqlen_q, seqlen_k)
        # [B, Nq, HQ, DV] contiguous (in place with a module that takes out=): transformers
        # reshapes it to [B, Nq, HQ * DV] next, which a transposed view would copy.
        out, _ = run_dense(API, query, key, value, heads_last=True, **common)
        return out, None
    if attention_mask.dim() != 2 or attention_mask.shape != (batch, seqlen_k):
        raise NoKernelError(
            f"attngen: attention_mask: got shape {tuple(attention_mask.shape)}; the 'attngen' "
            f"implementation takes the 2D padding mask [{batch}, {seqlen_k}] (call "
            "attngen.register_transformers() so transformers builds that one) or None")
    return _unpadded(query, key, value, attention_mask.bool(), common), None


def _unpadded(query, key, value, keep, common):
    """Padded [B, H, N, D] -> packed varlen call -> padded [B, Nq, HQ, DV] (0 in padding)."""
    batch, num_q_heads, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    keep_q = keep[:, seqlen_k - seqlen_q:]  # the queries are the last Nq positions
    rows_k = keep.flatten().nonzero().squeeze(1)
    cu_k = F.pad(keep.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    if seqlen_q == seqlen_k:  # same lengths per sequence: one tensor (the alignments agree)
        rows_q, cu_q = rows_k, cu_k
    else:
        rows_q = keep_q.flatten().nonzero().squeeze(1)
        cu_q = F.pad(keep_q.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))

    def packed(t, rows):
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).index_select(0, rows)

    # max_seqlen: the padded lengths bound every sequence's, so the host reads nothing more.
    out, _ = run_varlen(API, packed(query, rows_q), packed(key, rows_k), packed(value, rows_k),
                        cu_q, cu_k, seqlen_q, seqlen_k, length_bounds=(seqlen_q, seqlen_k),
                        **common)
    full = out.new_zeros((batch * seqlen_q, num_q_heads, out.shape[-1]))
    full.index_copy_(0, rows_q, out)
    return full.view(batch, seqlen_q, num_q_heads, out.shape[-1])


def _packed(query, key, value, kwargs, common):
    """Sequences packed along one batch row, delimited by transformers' cu_seq_lens kwargs."""
    if query.shape[0] != 1:
        raise NoKernelError(f"attngen: cu_seq_lens_q with batch {query.shape[0]}; packed "
                            "sequences come as one batch row")

    def flat(t):
        return t[0].transpose(0, 1)

    out, _ = run_varlen(API, flat(query), flat(key), flat(value), kwargs["cu_seq_lens_q"],
                        kwargs["cu_seq_lens_k"], int(kwargs["max_length_q"]),
                        int(kwargs["max_length_k"]), **common)
    return out[None]


def _refuse_packed_positions(position_ids, seqlen_q, seqlen_k) -> None:
    """Sequences packed into one row are marked only by position_ids restarting at 0; attending
    across them as one sequence would be silently wrong, so it is refused."""
    if position_ids is None or seqlen_q != seqlen_k or seqlen_q < 2:
        return
    if torch.compiler.is_compiling():  # the check reads the device; compiled prefill skips it
        return
    if bool((position_ids[..., 1:] < position_ids[..., :-1]).any()):
        raise NoKernelError("attngen: position_ids restart inside a row (packed sequences) "
                            "without cu_seq_lens_q/k; pass those (DataCollatorWithFlattening "
                            "does) or an attention mask")
