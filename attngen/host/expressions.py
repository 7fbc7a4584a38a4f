"""The `tensors=` check of modules whose spec declares tensors for score_mod / mask_mod: the
caller's mapping against the declarations, and the kernel arguments it gives; the prefill
launcher's `block_mask=` check (block sparsity) and its kernel arguments.

Copied verbatim into the prefill, varlen and decode modules of specs with score_mod or mask_mod,
after checks.py (attngen/host/__init__.py); the declarations come from the module (_TENSORS).
"""

import torch

from attngen.host.launch import _checked  # defined above this part in a generated module

# -- host code: attngen/host/expressions.py, copied verbatim -----------------------------------
_EXPRESSION_DTYPES = {"int32": torch.int32, "int64": torch.int64, "float32": torch.float32}
_EXPRESSION_DTYPES |= {"bf16": torch.bfloat16, "fp16": torch.float16, "bool": torch.bool}


def _expression_tensors(tensors, declared, device):
    """(tensors in declaration order, ints): each declared tensor of `tensors` checked against
    its declaration (name, dtype, shape: ints and dim names) and `device`, and as ints each
    one's strides, then each named dim's size in order of first appearance. A named dim takes
    the size of the tensors it appears in, which must agree."""
    names = [name for name, _, _ in declared]
    if tensors is None and not names:
        return (), ()
    allowed = f"a mapping of exactly {names} to tensors (the spec declares them)"
    if not names:
        allowed = "None (the spec declares no tensors)"
    if not hasattr(tensors, "keys") or not hasattr(tensors, "__getitem__"):
        raise ValueError(f"tensors: got {type(tensors).__name__}; allowed: {allowed}")
    if set(tensors.keys()) != set(names):
        raise ValueError(
            f"tensors: got the names {sorted(map(str, tensors.keys()))}; allowed: {allowed}"
        )
    dims: dict[str, tuple[int, str]] = {}
    found, strides = [], []
    for name, dtype, shape in declared:
        t = tensors[name]
        _check_declared(name, t, _EXPRESSION_DTYPES[dtype], shape, device)
        for axis, (want, size) in enumerate(zip(shape, t.shape, strict=True)):
            if isinstance(want, int) and size != want:
                raise ValueError(
                    f"tensors[{name!r}]: size {size} on axis {axis}; allowed: {want} (declared "
                    f"shape {list(shape)})"
                )
            seen = dims.setdefault(str(want), (size, name)) if isinstance(want, str) else None
            if seen is not None and seen[0] != size:
                raise ValueError(
                    f"tensors[{name!r}]: dim {want} is {size} on axis {axis}; allowed: "
                    f"{seen[0]}, its size in tensors[{seen[1]!r}]"
                )
        found.append(t)
        strides.extend(t.stride())
    return tuple(found), (*strides, *(size for size, _ in dims.values()))


def _check_declared(name, t, dtype, shape, device):
    """One tensor's type, dtype, rank and device against its declaration."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"tensors[{name!r}]: got {type(t).__name__}; allowed: a torch.Tensor")
    if t.dtype != dtype:
        raise ValueError(f"tensors[{name!r}]: dtype {t.dtype}; allowed: {dtype} (declared)")
    if t.dim() != len(shape):
        raise ValueError(
            f"tensors[{name!r}]: rank {t.dim()} (shape {tuple(t.shape)}); allowed: rank "
            f"{len(shape)}, shape {list(shape)} (declared)"
        )
    if t.device != device:
        raise ValueError(f"tensors[{name!r}]: device {t.device}; allowed: {device} (q's)")


# -- block_mask= (prefill): torch's BlockMask fields as a tuple ------------------------------
_BLOCK_MASK = (
    "None or a tuple (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, "
    "q_block, kv_block)"
)
_NO_BLOCK_MASK = (0,) * 14 + (1, 1, 0)  # the kernel's block-mask ints when it has none


def _block_mask_args(block_mask, q, sizes, varlen=False):
    """(tensors, ints) of the kernel's block sparsity over `sizes` (B, HQ, Nq, Nk; varlen:
    the sequences, HQ, max_seqlen_q, max_seqlen_k): the four lists (absent full lists: the
    partial ones, with max count 0), then their strides (0 on a broadcast axis), q_block,
    kv_block, whether there are full lists (varlen: and the lists' length). None: q four
    times and _NO_BLOCK_MASK. The caller checked the block sizes (_check_block_sizes)."""
    if block_mask is None:
        return (q, q, q, q), _NO_BLOCK_MASK + (0,) * varlen
    num, indices, full_num, full_indices, q_block, kv_block = block_mask
    batch, heads, seqlen_q, seqlen_k = sizes
    rows, cols = -(-seqlen_q // q_block), -(-seqlen_k // kv_block)
    lists = [("kv_num_blocks", num, 3), ("kv_indices", indices, 4)]
    if (full_num is None) != (full_indices is None):
        raise ValueError(
            "block_mask: full_kv_num_blocks and full_kv_indices: got one None; allowed: both "
            "tensors or both None"
        )
    if full_num is not None:
        lists += [("full_kv_num_blocks", full_num, 3), ("full_kv_indices", full_indices, 4)]
    for name, t, rank in lists:
        _check_block_list(name, t, (batch, heads, rows, cols)[:rank], q.device, _AXES[varlen])
    if _checked():
        _validate_block_mask([t for _, t, _ in lists], cols)
    tensors = [t for _, t, _ in lists] * (2 if full_num is None else 1)
    ints = (*_list_strides(tensors), q_block, kv_block, int(full_num is not None))
    return tuple(tensors), ints + (cols,) * (varlen is True)


def _decode_block_state(block_mask, q, capacity, block_n):
    """decode's block_mask: (state, ints). state: int8 [B or 1, HQ or 1, ceil(NQ / q_block),
    ceil(capacity / kv_block)] on the device, no sync: 0 unlisted, 1 partial, 2 full (read as
    the kernels read lists: _block_bitmap); ints: its strides (0 broadcast), q_block, kv_block."""
    if block_mask is None:
        return q, (0, 0, 0, 1, 1)
    q_block, kv_block = _block_sizes(block_mask)  # any q_block: each row finds its own
    tile = [("the decode split kernel's", {"BLOCK_M": 1, "BLOCK_N": block_n})]
    if (problem := _block_size_problem(q_block, kv_block, tile)) is not None:
        raise ValueError(f"block_mask: {problem}")
    lists, _ = _block_mask_args(block_mask, q, (*q.shape[:3], capacity), "decode")
    state = _block_bitmap(*lists[:2]).to(torch.int8)
    if block_mask[2] is not None:  # a block in both lists is full (lists must be unique)
        state = torch.where(_block_bitmap(*lists[2:]), 2, state).to(torch.int8)
    return state, (*_list_strides([state])[:3], q_block, kv_block)


def _block_sizes(block_mask):
    """(q_block, kv_block) of a block_mask 6-tuple; a ValueError for anything else."""
    if not isinstance(block_mask, tuple | list) or len(block_mask) != 6:
        raise ValueError(f"block_mask: got {type(block_mask).__name__}; allowed: {_BLOCK_MASK}")
    return block_mask[4], block_mask[5]


def _block_size_problem(q_block, kv_block, configs):
    """The one rule for a block mask's block sizes against the tiles of the launches that
    visit its lists: None where q_block and kv_block are positive multiples of the BLOCK_M and
    BLOCK_N of every (label, config) of `configs` (a q-block holds whole query tiles, a key
    block whole key tiles); else why not, naming the size, the tile and the config."""
    for label, config in configs:
        for name, size, tile in (
            ("q_block", q_block, "BLOCK_M"),
            ("kv_block", kv_block, "BLOCK_N"),
        ):
            if type(size) is not int or size <= 0 or size % config[tile]:
                return (
                    f"{name} {size!r}; allowed: a positive multiple of this module's {tile} "
                    f"{config[tile]} ({label})"
                )
    return None


_AXES: dict[object, tuple[str, ...]] = {False: ("B", "Nq", "Nk"), "decode": ("B", "NQ", "capacity")}
_AXES[True] = ("sequences", "max_seqlen_q", "max_seqlen_k")  # the extents a list's shape names


def _check_block_list(name, t, shape, device, axes):
    """One list of a block mask: an int32/int64 tensor of `shape` (axes 0 and 1 may be 1, a
    broadcast batch or head) on `device`; `axes` name the batch, query and key extents."""
    allowed = f"({shape[0]} or 1, {shape[1]} or 1, {', '.join(map(str, shape[2:]))})"
    b, m, n = axes
    where = f"{b}, HQ, ceil({m} / q_block)" + (f", ceil({n} / kv_block)" if len(shape) == 4 else "")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"block_mask: {name}: got {type(t).__name__}; allowed: a torch.Tensor")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_mask: {name}: dtype {t.dtype}; allowed: torch.int32, torch.int64")
    if t.dim() != len(shape) or any(
        n != want and (axis > 1 or n != 1)
        for axis, (n, want) in enumerate(zip(t.shape, shape, strict=True))
    ):
        raise ValueError(
            f"block_mask: {name}: shape {tuple(t.shape)}; allowed: {allowed} ({where})"
        )
    if t.device != device:
        raise ValueError(f"block_mask: {name}: device {t.device}; allowed: {device} (q's)")


def _validate_block_mask(lists, cols):
    """ATTNGEN_CHECKS=1: every count in [0, cols], every listed index in [0, cols), and no
    block listed twice in a row (in one list or in both: the bitmaps count fewer blocks than
    the lists). A device sync; raises ValueError."""
    names = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"]
    listed = torch.zeros((), dtype=torch.long, device=lists[0].device)
    bits: list[torch.Tensor] = []
    for at in range(0, len(lists), 2):
        counts, indices = lists[at].long(), lists[at + 1].long()
        used = torch.arange(cols, device=counts.device) < counts[..., None]
        for name, t, found, allowed in (
            (names[at], counts, (counts < 0) | (counts > cols), cols),
            (names[at + 1], indices, used & ((indices < 0) | (indices >= cols)), cols - 1),
        ):
            if found.any():
                where = found.nonzero()[0].tolist()
                raise ValueError(
                    f"block_mask: {name}{where} is {int(t[tuple(where)])}; allowed: 0 to "
                    f"{allowed} (ATTNGEN_CHECKS=1)"
                )
        listed, bits = listed + counts, [*bits, _block_bitmap(counts, indices)]
    repeated = listed != (bits[0] | bits[-1]).sum(-1)
    if repeated.any():
        raise ValueError(
            f"block_mask: the row {repeated.nonzero()[0].tolist()} (b, h, q-block) lists a key "
            "block twice (in one list or in both); allowed: distinct blocks (ATTNGEN_CHECKS=1)"
        )


# -- block_mask= in the backward: the dK/dV kernel's lists ----------------------------------
_NO_TRANSPOSED = (0,) * 14 + (1, 1, 1, 0)  # the dK/dV kernel's block-mask ints when it has none


_TRANSPOSED: dict = {}  # "last": (block mask, key, lists): a model's layers share one mask


def _transposed_block_mask(block_mask, q, k):
    """(tensors, ints) of the dK/dV kernel's block sparsity: per (batch, KV head, key block)
    and list, the count and the ascending entries g * ceil(Nq / q_block) + m (query head g of
    the group, q-block m) whose lists name the block (torch's q_num_blocks, q_indices), int32
    on the device, no sync; then strides, q_block, kv_block, the lists' q-blocks, full lists
    or not. Checked lists read as the kernels read them (_block_bitmap); q may be packed.
    The last block mask's are kept: the same tensors, unchanged (their version counters)."""
    if block_mask is None:
        return (q, q, q, q), _NO_TRANSPOSED
    tracked = [t for t in block_mask[:4] if t is not None and not t.is_inference()]
    key = (q.shape[1], k.shape[1], *block_mask[4:], *(t._version for t in tracked))
    last = _TRANSPOSED.get("last", ((), None, None))
    if last[1] == key and all(a is b for a, b in zip(last[0], block_mask[:4], strict=True)):
        return last[2]
    found = _transposed_lists(block_mask, q, k)
    if len(tracked) == sum(t is not None for t in block_mask[:4]):  # versions say all
        _TRANSPOSED["last"] = (block_mask[:4], key, found)
    return found


def _transposed_lists(block_mask, q, k):
    """_transposed_block_mask's lists, computed."""
    num, indices, full_num, full_indices, q_block, kv_block = block_mask
    heads, group, rows = q.shape[1], q.shape[1] // k.shape[1], indices.shape[2]
    tensors = []
    for counts, listed in [(num, indices)] + [(full_num, full_indices)] * (full_num is not None):
        bits = _block_bitmap(counts, listed)  # [B or 1, HQ or 1, rows, cols]
        batch, kv_heads, cols = bits.shape[0], heads // group, bits.shape[3]
        bits = bits.expand(batch, heads, rows, cols).view(batch, kv_heads, group, rows, cols)
        bits = bits.permute(0, 1, 4, 2, 3).reshape(batch, kv_heads, cols, group * rows)
        order = bits.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
        tensors += [bits.sum(-1, dtype=torch.int32), order.to(torch.int32)]
    tensors *= 2 if full_num is None else 1
    ints = (q_block, kv_block, rows, int(full_num is not None))
    return tuple(tensors), (*_list_strides(tensors), *ints)


def _list_strides(tensors):
    """Each list's strides, 0 on an axis of size 1 (a broadcast batch or head)."""
    return [0 if n == 1 else st for t in tensors for n, st in zip(t.shape, t.stride(), strict=True)]


def _block_bitmap(counts, indices):
    """[B, H, rows, cols] bool (B, H as broadcast): the blocks a list names, its count clamped
    to [0, cols], an index outside [0, cols) naming none."""
    cols = indices.shape[-1]  # broadcast_tensors: broadcast_shapes imports sympy (300 ms)
    indices = torch.broadcast_tensors(indices.long(), counts[..., None])[0]
    shape = indices.shape
    slots = torch.arange(cols, device=indices.device)
    used = (slots < counts.long().clamp(0, cols)[..., None]) & (indices >= 0) & (indices < cols)
    bits = torch.zeros((*shape[:-1], cols + 1), dtype=torch.bool, device=indices.device)
    return bits.scatter_(-1, torch.where(used, indices, cols), True)[..., :cols]
