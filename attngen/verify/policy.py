"""What `attngen verify-tiling` (attngen.verify.check) holds each compiled row to.

The policy, per config (the numbers are the constants below):

- shared memory: the model must never be under the compiler (a config it calls feasible must
  fit); over is allowed and counted, exact is the match rate.
- a config the model calls feasible must fit: compiled shared <= the arch's budget, no
  compile error.
- spills: a feasible config predicted at or below the register limit ("safe") must not spill
  more than SAFE_SPILL_BYTES; one predicted in the REGISTER_MARGIN above the limit, or any
  fp32 config ("may spill"), is allowed to spill, which is why the heuristic ranks it last.
- a rejected config is "confirmed" when the compiler agrees (shared over the budget, or
  spills for a register rejection) and "conservative" when it would in fact fit: reported,
  never a failure. The tile rule (a query row per thread at most) is a design rule, not a
  resource limit, so it has nothing to confirm.

Shared memory does not depend on the spec beyond the key (checked on every example spec:
`--every-spec`); registers do, a little, so the spill check holds for the spec each key was
compiled from (its heaviest), and OTHER_SPEC_SPILL_BYTES for every other spec of the key.
Any failure makes the command exit 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attngen.arch import ARCHS
from attngen.tiling.prefill import REGISTER_MARGIN

if TYPE_CHECKING:  # check.py imports this module; its types are only annotations here
    from attngen.verify.check import Others, Plan, Row
    from attngen.verify.measurements import AnyKey, Measurements

# ptxas keeps a few loop-carried values on the stack even well below 255 registers (8-64 B on
# sm80 at 4 warps); that costs an L1 hit per iteration, not a spill worth avoiding.
SAFE_SPILL_BYTES = 64
# The bound for the other specs that share a key (--every-spec). ptxas's allocation moves by up
# to +-75 registers between specs of one config (a sliding window's two compares, a padded
# head dim's masks), which no tile formula sees; over 2891 such compiles the worst safe config
# spilled 112 B (phi3 and mistral near 255 registers; docs/tiling.md). 128 B is 32 fp32
# values that round-trip through L1 once per key block: measurable only on a config the
# heuristic would not pick first, so the promise is this bound, not zero, and it is enforced.
OTHER_SPEC_SPILL_BYTES = 128


def judge(
    plan: Plan,
    data: Measurements,
    changed: dict[AnyKey, list[str]],
    stale_fails: bool = True,
    others: Others | None = None,
) -> None:
    """Fill every row's measurement, failures and notes (the policy in the module docstring).
    A live result that differs from the data's record fails unless the data is being rewritten
    (`stale_fails` false); the other specs' compiles of a key (--every-spec) are held to the
    same spill policy."""
    for key, row in plan.rows.items():
        row.measured = data.get(key)
        row.source = "live" if key in changed else ("data" if row.measured else "none")
        if row.measured is None:
            row.notes.append("not compiled (fp32, predicted far over the register file)")
            continue
        for message in changed.get(key, []):
            stale = message.startswith("data file is stale")
            (row.notes if stale and not stale_fails else row.problems).append(message)
        _judge_one(row, row.measured)
        for ref, record in (others or {}).get(key, []):
            spills = record["spill_stores"] or 0
            message = f"{ref}: {record['regs']} regs, spills {spills} B"
            safe = row.candidate.feasible and not row.may_spill
            if record["error"] or (safe and spills > OTHER_SPEC_SPILL_BYTES):
                row.problems.append(f"{message} {record['error'] or ''}".rstrip())
            else:
                row.notes.append(message)


def _judge_one(row: Row, m: dict[str, Any]) -> None:
    arch, cand = ARCHS[row.key.arch], row.candidate
    if m["error"]:
        (row.problems if cand.feasible else row.notes).append(f"compile error: {m['error']}")
        return
    shared, spills = m["shared"], m["spill_stores"] or 0
    if cand.smem_bytes < shared:
        row.problems.append(f"smem predicted {cand.smem_bytes} < compiled {shared}")
    if cand.feasible:
        if shared > arch.smem_budget:
            row.problems.append(f"feasible but compiled shared {shared} > {arch.smem_budget}")
        if not row.may_spill and spills > SAFE_SPILL_BYTES:
            row.problems.append(
                f"predicted {cand.regs_per_thread} regs (safe) but spills "
                f"{spills} B > {SAFE_SPILL_BYTES}"
            )
        elif row.may_spill:
            row.notes.append(f"may spill: spills {spills} B")
        return
    for reason in cand.rejected:
        kind = reason[:4]  # the tile rule and occupancy have no resource to confirm
        if kind in ("smem", "regs"):
            ok = shared > arch.smem_budget if kind == "smem" else spills > SAFE_SPILL_BYTES
            seen = f"compiled {shared} B" if kind == "smem" else f"spills {spills} B"
            row.notes.append(f"{kind} rejection {'confirmed' if ok else 'conservative'}: {seen}")


def margin_note() -> str:
    return (
        f"safe: predicted <= the register limit, must spill <= {SAFE_SPILL_BYTES} B; "
        f"may spill: predicted within {REGISTER_MARGIN} above it, allowed to spill"
    )
