"""One check-and-report engine for verify, parity and bench: gates from a table turn measured values into
✓/✗ rows, and one writer turns a report into report.json, report.md and (where asked) an HTML page.

A stage builds a `Report` (a verdict over its checks, or none for a benchmark; tables; pictures; the JSON
body) and calls `write_report`; nothing else in the package formats a table."""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..runtime.files import write_text_atomic


def shown(value, limit: str, ok: bool) -> str:
    """3 significant digits, or as many more as a failed value needs to differ from its limit in print
    (0.9897 against >= 0.99 read "0.99")."""
    if not isinstance(value, float):
        return str(value)
    for digits in range(3, 10):
        text = f"{value:.{digits}g}"
        if ok or float(text) != float(limit.split()[-1]):
            break
    return text


@dataclass
class Check:
    backend: str  # aoti | exported | "vs Meta"
    case: str  # "sweep B=2 P=3" or the case name
    metric: str
    value: float | str
    limit: str
    ok: bool

    def line(self) -> str:
        value = shown(self.value, self.limit, self.ok)
        return f"{'✓' if self.ok else '✗'} {self.backend:8} {self.case:22} {self.metric:28} {value:>12}  {self.limit}"

    def cells(self) -> list[str]:
        return ["✓" if self.ok else "✗", self.backend, self.case, self.metric, shown(self.value, self.limit, self.ok),
                self.limit]


CHECK_COLUMNS = ["", "backend", "case", "metric", "value", "limit"]


@dataclass(frozen=True)
class Gate:
    """One row of a gate table: the metric `key` of a measured dict against `limit` (`op` "<=" or ">=")."""
    label: str
    key: str
    op: str

    def check(self, value, limit: float, backend: str, case: str) -> Check:
        value = float(value)
        ok = value <= limit if self.op == "<=" else value >= limit
        return Check(backend, case, self.label, value, f"{self.op} {limit}", ok)


def apply_gates(measured: dict, gates: list[tuple[Gate, float]], backend: str, case: str) -> list[Check]:
    return [gate.check(measured[gate.key], limit, backend, case) for gate, limit in gates]


def margin(r: Check) -> float:
    """How far a value is inside its limit, relative to the limit (negative: outside)."""
    if not isinstance(r.value, float):
        return 0.0 if r.ok else -1.0
    limit = float(r.limit.split()[-1])
    inside = limit - r.value if r.limit.startswith("<=") else r.value - limit
    return inside / max(abs(limit), 1e-12)


def summarize(rows: list[Check]) -> list[str]:
    """One line per (backend, metric): the case closest to (or furthest beyond) its limit."""
    groups: dict[tuple, list[Check]] = {}
    for r in rows:
        groups.setdefault((r.backend, r.metric), []).append(r)
    lines = []
    for (backend, metric), group in groups.items():
        failed = [r for r in group if not r.ok]
        worst = min(group, key=margin)
        value = shown(worst.value, worst.limit, worst.ok)
        lines.append(f"{'✗' if failed else '✓'} {backend:8} {metric:30} {value:>10} {worst.limit:10}"
                     f" {len(group) - len(failed)}/{len(group)} ok, worst: {worst.case}")
    return lines


@dataclass
class Table:
    heading: str
    columns: list[str]
    rows: list[list]


@dataclass
class Report:
    title: str
    notes: list[str] = field(default_factory=list)  # paragraphs under the verdict
    checks: list[Check] | None = None  # None: a benchmark, no verdict
    tables: list[Table] = field(default_factory=list)  # after the checks' own table
    figures: list[tuple[str, str]] = field(default_factory=list)  # (image path relative to the page, caption)
    data: dict = field(default_factory=dict)  # the JSON body beside passed/checks/failed/rows

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks or [] if not c.ok]

    @property
    def verdict(self) -> str | None:
        if self.checks is None:
            return None
        return f"{'FAILED' if self.failed else 'PASSED'}: {len(self.checks) - len(self.failed)}/{len(self.checks)} checks"

    def all_tables(self) -> list[Table]:
        own = [Table("Checks", CHECK_COLUMNS, [c.cells() for c in self.checks])] if self.checks else []
        return own + self.tables

    def json(self) -> dict:
        if self.checks is None:
            return self.data
        return {"passed": not self.failed, "checks": len(self.checks), "failed": len(self.failed), **self.data,
                "rows": [asdict(c) for c in self.checks]}


def _md_cell(value) -> str:
    return str(value).replace("|", "\\|")  # a bare | would split the markdown cell


def markdown(report: Report) -> str:
    lines = [f"# {report.title}", ""]
    if report.verdict:
        lines += [f"**{report.verdict}**", ""]
    for note in report.notes:
        lines += [note, ""]
    for table in report.all_tables():
        lines += [f"## {table.heading}", "", "| " + " | ".join(table.columns) + " |",
                  "|" + "---|" * len(table.columns)]
        lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in table.rows]
        lines.append("")
    lines += [f"![{caption}]({src})" for src, caption in report.figures]
    return "\n".join(lines).rstrip() + "\n"


def html_page(report: Report) -> str:
    """One page: the verdict, the notes, every picture, then the tables (failed checks highlighted)."""
    esc = lambda v: html.escape(str(v))
    body = [f"<h1>{esc(report.title)}</h1>"]
    if report.verdict:
        body.append(f"<p><b>{esc(report.verdict)}</b></p>")
    body += [f"<p>{esc(note)}</p>" for note in report.notes]
    body += [f"<figure><img src='{esc(src)}'><figcaption>{esc(caption)}</figcaption></figure>"
             for src, caption in report.figures]
    for table in report.all_tables():
        head = "".join(f"<th>{esc(c)}</th>" for c in table.columns)
        rows = "".join(f"<tr class={'bad' if row and row[0] == '✗' else 'ok'}>"
                       + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>" for row in table.rows)
        body.append(f"<h2>{esc(table.heading)}</h2><table><tr>{head}</tr>{rows}</table>")
    return f"""<!doctype html><meta charset=utf-8><title>{esc(report.title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td{{padding:2px 8px;border-bottom:1px solid #ddd}}
tr.bad{{background:#fdd}} img{{max-width:100%}} figure{{margin:1em 0}}</style>
{''.join(body)}
"""


def write_report(report: Report, json_path: Path, md_path: Path, html_path: Path | None = None) -> None:
    """Each file written whole or not at all (a temp file renamed)."""
    write_text_atomic(json_path, json.dumps(report.json(), indent=2) + "\n")
    write_text_atomic(md_path, markdown(report))
    if html_path is not None:
        write_text_atomic(html_path, html_page(report))


def dash(value):
    """A table cell for a value that may be missing."""
    return "-" if value is None else value
