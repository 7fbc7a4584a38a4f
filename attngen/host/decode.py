"""What every decode module's host code does alike: the split rule, the input checks, the
caches' size and strides, the partial outputs, flash-attn's layouts. What its spec decides
(the cache's layout, dtypes, ALiBi, the split rule's constants) the module's constants say.
Copied verbatim into decode modules after launch.py (attngen/host/__init__.py)."""

from typing import Any

import torch

from attngen.host.launch import _LAUNCH_CACHE_SIZE

_STAND_IN: Any = None
# the module's own (above the host code)
INTERPRETER_SM_COUNT = MAX_SPLITS = MIN_BLOCKS_PER_SPLIT = SPLIT_WAVES = _STAND_IN
KV_LAYOUT = PAGE_SIZE = ALIBI = _BLOCK_DV = DTYPE = KV_DTYPE = _STAND_IN
HEAD_DIM = HEAD_DIM_V = MAX_QUERY_TOKENS = _INTERPRET = _KEEPS_PLANS = _STAND_IN
decode = _call_key = _run_plan = _keep_flash_plan = _FLASH_PLANS = _check_out = _STAND_IN
_FLASH_LENGTH_DIM = _LENGTH_DIM = 0


# -- host code: attngen/host/decode.py, copied verbatim ----------------------------------------
_SM_COUNTS: dict[int, int] = {}
_SPLITS: dict[tuple, tuple[int, int]] = {}  # (programs, key blocks, block_n, SMs, requested)


def _sm_count(device):
    """The device's SM count, read once per device (a property query: no sync, so a decode
    launch can be captured in a CUDA graph); the interpreter assumes INTERPRETER_SM_COUNT."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _splits_for(programs, span, block_n, sm_count, requested):
    """_num_splits(...), remembered under the span's key blocks (all the rule reads of it): a
    decode loop asks the same question at every step, and a growing cache at every step of a
    block."""
    key = (programs, -(-span // block_n), block_n, sm_count, requested)
    answer = _SPLITS.get(key)
    if answer is None:
        if len(_SPLITS) >= _LAUNCH_CACHE_SIZE:
            _SPLITS.clear()
        answer = _SPLITS[key] = _num_splits(programs, span, block_n, sm_count, requested)
    return answer


def _num_splits(programs, span, block_n, sm_count, requested=0):
    """(splits, keys per split): attngen/tiling/decode.py's num_splits, integers only. A
    requested count (decode's num_splits, else FORCE_NUM_SPLITS) replaces the rule's: the keys
    in min(requested, MAX_SPLITS) splits of ceil(blocks / that) blocks, the empty ones
    dropped, so at most one split per key block and MAX_SPLITS in all (the combine's bound)."""
    blocks = max(1, -(-span // block_n))
    if requested:
        per_split = -(-blocks // min(requested, MAX_SPLITS))
        return -(-blocks // per_split), per_split * block_n
    most = max(1, min(blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))
    wanted = min(-(-SPLIT_WAVES * sm_count // max(programs, 1)), most)
    best, best_total, best_waves = wanted, 0, 1
    for splits in range(wanted, min(2 * wanted, most) + 1):
        total = programs * splits
        waves = -(-total // sm_count)
        if total * best_waves > best_total * waves:  # a fuller last wave
            best, best_total, best_waves = splits, total, waves
    per_split = -(-blocks // best)
    return -(-blocks // per_split), per_split * block_n


_UNIT_DESCALES: dict = {}  # device -> fp32 [1] holding 1.0: FA3's None descale, strides 0


def _unit_descale(q):
    unit = _UNIT_DESCALES.get(q.device)
    if unit is None:
        unit = torch.ones(1, dtype=torch.float32, device=q.device)
        # one made while a CUDA graph is captured holds 1.0 only once the graph replays
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            _UNIT_DESCALES[q.device] = unit
    return unit


def _check_tensor(name, t, shape, dtype, device):
    """t must be a tensor of `shape` (None: any size there), dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    sizes = zip(shape, t.shape, strict=False)
    if t.dim() != len(shape) or any(n is not None and n != m for n, m in sizes):
        expected = "[" + ", ".join("*" if n is None else str(n) for n in shape) + "]"
        raise ValueError(f"{name}: expected shape {expected}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (as q), got {t.device}")


def _inputs_ok(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new):
    """_check_inputs' success path, by comparisons only (False: _check_inputs says why)."""
    tensor = torch.Tensor
    if not (type(q) is tensor and type(k_cache) is tensor and type(v_cache) is tensor
            and type(cache_seqlens) is tensor and q.dim() == 4 and k_cache.dim() == 4):  # fmt: skip
        return False
    cuda, device = q.is_cuda, q.get_device()
    if not (cuda or (_INTERPRET and q.is_cpu)) or not (
            (k_cache.is_cuda and v_cache.is_cuda and cache_seqlens.is_cuda) if cuda else
            (k_cache.is_cpu and v_cache.is_cpu and cache_seqlens.is_cpu)):  # fmt: skip
        return False
    batch, num_q_heads, num_q_tokens, dim = q.shape
    if KV_LAYOUT == "paged":
        num_pages, page_size, num_kv_heads, dim_k = k_cache.shape
        layout_ok = (page_size == PAGE_SIZE
                     and v_cache.shape == (num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM_V)
                     and type(block_table) is tensor and block_table.dim() == 2
                     and block_table.shape[0] == batch and block_table.dtype == torch.int32
                     and (block_table.is_cuda if cuda else block_table.is_cpu)
                     and block_table.get_device() == device)  # fmt: skip
    else:
        outer, num_kv_heads, capacity, dim_k = k_cache.shape
        layout_ok = (outer == batch and block_table is None
                     and v_cache.shape == (batch, num_kv_heads, capacity, HEAD_DIM_V))  # fmt: skip
    if not (layout_ok and dim == HEAD_DIM and dim_k == HEAD_DIM
            and num_q_tokens <= MAX_QUERY_TOKENS and q.dtype == DTYPE
            and k_cache.dtype == KV_DTYPE and v_cache.dtype == KV_DTYPE
            and k_cache.get_device() == device and v_cache.get_device() == device
            and cache_seqlens.shape == (batch,) and cache_seqlens.dtype == torch.int32
            and cache_seqlens.get_device() == device and cache_seqlens.is_contiguous()
            and num_kv_heads != 0 and num_q_heads % num_kv_heads == 0):  # fmt: skip
        return False
    if k_new is None and v_new is None:
        return True
    return (type(k_new) is tensor and type(v_new) is tensor and k_new.dim() == 4
            and k_new.shape[0] == batch and k_new.shape[1] == num_kv_heads
            and k_new.shape[3] == HEAD_DIM
            and v_new.shape == (batch, num_kv_heads, k_new.shape[2], HEAD_DIM_V)
            and k_new.dtype == DTYPE and v_new.dtype == DTYPE
            and ((k_new.is_cuda and v_new.is_cuda) if cuda else (k_new.is_cpu and v_new.is_cpu))
            and k_new.get_device() == device and v_new.get_device() == device)  # fmt: skip


def _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, flash=False):
    """_inputs_ok's checks (on any device), naming what fails; flash: q, the new keys and a
    contiguous cache in flash-attn's [B, N, H, D] layout, as decode_flash takes them."""
    rows_dim = 1 if flash else 2  # the tokens' (positions') dimension
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        layout = "NQ, HQ" if flash else "HQ, NQ"
        raise ValueError(f"q: expected a tensor [B, {layout}, {HEAD_DIM}], got {shape}")
    if q.device.type != "cuda" and not (_INTERPRET and q.device.type == "cpu"):
        raise ValueError("q: expected CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
                         f"got {q.device}")  # fmt: skip
    batch, num_q_heads, num_q_tokens = q.shape[0], q.shape[3 - rows_dim], q.shape[rows_dim]
    _check_tensor("q", q, (None, None, None, HEAD_DIM), DTYPE, q.device)
    if num_q_tokens > MAX_QUERY_TOKENS:
        raise ValueError(f"q: expected at most max_query_tokens={MAX_QUERY_TOKENS} query "
                         f"tokens (dim {rows_dim}), got {num_q_tokens}")  # fmt: skip
    _check_cache_dtype(k_cache, v_cache)
    num_kv_heads = _check_caches(k_cache, v_cache, block_table, batch, q.device, flash)
    _check_tensor("cache_seqlens", cache_seqlens, (batch,), torch.int32, q.device)
    if not cache_seqlens.is_contiguous():
        raise ValueError("cache_seqlens: expected a contiguous tensor (read with stride 1), got "
                         f"strides {cache_seqlens.stride()}")  # fmt: skip
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError("heads: expected q heads a multiple of the cache's KV heads, "
                         f"got {num_q_heads} and {num_kv_heads}")  # fmt: skip
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new, v_new: expected both or neither, got "
                         f"{type(k_new).__name__} and {type(v_new).__name__}")  # fmt: skip
    if k_new is not None:
        _check_tensor("k_new", k_new, _in_layout(flash, batch, num_kv_heads, None, HEAD_DIM),
                      DTYPE, q.device)  # fmt: skip
        num_new = k_new.shape[rows_dim]
        _check_tensor("v_new", v_new, _in_layout(flash, batch, num_kv_heads, num_new, HEAD_DIM_V),
                      DTYPE, q.device)  # fmt: skip


def _check_caches(k_cache, v_cache, block_table, batch, device, flash):
    """_check_inputs' checks of the caches and the block table: the caches' KV heads."""
    if KV_LAYOUT == "paged":
        _check_tensor("k_cache", k_cache, (None, PAGE_SIZE, None, HEAD_DIM), KV_DTYPE, device)
        num_pages, _, num_kv_heads, _ = k_cache.shape
        _check_tensor("v_cache", v_cache, (num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM_V),
                      KV_DTYPE, device)  # fmt: skip
        if block_table is None:
            raise ValueError("block_table: expected int32 [B, max_pages] for a paged cache, got "
                             "None")  # fmt: skip
        _check_tensor("block_table", block_table, (batch, None), torch.int32, device)
        return num_kv_heads
    rows_dim = 1 if flash else 2
    _check_tensor("k_cache", k_cache, (batch, None, None, HEAD_DIM), KV_DTYPE, device)
    num_kv_heads, capacity = k_cache.shape[3 - rows_dim], k_cache.shape[rows_dim]
    _check_tensor("v_cache", v_cache, _in_layout(flash, batch, num_kv_heads, capacity, HEAD_DIM_V),
                  KV_DTYPE, device)  # fmt: skip
    if block_table is not None:
        raise ValueError("block_table: expected None for a contiguous cache, got a "
                         f"{type(block_table).__name__}")  # fmt: skip
    return num_kv_heads


def _check_cache_dtype(k_cache, v_cache):
    """One line for a cache of the other kind: fp8 caches need a module built for them, and a
    module built for them fp8 caches."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        dtype = getattr(cache, "dtype", None)
        if KV_DTYPE is not DTYPE and dtype in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name}: expected an fp8 cache (torch.float8_e4m3fn, with "
                             f"k_descale / v_descale), got {dtype}: this module is built with "
                             "kv_dtype: fp8_e4m3; 16-bit caches need a module without "
                             "it")  # fmt: skip
        fp8 = dtype is not None and dtype.itemsize == 1 and dtype.is_floating_point
        if KV_DTYPE is DTYPE and fp8:
            raise ValueError(f"{name}: got an fp8 cache ({dtype}); this module's caches are "
                             f"{DTYPE}: an fp8 cache needs a module built with kv_dtype: "
                             "fp8_e4m3")  # fmt: skip


def _in_layout(flash, batch, heads, rows, dim):
    """A shape [B, H, N, D] in decode()'s layout, or [B, N, H, D] in flash-attn's (flash)."""
    return (batch, rows, heads, dim) if flash else (batch, heads, rows, dim)


def _tree_args(tree_mask, batch, num_q_tokens, q, rotary_cos):
    """(tree_mask as uint8 or None, its [B, NQ, NQ] strides): torch.bool [B, NQ, NQ] or [NQ, NQ]
    (stride 0 over the batch) on q's device, any strides; only the kernel reads its values."""
    if tree_mask is None:
        return None, (0, 0, 0)
    if ALIBI:
        raise ValueError("tree_mask: not in an ALiBi module (alibi: true): a draft's position "
                         "is its tree depth, not the cache slot the bias reads")  # fmt: skip
    if rotary_cos is not None:
        raise ValueError("tree_mask: not with rotary_cos: a draft token's position is its tree "
                         "depth, not its cache slot; rotate q and k_new at the tree's positions "
                         "before the call")  # fmt: skip
    n = num_q_tokens
    if not (isinstance(tree_mask, torch.Tensor) and tree_mask.dtype == torch.bool
            and tree_mask.device == q.device
            and tree_mask.shape in ((batch, n, n), (n, n))):  # fmt: skip
        got = (f"{list(tree_mask.shape)} {tree_mask.dtype} on {tree_mask.device}"
               if isinstance(tree_mask, torch.Tensor) else type(tree_mask).__name__)  # fmt: skip
        raise ValueError(f"tree_mask: expected a torch.bool tensor [{batch}, {n}, {n}] or [{n}, "
                         f"{n}] (q's batch and query tokens) on {q.device}, got {got}")  # fmt: skip
    tree = tree_mask.view(torch.uint8)
    return tree, (0, *tree.stride()) if tree.dim() == 2 else tree.stride()


# -- what follows the caches' size -------------------------------------------------------------
# A cache that grows by a key a step (transformers' DynamicCache hands decode() new tensors
# [B, HKV, L + 1, D] each step) changes the capacity, the caches' strides, the split count and
# the partials' size, and nothing else a launch derives. The full path and the call plans
# derive those from the caches with the functions below, so that a plan launches what the full
# path would for caches of any length.
def _cache_size(k_cache, block_table, length_dim=_LENGTH_DIM):
    """(capacity, pages): the positions a sequence may hold and a paged cache's pages (0 for a
    contiguous cache, whose positions lie along length_dim: decode()'s 2, decode_flash's 1)."""
    if KV_LAYOUT == "paged":
        return block_table.shape[1] * PAGE_SIZE, k_cache.shape[0]
    return k_cache.shape[length_dim], 0


def _cache_strides(t):
    """(outer, head, row, dim) strides of a cache: batch or page, KV head, position or slot."""
    if KV_LAYOUT == "paged":
        return t.stride(0), t.stride(2), t.stride(1), t.stride(3)
    return t.stride()  # [B, HKV, Lmax, D]: in that order already


def _ints_around(parts, strides, sizes):
    """A kernel's ints: parts = (before, between, after), the ints the call's layout fixes,
    around the caches' strides (k's then v's) and `sizes`, the ints that follow their size."""
    before, between, after = parts
    return (*before, *strides, *between, *sizes, *after)


def _partials(q, rows, splits, sizes=None):
    """The split kernel's partial outputs [rows, splits, DV] then their LSEs [rows, splits],
    fp32, in one allocation (the kernels take pointers; the LSEs start 64-byte aligned).
    sizes: _partial_sizes(rows, splits), where the caller keeps them."""
    size, total = _partial_sizes(rows, splits) if sizes is None else sizes
    part_out = q.new_empty(total, dtype=torch.float32)
    return part_out, part_out[size:]


def _partial_sizes(rows, splits):
    """(the partial outputs' elements, the allocation's) of _partials."""
    size = rows * splits * _BLOCK_DV.value
    return size, size * (_BLOCK_DV.value + 1) // _BLOCK_DV.value


# -- flash-attn's layouts ----------------------------------------------------------------------
# decode() reads every tensor through its strides: a [B, N, H, D] tensor is a [B, H, N, D] view
# with the same pointer and ints. decode_flash and decode_flash_out check the call in the
# caller's layout and call decode() on views, writing a [B, NQ, HQ, DV] output in place; a
# plan (decode()'s for the views, kept under the call's own key) then launches from the
# caller's tensors themselves.
def _heads_last_decode(flash, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                       sm_scale, alibi_slopes, return_lse, out, num_splits, rotary_cos,
                       rotary_sin, rotary_interleaved, rotary_q_per_token, tree_mask,
                       extra):  # fmt: skip
    """decode_flash (flash) or decode_flash_out: out [B, NQ, HQ, DV] (and the LSE [B, HQ, NQ]);
    extra: the module's own arguments of decode() (sinks, k/v_descale, tensors, block_mask)."""
    length_dim = _FLASH_LENGTH_DIM if flash else _LENGTH_DIM
    key = descales = None
    if _KEEPS_PLANS and extra.get("tensors") is None and extra.get("block_mask") is None:
        if KV_DTYPE is not DTYPE:
            descales = (extra["k_descale"], extra["v_descale"])
        key = _call_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sm_scale,
                        alibi_slopes, return_lse, out, num_splits, rotary_cos, rotary_sin,
                        rotary_interleaved, rotary_q_per_token, length_dim, descales,
                        tree_mask)  # fmt: skip
        plan = None if key is None else _FLASH_PLANS[flash].get(key)
        if plan is not None:
            done = _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                             out, rotary_cos, rotary_sin, tree_mask, descales)  # fmt: skip
            if done is not None:
                return done if return_lse else done[0]
    views = _heads_first(flash, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    batch, num_q_heads, num_q_tokens = views[0].shape[:3]
    out_shape = (batch, num_q_tokens, num_q_heads, HEAD_DIM_V)
    if out is None:
        out = q.new_empty(out_shape)
    else:
        _check_out(out, out_shape, q, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                       ("k_new", k_new), ("v_new", v_new),
                                       ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                                       ("tree_mask", tree_mask)))  # fmt: skip
    q_, k_cache_, v_cache_, k_new_, v_new_ = views
    out_view = out.transpose(1, 2)
    result = decode(q_, k_cache_, v_cache_, cache_seqlens, block_table=block_table, k_new=k_new_,
                    v_new=v_new_, sm_scale=sm_scale, alibi_slopes=alibi_slopes,
                    return_lse=return_lse, out=out_view, num_splits=num_splits,
                    rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                    rotary_interleaved=rotary_interleaved, rotary_q_per_token=rotary_q_per_token,
                    tree_mask=tree_mask, **extra)  # fmt: skip
    if key is not None:  # decode() ran: the plan it left for the views serves this layout
        views_key = _call_key(q_, k_cache_, v_cache_, cache_seqlens, block_table, k_new_, v_new_,
                              sm_scale, alibi_slopes, return_lse, out_view, num_splits,
                              rotary_cos, rotary_sin, rotary_interleaved, rotary_q_per_token,
                              _LENGTH_DIM, descales, tree_mask)  # fmt: skip
        _keep_flash_plan(_FLASH_PLANS[flash], key, views_key, length_dim, out_shape)
    return (out, result[1]) if return_lse else out


def _heads_first(flash, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new):
    """q, caches, new keys as decode() takes them: decode_flash's (flash) as [B, H, N, D] views
    once they pass its checks (named in flash-attn's layout), decode_flash_out's as they are."""
    tensors = (q, k_cache, v_cache, k_new, v_new)
    if not flash:
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
        return tensors
    views = None
    if all(t is None or (isinstance(t, torch.Tensor) and t.dim() == 4) for t in tensors):
        views = [None if t is None else t.transpose(1, 2) for t in tensors]
        if KV_LAYOUT == "paged":  # (pages as decode() takes them)
            views[1:3] = k_cache, v_cache
    q_, k_, v_, k_new_, v_new_ = views or tensors
    if views is None or not _inputs_ok(q_, k_, v_, cache_seqlens, block_table, k_new_, v_new_):
        # (it passes only tensors of rank 4: then views is set)
        _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, flash=True)
    capacity = _cache_size(k_cache, block_table, _FLASH_LENGTH_DIM)[0]
    if k_new is not None and k_new.shape[1] > capacity:
        where = " (max_pages * PAGE_SIZE)" if KV_LAYOUT == "paged" else ""
        raise ValueError(f"k_new: {k_new.shape[1]} new keys (dim 1) exceed the cache's "
                         f"capacity {capacity}{where}")  # fmt: skip
    return views
