"""The decode program's row tile and its score, which decode.py (the decode tiles and the
split rule, whose docstring derives them) and decode_latent.py (the absorbed latent decode)
both judge a config by."""

from __future__ import annotations

MAX_ROW_TILE = 64  # larger query groups are split into row blocks (registers: acc is rows x DV)
# Bytes of outstanding loads per SM that saturate HBM (module docstring; measured on the H200,
# docs/results/exp_decode_2026-11-30.json).
IN_FLIGHT_TARGET = 64 * 1024
UNPIPELINED_SHARE = 0.25  # S = 1: the tile pairs in flight, as a share of one
SPLIT_WAVES = 2  # the split rule's programs per SM (decode.py), the most the score counts


def row_tile(num_q_heads: int, num_kv_heads: int, query_tokens: int) -> int:
    """The packed query tile: q_per_kv * Nq rows, a power of two in 16..MAX_ROW_TILE."""
    rows = (num_q_heads // num_kv_heads) * query_tokens
    return min(MAX_ROW_TILE, max(16, 1 << (rows - 1).bit_length()))


def decode_score(per_sm: int, block_n: int, d: int, dv: int, e: int, stages: int) -> float:
    in_flight = (
        min(per_sm, SPLIT_WAVES) * block_n * (d + dv) * e * (stages - 1 or UNPIPELINED_SHARE)
    )
    return min(1.0, in_flight / IN_FLIGHT_TARGET)
