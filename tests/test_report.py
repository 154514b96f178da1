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


def test_bench_shows_each_part_against_its_floor_where_the_card_was_measured():
    """On the GPU (a GEMM and a copy rate measured), bench.md gets a table of each part's floor (FLOPs at the
    GEMM rate or weights at the copy rate, whichever is longer) and the share reached; without them, none."""
    from types import SimpleNamespace

    from sam3_aoti.stages.bench import bench_report

    def part(ms, flop, weights, floor=None):
        result = {"median_ms": ms, "p90_ms": ms, "flop": flop, "weight_bytes": weights, "tflop_per_s": 1.0}
        if floor:
            result.update(share_of_gemm_rate=0.1, floor_ms=floor[0], floor_of=floor[1], share_of_floor=floor[2])
        return result

    def info(floors: bool):
        parts = {"text encoder": part(1.07, 19.45e9, 604e6, floors and (0.151, "weights", 0.141)),
                 "ViT": part(15.3, 5613e9, 900e6, floors and (7.12, "FLOPs", 0.47))}
        row = {"batch": 1, "prompts": 1, "flop": 6e12,
               "backends": {"AOTI": {"median_ms": 18.4, "p90_ms": 18.5, "images_per_s": 54.3, "peak_mib": 63}},
               "sections": {"how": "compiled", "sections": parts, "flop": 6.2e12, "transforms": {"median_ms": 0.1},
                               "sum_ms": 16.37, "package_ms": 18.4, "between_ms": 2.03}}
        return {"rows": [row], "load_seconds": {}, "fallback_load_seconds": 1.0, "aoti_kernels_at_2x3": None,
                "bf16_gemm_tflops": 788.6 if floors else None, "copy_gbps": 4000.0 if floors else None,
                "date": "2026-12-03", "weights": "random", "iters": 20, "warmup": 3, "package_bytes": 1,
                "fallback_bytes": 1, "gpu": "NVIDIA H200" if floors else None}

    settings = SimpleNamespace(profile="sam3", precision="bf16", spec=SimpleNamespace(reference="bf16"))
    titles = {t.heading: t for t in bench_report(settings, info(True)).tables}
    floor = next(t for title, t in titles.items() if title.startswith("The same sections against their floor"))
    assert floor.columns == ["B", "P", "text encoder", "ViT"]
    assert floor.rows == [[1, 1, "0.151 (weights), 14%", "7.12 (FLOPs), 47%"]]
    rate = next(t for title, t in titles.items() if title.startswith("The same sections' GFLOP, the weights"))
    assert rate.rows[0][2] == "19.45 GFLOP, 604 MB, 1.0 (10%)" and rate.rows[0][-2:] == ["6200", "6000"]
    cpu = [t.heading for t in bench_report(settings, info(False)).tables]
    assert not any(title.startswith("The same sections against their floor") for title in cpu)
