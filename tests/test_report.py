"""The one report engine: gate rows, and the md/json/html writer every stage's report goes through."""

import json

from sam3_aoti.pipeline.report import Check, Gate, Report, Table, apply_gates, markdown, summarize, write_report


def test_gates_turn_values_into_rows_and_the_writer_keeps_every_row(tmp_path):
    gates = [(Gate("a |diff|", "a", "<="), 1e-3), (Gate("overlap", "b", ">="), 0.8)]
    rows = apply_gates({"a": 2e-3, "b": 0.9}, gates, "aoti", "case 1") + apply_gates({"a": 1e-4, "b": 1.0}, gates, "aoti", "case 2")
    assert [(r.case, r.metric) for r in rows if not r.ok] == [("case 1", "a |diff|")]
    assert summarize(rows)[0].startswith("✗ aoti") and "1/2 ok, worst: case 1" in summarize(rows)[0]
    report = Report("Verify: x", ["a note"], rows, [Table("More", ["k", "v"], [["x|y", 1]])], [("p.png", "a picture")],
                    data={"backends": {"model": "aoti"}})
    write_report(report, tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.html")
    body = json.loads((tmp_path / "r.json").read_text())
    assert body["passed"] is False and body["checks"] == 4 and body["failed"] == 1 and body["backends"]["model"] == "aoti"
    assert len(body["rows"]) == 4 and body["rows"][0]["limit"] == "<= 0.001"
    md = (tmp_path / "r.md").read_text()
    assert "**FAILED: 3/4 checks**" in md and "| ✗ | aoti | case 1 | a \\|diff\\| | 0.002 | <= 0.001 |" in md
    assert "| x\\|y | 1 |" in md and "![a picture](p.png)" in md
    html = (tmp_path / "r.html").read_text()
    assert html.count("<tr class=bad>") == 1 and "<img src='p.png'>" in html


def test_a_benchmark_report_has_no_verdict():
    report = Report("Bench", tables=[Table("Latency", ["B", "ms"], [[1, 2.5]])], data={"rows": []})
    assert report.verdict is None and report.json() == {"rows": []}
    assert "PASSED" not in markdown(report) and "| 1 | 2.5 |" in markdown(report)
    assert Check("aoti", "c", "m", "match", "as expected", True).cells()[4] == "match"
