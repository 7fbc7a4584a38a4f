"""The verification report in words, tables and JSON (attngen.verify.check computes it)."""

from __future__ import annotations

import json
import math
from typing import Any

from attngen.arch import ARCHS
from attngen.verify.check import Report, Row, Summary, summarize
from attngen.verify.policy import margin_note

SUMMARY_HEADER = (
    f"{'arch':<6} {'configs':>7} {'compiled':>8} {'smem exact':>10} {'over':>5} "
    f"{'under':>5} {'feasible':>8} {'safe ok':>9} {'may spill':>9} "
    f"{'rejected ok':>11} {'mma path':>9} {'regs rms':>8} {'FAIL':>5}"
)


def _summary_row(name: str, s: Summary) -> str:
    rms = "-" if math.isnan(s.regs_rms) else f"{s.regs_rms:.1f}"
    return (
        f"{name:<6} {s.rows:>7} {s.compiled:>8} {s.exact:>10} {s.over:>5} {s.under:>5} "
        f"{s.feasible:>8} {f'{s.safe_ok}/{s.safe}':>9} "
        f"{f'{s.may_spill_spilled}/{s.may_spill}':>9} "
        f"{f'{s.rejected_confirmed}/{s.rejected_checked}':>11} "
        f"{f'{s.mma_agree}/{s.compiled}':>9} {rms:>8} {s.failures:>5}"
    )


def _row_line(row: Row) -> str:
    cand, m = row.candidate, row.measured or {}
    verdict = "FAIL: " + "; ".join(row.problems) if row.problems else "; ".join(row.notes)
    return (
        f"{row.key.label():<40} {cand.smem_bytes:>7} {m.get('shared') or '-':>7} "
        f"{row.smem_class:<5} {cand.regs_per_thread:>4} {m.get('regs') or '-':>4} "
        f"{m.get('spill_stores') or 0:>6} {'feasible' if cand.feasible else 'rejected':<8} "
        f"{row.source:<4} {verdict}"
    )


ROW_HEADER = (
    f"{'arch dtype dims config':<40} {'model':>7} {'shared':>7} {'smem':<5} "
    f"{'regs':>4} {'ptx':>4} {'spills':>6} {'model':<8} {'from':<4} verdict"
)


def report_lines(report: Report, all_rows: bool = False) -> list[str]:
    rows = list(report.plan.rows.values())
    total = summarize(rows)
    key_fields = ", ".join(type(rows[0].key)._fields) if rows else "no rows"
    lines = [
        f"verify-tiling: {len(rows)} distinct configs ({key_fields}) from the specs' "
        f"candidates; {report.live} compiled live, the rest from the data (triton "
        f"{report.data_triton})"
    ]
    if report.data_template and report.data_template != report.template_hash:
        lines.append(
            f"note: the data was compiled from template {report.data_template}, the "
            f"templates are now {report.template_hash}; `--sample N` or "
            "`--recompile` checks whether that matters"
        )
    if all_rows:
        lines += ["", ROW_HEADER, *(_row_line(r) for r in rows)]
    lines += ["", *chosen_lines(report)]
    lines += ["", SUMMARY_HEADER]
    lines += [_summary_row(arch, s) for arch, s in report.by_arch().items()]
    lines.append(_summary_row("all", total))
    rates = rate_lines(total, report)
    if report.skipped:
        skipped = f"not compiled: {len(report.skipped)} fp32 configs predicted far over the"
        skipped += " register file (ptxas takes minutes each; the model rejects them)"
        rates.insert(-1, skipped)
    lines += ["", *legend_lines(), "", *rates]
    failed = report.failed
    if failed:
        lines += ["", f"FAILED: {len(failed)} config(s)", ROW_HEADER, *map(_row_line, failed)]
    return lines


def chosen_lines(report: Report) -> list[str]:
    """The heuristic's choice for each spec and arch, against the compiler."""
    lines = [
        "chosen configs (the heuristic's; a tuned config is one of the candidates above):",
        f"{'spec':<18} {'arch':<6} {'BMxBN w s':<12} {'model':>7} {'shared':>7} "
        f"{'budget':>7} {'regs':>4} {'ptx':>4} {'spills':>6}  verdict",
    ]
    for spec, arch, key in report.plan.chosen:
        if key is None:
            lines.append(f"{spec:<18} {arch:<6} {'-':<12} nothing fits (see attngen explain)")
            continue
        row = report.plan.rows[key]
        m, cand = row.measured or {}, row.candidate
        config = f"{key.BLOCK_M}x{key.BLOCK_N} {key.num_warps} {key.num_stages}"
        verdict = "ok" if m else "not compiled"
        verdict = "FAIL: " + "; ".join(row.problems) if row.problems else verdict
        lines.append(
            f"{spec:<18} {arch:<6} {config:<12} {cand.smem_bytes:>7} "
            f"{m.get('shared') or '-':>7} {ARCHS[arch].smem_budget:>7} "
            f"{cand.regs_per_thread:>4} {m.get('regs') or '-':>4} "
            f"{m.get('spill_stores') or 0:>6}  {verdict}"
        )
    return lines


def legend_lines() -> list[str]:
    return [
        "smem exact/over/under: predicted shared memory equal to / above / below the "
        "compiler's (under fails)",
        f"safe ok: feasible configs with no more than the allowed spills ({margin_note()})",
        "may spill: those of them that did spill / all; rejected ok: rejections the compiler "
        "confirms (shared over the budget, or spills) / rejections with a resource reason",
        "mma path: configs whose PTX uses the instruction family the model's branch assumes "
        "(wgmma, mma.sync, fma); regs rms: register model error on configs that do not spill",
    ]


def rate_lines(total: Summary, report: Report) -> list[str]:
    rate = f"{100 * total.exact_rate:.1f}%" if total.compiled else "-"
    return [
        f"shared memory: exact on {total.exact} of {total.compiled} ({rate}), over on "
        f"{total.over}, under on {total.under} (never under: "
        f"{'yes' if not total.under else 'NO'})",
        f"feasible configs that fit and spill as allowed: {total.safe_ok} of {total.safe} "
        f"safe, {total.may_spill} may-spill ({total.may_spill_spilled} of them spilled)",
        f"rejected configs the compiler confirms: {total.rejected_confirmed} of "
        f"{total.rejected_checked} with a resource reason ({total.rejected} rejected in all)",
        *live_lines(report),
        f"result: {'FAIL' if report.failed else 'PASS'} in {report.seconds:.1f} s",
    ]


def live_lines(report: Report) -> list[str]:
    """What this run compiled itself, apart from the data: the rejected ones above all."""
    live = [r for r in report.plan.rows.values() if r.source == "live"]
    if not live:
        return []
    s = summarize(live)
    return [
        f"compiled live now: {len(live)} configs, {s.exact} with exactly the predicted "
        f"shared memory; {s.rejected} the model rejects, of which the compiler confirms "
        f"{s.rejected_confirmed} of {s.rejected_checked} with a resource reason"
    ]


def report_json(report: Report) -> dict[str, Any]:
    def row(r: Row) -> dict[str, Any]:
        return {
            **r.key._asdict(),
            "specs": r.specs,
            "model_smem": r.candidate.smem_bytes,
            "model_regs": r.candidate.regs_per_thread,
            "feasible": r.candidate.feasible,
            "may_spill": r.may_spill,
            "rejected": list(r.candidate.rejected),
            "source": r.source,
            "measured": r.measured,
            "problems": r.problems,
            "notes": r.notes,
        }

    def number(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 4)  # NaN (nothing compiled) is not JSON

    summaries = {
        arch: {k: v for k, v in vars(s).items() if k != "regs_err"}
        | {"exact_rate": number(s.exact_rate), "regs_rms": number(s.regs_rms)}
        for arch, s in report.by_arch().items()
    }
    return {
        "triton": report.data_triton,
        "template_hash": report.template_hash,
        "budgets": {a: ARCHS[a].smem_budget for a in summaries},
        "passed": not report.failed,
        "seconds": round(report.seconds, 1),
        "summary": summaries,
        "rows": [row(r) for r in report.plan.rows.values()],
    }


def dump_json(report: Report) -> str:
    return json.dumps(report_json(report), indent=1) + "\n"
