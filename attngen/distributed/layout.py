"""How a sequence is split across ranks: chunks, their global positions, shard and unshard.

A sequence of N tokens is cut into P chunks by `torch.tensor_split`'s rule (the first N mod P
chunks hold one token more), so uneven lengths need no padding and every rank can work out
every other rank's chunks from N alone:

    contiguous  P = W chunks; rank r holds chunk r.
    zigzag      P = 2W chunks; rank r holds chunks r and 2W - 1 - r, in that order, so under a
                causal mask every rank has the same amount of work (an early and a late chunk).

A rank's shard is its chunks concatenated along the sequence axis, in increasing position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive tokens: global positions [start, start + length), stored at rows
    [local, local + length) of its rank's shard."""

    start: int
    length: int
    local: int

    @property
    def stop(self) -> int:
        return self.start + self.length

    def describe(self) -> str:
        return f"[{self.start}, {self.stop})"


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}; allowed: {', '.join(map(repr, LAYOUTS))}")
    return str(layout)


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: got {value!r}; allowed: an int >= {minimum}")
    return value


def chunk_lengths(seq_len: int, parts: int) -> list[int]:
    """torch.tensor_split's sizes: `parts` lengths summing to seq_len, the first ones longer."""
    base, extra = divmod(seq_len, parts)
    return [base + (i < extra) for i in range(parts)]


def rank_chunks(seq_len: int, world_size: int, layout: str) -> list[tuple[Chunk, ...]]:
    """For each rank, its chunks in shard order (increasing global position)."""
    _check_count("seq_len", seq_len, 0)
    _check_count("world_size", world_size, 1)
    parts = world_size if check_layout(layout) == "contiguous" else 2 * world_size
    lengths = chunk_lengths(seq_len, parts)
    starts = [sum(lengths[:i]) for i in range(parts)]
    owned = [[r] if layout == "contiguous" else [r, parts - 1 - r] for r in range(world_size)]
    result = []
    for indices in owned:
        chunks, local = [], 0
        for i in indices:
            chunks.append(Chunk(starts[i], lengths[i], local))
            local += lengths[i]
        result.append(tuple(chunks))
    return result


def shard_length(seq_len: int, world_size: int, rank: int, layout: str) -> int:
    """The number of tokens rank `rank` holds."""
    return sum(c.length for c in rank_chunks(seq_len, world_size, layout)[rank])


def shard_sequence(
    x: torch.Tensor, world_size: int, rank: int, *, layout: str = "zigzag", dim: int = 2
) -> torch.Tensor:
    """Rank `rank`'s shard of the full tensor `x` (sequence along `dim`): a view for contiguous,
    a new tensor for zigzag (two chunks concatenated)."""
    _check_count("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank!r}; allowed: an int in [0, {world_size})")
    chunks = rank_chunks(x.shape[dim], world_size, layout)[rank]
    pieces = [x.narrow(dim, c.start, c.length) for c in chunks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(
    shards: list[torch.Tensor], *, layout: str = "zigzag", dim: int = 2
) -> torch.Tensor:
    """The full tensor from every rank's shard (shards[r] is rank r's), in one process."""
    if not shards:
        raise ValueError("shards: got an empty list; allowed: one tensor per rank")
    seq_len = sum(s.shape[dim] for s in shards)
    per_rank = rank_chunks(seq_len, len(shards), layout)
    for rank, (shard, chunks) in enumerate(zip(shards, per_rank, strict=True)):
        expected = sum(c.length for c in chunks)
        if shard.shape[dim] != expected:
            raise ValueError(
                f"shards[{rank}]: got {shard.shape[dim]} tokens along dim {dim}; layout "
                f"{layout!r} over {len(shards)} ranks of a {seq_len}-token sequence gives rank "
                f"{rank} {expected} (shard with shard_sequence)"
            )
    pieces = sorted(
        (
            (c.start, shard.narrow(dim, c.local, c.length))
            for shard, chunks in zip(shards, per_rank, strict=True)
            for c in chunks
        ),
        key=lambda item: item[0],
    )
    return torch.cat([piece for _, piece in pieces], dim=dim)


def gather_sequence(
    x: torch.Tensor,
    *,
    seq_len: int | None = None,
    layout: str = "zigzag",
    group: dist.ProcessGroup | None = None,
    dim: int = 2,
) -> torch.Tensor:
    """Every rank's shard gathered into the full tensor, on every rank (a collective).

    seq_len is the full length (default: world size x this rank's shard length, right when
    every shard has the same length)."""
    world_size = dist.get_world_size(group)
    if seq_len is None:
        seq_len = world_size * x.shape[dim]
    lengths = [shard_length(seq_len, world_size, r, layout) for r in range(world_size)]
    rank = dist.get_rank(group)
    if x.shape[dim] != lengths[rank]:
        raise ValueError(
            f"x: got {x.shape[dim]} tokens along dim {dim}; rank {rank} holds "
            f"{lengths[rank]} of {seq_len} with layout {layout!r}"
        )
    padded = _pad_along(x, dim, max(lengths)).contiguous()
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)
    return unshard_sequence(
        [g.narrow(dim, 0, n) for g, n in zip(gathered, lengths, strict=True)],
        layout=layout,
        dim=dim,
    )


def _pad_along(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """x extended with zeros along `dim` to `length` (x itself when already that long)."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)
