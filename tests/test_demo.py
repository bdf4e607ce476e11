"""The README's first command: scripts/demo.sh end to end (train on 8 ranks, resume on 4, export).

One subprocess test (three launches; then the resume once more, on pooled ranks). The demo checks itself and exits
non-zero if any check fails; this test also reads its figures: every printed parallel loss beside the one-process loss (fp32,
rtol 1e-4: they differ only in summation order), and the exported file, and that its processes exit cleanly (no
"terminate called" at exit; tests/test_clean_exit.py says why). The resume phase then runs a second time from the
same checkpoint, on pooled ranks (tests/example_ranks.py), replacing what the first resume and the export wrote and
saying so: that reuses the demo's 8-rank training instead of training again for that check.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from example_ranks import run_example
from launch_helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_resumes_and_exports_like_one_process(ranks, tmp_path):
    env = clean_env(OUT=str(tmp_path / "demo"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    pairs = [(float(a), float(b)) for a, b in re.findall(r"loss ([\d.]+)\s+one-process ([\d.]+)", done.stdout)]
    assert len(pairs) == 7, done.stdout  # 4 steps on (2,2,2), 3 after resuming on (1,2,2)
    for got, want in pairs:
        assert abs(got - want) <= 1e-4 * want, pairs
    assert done.stdout.count("[ok]") == 6 and "FAIL" not in done.stdout
    assert (tmp_path / "demo" / "hf" / "model.safetensors").stat().st_size > 0
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    out = tmp_path / "demo"
    # NOTE: the rerun's phase runs on pooled ranks (tests/example_ranks.py): what it asserts is the example's, and the
    # clean exit of real processes is the first run's (4 more processes importing torch cost about 15 s here).
    again = run_example(ranks, 4, "examples/demo_3d.py", "resume", "--batch", "1", "--domain", "2", "--model", "2",
                        "--out", str(out))
    assert again.count("one-process") == 3, again
    # Checkpoints are never overwritten: the rerun removes what the resume and export phases wrote, and says so.
    assert f"starting afresh in {out}: removed ckpt-final, one_process.safetensors, resume.json, hf" in again
    assert (out / "ckpt-train").is_dir() and (out / "ckpt-final").is_dir() and not (out / "hf").exists()
