"""scripts/gpu_attention_check.py's logic on the CPU, tiny: the GPU check of issue 50 runs the same code (its
figures need a GPU: scripts/gpu_check.py --only attention). No timing is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gpu_attention_check import FORMS, markdown  # noqa: E402


def _run_body(compile_backend, models) -> dict:
    import torch
    from gpu_attention_check import model_rows, run

    from mesh3d import DistributedManager

    DistributedManager.initialize()
    try:
        report = run(torch.device("cpu"), small=True, repeats=1, compile_backend=None)
        report["compiled"] = model_rows(torch.device("cpu"), ("fp32",), 1, True, compile_backend, 600.0, models)
        return json.loads(json.dumps(report))  # what the GPU run writes must be JSON
    finally:
        DistributedManager.shutdown()


def test_the_gpu_attention_check_runs_on_the_cpu(ranks):
    """The loopback ring (4 uneven key blocks, one empty) equals SDPA: fp64 to 1e-12 and fp32/bf16/fp16 as close as
    SDPA in that dtype, in every form; the block rows and the eager model rows (ViT, Swin, GPT-2, Llama at D=1 through
    domain.shard) complete with outputs equal to plain; a compiled row completes; the markdown names every row."""
    report = ranks.run(1, _run_body, "aot_eager", ("Llama",), timeout=600)[0]
    rows = report["loopback_ring"]
    assert [(r["dtype"], r["form"]) for r in rows] == [(d, f) for d in ("fp64", "fp32", "bf16", "fp16") for f in FORMS]
    assert all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    assert max(max(r["errors"].values()) for r in rows if r["dtype"] == "fp64") <= 1e-12
    assert report["checks"]["loopback ring == SDPA"].startswith("PASS")
    assert [(r["dtype"], r["L"]) for r in report["block"]] == [("bf16", 64), ("bf16", 128), ("fp32", 64), ("fp32", 128)]
    assert all(r["ms"] > 0 and r["sdpa_ms"] > 0 for r in report["block"])
    eager = report["models_d1"]
    assert [(r["model"], r["dtype"]) for r in eager] == [(m, d) for m in ("ViT", "Swin", "GPT-2", "Llama")
                                                         for d in ("fp32", "bf16")]
    assert all("error" not in r and r["max_rel_diff"] <= 1e-6 for r in eager), eager
    (compiled,) = [r for r in report["compiled"] if r["mode"] == "compiled"]
    assert compiled["mode"] == "compiled" and "error" not in compiled and compiled["max_rel_diff"] <= 1e-6, compiled
    text = markdown(report, "this CPU")
    assert text.count("| ViT |") == 2 and "bf16 L=128" in text and "fp64" in text


def test_the_gpu_check_writes_its_attention_section_between_the_markers(tmp_path):
    from gpu_check import DOCS_BEGIN, DOCS_END, write_docs_section

    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n{DOCS_BEGIN}\nnot yet run\n{DOCS_END}\nafter\n")
    for section in ("first\n", "second\n"):
        write_docs_section(str(doc), section)
        assert doc.read_text() == f"# B\n\nbefore\n{DOCS_BEGIN}\n{section}{DOCS_END}\nafter\n"
    (tmp_path / "plain.md").write_text("no markers\n")
    try:
        write_docs_section(str(tmp_path / "plain.md"), "x")
    except ValueError as err:
        assert "region" in str(err)
    else:
        raise AssertionError("a file without the markers was written")
