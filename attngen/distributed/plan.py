"""Which generated-kernel calls compute a rank's shard of attention over the whole sequence.

Pure Python over global positions (no torch), so every rank plans every rank's work and all
of them refuse the same call before any communication starts. A query chunk holds global
positions [qs, qe), a key range [ks, ke); key j is visible to query i when j <= i (causal) or
i - left <= j <= i + right (window), and ALiBi's bias is -slope * |i - j|.

A generated kernel sees positions only through its alignment: row i of a call sits at
i' = i + (Nk - Nq) (bottom_right, and every mask-none kernel: flash-attn's ALiBi distance) or
i' = i (top_left), so a call is exact when its keys end where its queries end (bottom_right)
or start where they start (top_left): by a longer key range (the all-gather's keys [0, qe) for
a causal chunk) or by fake query rows (zeros, output dropped) after the chunk (bottom_right)
or before it (top_left), at most as many as it has real ones, else the pair is refused. When
positions do not matter (every key visible to every query, no ALiBi) a mask-none call runs,
and such calls over adjacent rows or keys are fused (docs/context_parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.distributed.layout import Chunk

ALIGNS = ("bottom_right", "top_left")


class PlanError(ValueError):
    """A pair of query and key ranges that the generated kernels cannot express exactly."""


@dataclass(frozen=True)
class MaskRule:
    """The mask of the whole-sequence attention: none | causal | sliding_window."""

    mask: str
    window: tuple[int, int] | None = None  # (left, right) with sliding_window
    alibi: bool = False

    def describe(self) -> str:
        text = self.mask if self.window is None else f"{self.mask}{self.window}"
        return text + (" + ALiBi" if self.alibi else "")


@dataclass(frozen=True)
class KernelCall:
    """One generated-kernel call: query rows [rows) of the local shard against rows [keys) of
    the key tensor in use (the shard received at a ring step, or the gathered sequence)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    mask: str  # the kernel's mask: none | causal | sliding_window
    align: str | None  # None with mask none
    window: tuple[int, int] | None
    pad_front: int = 0  # fake query rows before the real ones (top_left alignment)
    pad_back: int = 0  # fake query rows after them (bottom_right alignment)

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def num_keys(self) -> int:
        return self.keys[1] - self.keys[0]

    def describe(self) -> str:
        mask = self.mask if self.mask == "none" else f"{self.mask}({self.align})"
        fake = self.pad_front or self.pad_back
        pads = f", fake rows {self.pad_front}+{self.pad_back}" if fake else ""
        return f"rows {list(self.rows)} x keys {list(self.keys)} {mask}{pads}"


def visibility(rule: MaskRule, qs: int, qe: int, ks: int, ke: int) -> str:
    """'none', 'all' or 'some': which keys of [ks, ke) the queries [qs, qe) see (non-empty)."""
    if rule.mask == "none":
        return "all"
    left: int | None = None
    right = 0
    if rule.mask == "sliding_window" and rule.window is not None:
        left, right = rule.window
    if ks > qe - 1 + right or (left is not None and ke - 1 < qs - left):
        return "none"
    if ke - 1 <= qs + right and (left is None or ks >= qe - 1 - left):
        return "all"
    return "some"


def key_span(rule: MaskRule, qs: int, qe: int, seq_len: int) -> tuple[int, int]:
    """The smallest key range holding every key the queries [qs, qe) can see."""
    if rule.mask == "none":
        return 0, seq_len
    if rule.mask == "causal":
        return 0, min(qe, seq_len)
    left, right = rule.window or (0, 0)
    start, stop = max(0, qs - left), min(seq_len, qe + right)
    return (start, stop) if start < stop else (0, 0)


def express(
    rule: MaskRule,
    q_pos: tuple[int, int],
    k_pos: tuple[int, int],
    rows: tuple[int, int],
    keys: tuple[int, int],
    aligns: tuple[str, ...],
) -> KernelCall | None:
    """The call that computes queries at global q_pos (shard rows `rows`) against keys at
    global k_pos (rows `keys` of the key tensor), or None when no key is visible. `aligns` are
    the alignments that kernels exist for, preferred first. Raises PlanError with the reason
    when no call with at most as many fake rows as real ones is exact."""
    (qs, qe), (ks, ke) = q_pos, k_pos
    seen = visibility(rule, qs, qe, ks, ke)
    if seen == "none":
        return None
    if seen == "all" and not rule.alibi:
        return KernelCall(rows, keys, "none", None, None)
    masked = rule.mask != "none"
    if (qs, qe) == (ks, ke):  # the same positions: any alignment is exact
        return KernelCall(rows, keys, rule.mask, aligns[0] if masked else None, rule.window)
    options: list[tuple[int, str | None, int, int]] = []  # (fake rows, align, pads)
    if not masked:  # a mask-none kernel places rows bottom-right (ALiBi: |i + Nk - Nq - j|)
        if ke >= qe:
            options.append((ke - qe, None, 0, ke - qe))
    else:
        if "bottom_right" in aligns and ke >= qe:
            options.append((ke - qe, "bottom_right", 0, ke - qe))
        if "top_left" in aligns and ks <= qs:
            options.append((qs - ks, "top_left", qs - ks, 0))
    options = [o for o in options if o[0] <= qe - qs]
    if not options:
        raise PlanError(_refusal(rule, q_pos, k_pos, aligns))
    _, align, front, back = min(options, key=lambda o: o[0])
    return KernelCall(rows, keys, rule.mask, align, rule.window, front, back)


def _refusal(rule: MaskRule, q_pos, k_pos, aligns) -> str:
    (qs, qe), (ks, ke) = q_pos, k_pos
    why = f"the {rule.describe()} mask cuts through the key range"
    why = "ALiBi's bias depends on the offset between them" if rule.alibi else why
    if rule.mask == "none":
        need = f"a mask-none kernel places rows bottom-right, so the keys must end by {qe}"
    else:
        need = (
            f"kernels here align {' or '.join(aligns)}; bottom_right needs the keys to end "
            f"at or after {qe}, top_left to start at or before {qs}"
        )
    return (
        f"queries [{qs}, {qe}) against keys [{ks}, {ke}): {why}, and a generated kernel "
        f"places positions only by its alignment ({need}, with at most {qe - qs} fake "
        "query rows, as many as the chunk has)"
    )


def fuse_unmasked(rule: MaskRule, calls: list[KernelCall]) -> list[KernelCall]:
    """Mask-none calls fused: the same rows over adjacent keys, then the same keys over
    adjacent rows (without positions, one call over the union is the same attention; with
    ALiBi positions always matter, so nothing is fused)."""
    if rule.alibi:
        return calls
    plain = [c for c in calls if c.mask == "none" and not (c.pad_front or c.pad_back)]
    others = [c for c in calls if c not in plain]
    orders = (("keys", lambda c: (c.rows, c.keys)), ("rows", lambda c: (c.keys, c.rows)))
    for along, order in orders:
        fused: list[KernelCall] = []
        for call in sorted(plain, key=order):
            if fused and _adjacent(fused[-1], call, along):
                fused[-1] = _union(fused[-1], call, along)
            else:
                fused.append(call)
        plain = fused
    return others + plain


def _adjacent(a: KernelCall, b: KernelCall, along: str) -> bool:
    if along == "keys":
        return a.rows == b.rows and a.keys[1] == b.keys[0]
    return a.keys == b.keys and a.rows[1] == b.rows[0]


def _union(a: KernelCall, b: KernelCall, along: str) -> KernelCall:
    if along == "keys":
        return KernelCall(a.rows, (a.keys[0], b.keys[1]), "none", None, None)
    return KernelCall((a.rows[0], b.rows[1]), a.keys, "none", None, None)


def ring_step_calls(
    rule: MaskRule,
    queries: tuple[Chunk, ...],
    keys: tuple[Chunk, ...],
    same_rank: bool,
    aligns: tuple[str, ...],
) -> list[KernelCall]:
    """The calls of one ring step: the local query chunks against one rank's key chunks."""
    total_q = sum(c.length for c in queries)
    if same_rank and rule.mask == "causal" and not rule.alibi and total_q:
        # A shard's chunks are in increasing position, so the causal mask over the shard's
        # own rows (j <= i) is the global one: one call covers every pair of its chunks.
        return [KernelCall((0, total_q), (0, total_q), "causal", aligns[0], None)]
    calls = []
    for qc in queries:
        for kc in keys:
            if not (qc.length and kc.length):
                continue
            q_pos, rows = (qc.start, qc.stop), (qc.local, qc.local + qc.length)
            k_pos, k_rows = (kc.start, kc.stop), (kc.local, kc.local + kc.length)
            call = express(rule, q_pos, k_pos, rows, k_rows, aligns)
            if call is not None:
                calls.append(call)
    return fuse_unmasked(rule, calls)


def ring_plan(
    rule: MaskRule, chunks: list[tuple[Chunk, ...]], aligns: tuple[str, ...]
) -> list[list[list[KernelCall]]]:
    """plan[rank][step]: the calls rank `rank` runs at ring step `step`, on the shard of rank
    (rank - step) mod W. Raises PlanError (naming the ranks) for any rank's inexpressible pair."""
    world = len(chunks)
    plan = []
    for rank in range(world):
        steps = []
        for step in range(world):
            source = (rank - step) % world
            try:
                steps.append(
                    ring_step_calls(rule, chunks[rank], chunks[source], rank == source, aligns)
                )
            except PlanError as err:
                where = f"ring step {step}, rank {rank} (keys of rank {source})"
                raise PlanError(f"{where}: {err}") from None
        plan.append(steps)
    return plan


def gather_calls(
    rule: MaskRule, queries: tuple[Chunk, ...], seq_len: int, aligns: tuple[str, ...]
) -> list[KernelCall]:
    """The calls of one rank against the gathered sequence (key rows = global positions): per
    query chunk, one call over every key it can see, or, when that one needs too many fake
    rows, the keys before, level with and after the chunk as up to three calls."""
    calls = []
    for qc in queries:
        if not qc.length:
            continue
        q_pos, rows = (qc.start, qc.stop), (qc.local, qc.local + qc.length)
        span = key_span(rule, qc.start, qc.stop, seq_len)
        if span[0] >= span[1]:
            continue
        try:
            call = express(rule, q_pos, span, rows, span, aligns)
            calls += [call] if call else []
            continue
        except PlanError as whole:
            reason = str(whole)
        parts = [
            (span[0], min(span[1], qc.start)),
            (max(span[0], qc.start), min(span[1], qc.stop)),
            (max(span[0], qc.stop), span[1]),
        ]
        try:
            for part in parts:
                if part[0] < part[1]:
                    call = express(rule, q_pos, part, rows, part, aligns)
                    calls += [call] if call else []
        except PlanError as split:
            raise PlanError(f"{reason}; split at the chunk's ends: {split}") from None
    return fuse_unmasked(rule, calls)


def gather_plan(
    rule: MaskRule, chunks: list[tuple[Chunk, ...]], seq_len: int, aligns: tuple[str, ...]
) -> list[list[KernelCall]]:
    """plan[rank]: the calls rank `rank` runs against the gathered sequence."""
    plan = []
    for rank, queries in enumerate(chunks):
        try:
            plan.append(gather_calls(rule, queries, seq_len, aligns))
        except PlanError as err:
            raise PlanError(f"all-gather, rank {rank}: {err}") from None
    return plan


def rows_covered_once(calls: list[KernelCall], num_rows: int) -> bool:
    """Whether no query row is computed by two calls (then no merge is needed)."""
    covered = [0] * (num_rows + 1)
    for call in calls:
        covered[call.rows[0]] += 1
        covered[call.rows[1]] -= 1
    running = 0
    for delta in covered:
        running += delta
        if running > 1:
            return False
    return True
