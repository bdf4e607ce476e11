#!/usr/bin/env python
"""Time every example once, as its docstring runs it, and write each figure everywhere the docs state it.

One run of every example, one after another: the commands its docstring shows first, every phase of them (the demo's
three as ``scripts/demo.sh`` runs them, with this script's Python), each example's outputs in a folder of its own
under ``--work``. It writes ``docs/example_times.json``::

    {"machine": "AMD EPYC, 2 cores", "torch": "2.13.0+cpu", "date": "2026-12-02", "load_at_start": 0.4,
     "examples": {"demo_3d.py": 54.2, ...}}

and then rewrites, from that file only, every place that states an example's time (whole seconds, ``54 s``):

* README.md, section "Examples": the lines between ``<!-- example-times: begin -->`` and ``<!-- example-times: end -->``
  (the sentence saying how the times were measured, and the table's last column, by the example in its first);
* any Markdown file of README.md and docs/: a figure followed by ``<!-- time: weather.py -->`` (that example's time);
* an example's docstring: a figure followed by `` (docs/example_times.json)`` (that example's own time).

Usage::

    .venv/bin/python scripts/time_examples.py                 # all of them (minutes), then the json and the docs
    .venv/bin/python scripts/time_examples.py --only mesh_table.py --only pinn_heat.py   # print those: nothing written
    .venv/bin/python scripts/time_examples.py --docs          # only rewrite the stated times from the json
    .venv/bin/python scripts/time_examples.py --check         # exit 1 where a stated time differs from the json

Every example checks itself and exits non-zero when it differs from one process; a failing example fails the run and
nothing is written. Each command's stdout and stderr stay in ``--work``/logs (logs-2 ... on later runs); beside each
time it prints how many lines the example wrote to stderr, and how many of them name a warning (torchrun's notice
that it set OMP_NUM_THREADS, for the commands that start it without one, and Lightning's own lines are expected).
Run it on an otherwise idle machine: the load average at the start is recorded, and two cores shared with other work
make every figure longer.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "docs" / "example_times.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- example-times: begin -->", "<!-- example-times: end -->"
#: A stated time in Markdown: ``54 s<!-- time: demo_3d.py -->``; in an example's docstring: ``54 s (docs/example_times.json)``.
MARKDOWN_TIME = re.compile(r"\d+(?:\.\d+)? s<!-- time: ([\w.]+) -->")
DOCSTRING_TIME = re.compile(r"\d+(?:\.\d+)? s \(docs/example_times\.json\)")
ROW = re.compile(r"^\| `([\w.]+)`.*\|\s*([^|]*?)\s*\|\s*$")


def figure(seconds: float) -> str:
    """How every document states a time: whole seconds."""
    return f"{round(seconds)} s"


# ---------------------------------------------------------------------------------------------- the runs
def commands(work: Path) -> dict[str, list[tuple[list[str], dict[str, str]]]]:
    """Each example's run: (argv, extra environment) per command, in order; outputs under ``work``/<example>."""
    py = sys.executable
    cli = Path(py).with_name("mesh3d")
    mesh3d = [str(cli)] if cli.exists() else [py, "-m", "mesh3d.cli"]

    def torchrun(n: int, *args: str) -> list[str]:
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]

    def out(name: str) -> str:
        return str(work / name)

    demo = {"OMP_NUM_THREADS": "1"}  # as scripts/demo.sh runs it
    llama = "examples/llama_decoder.py"
    return {
        "demo_3d.py": [(torchrun(8, "examples/demo_3d.py", "train", "--batch", "2", "--domain", "2", "--model", "2",
                                 "--out", out("demo")), demo),
                       (torchrun(4, "examples/demo_3d.py", "resume", "--batch", "1", "--domain", "2", "--model", "2",
                                 "--out", out("demo")), demo),
                       ([py, "examples/demo_3d.py", "export", "--out", out("demo")], demo)],
        "train_transformer.py": [(torchrun(8, "examples/train_transformer.py", "--batch", "4", "--model", "2", "--steps",
                                           "5"), {})],
        "lightning_3d.py": [([py, "examples/lightning_3d.py", phase, "--devices", "4", "--mesh", mesh, "--ckpt",
                              out("lightning/epoch1.ckpt")], {}) for phase, mesh in (("fit", "1,2,2"), ("resume", "2,1,2"))],
        "weather.py": [([py, "examples/weather.py", "--out", out("weather")], {})],
        "graph_weather.py": [([py, "examples/graph_weather.py", "--out", out("graph_weather")], {})],
        "meshgraphnet.py": [([py, "examples/meshgraphnet.py"], {})],
        "domain_parallel_cnn.py": [(torchrun(4, "examples/domain_parallel_cnn.py"), {})],
        "volume_unet3d.py": [(torchrun(4, "examples/volume_unet3d.py"), {})],
        "pinn_heat.py": [(torchrun(4, "examples/pinn_heat.py"), {})],
        "checkpoint_reshard.py": [(torchrun(8, "examples/checkpoint_reshard.py", "save", out("ck"), "--mesh", "2,2,2"), {}),
                                  (torchrun(4, "examples/checkpoint_reshard.py", "resume", out("ck"), "--mesh", "2,1,2"), {}),
                                  ([py, "examples/checkpoint_reshard.py", "check", out("ck")], {})],
        "data_resume.py": [(torchrun(4, "examples/data_resume.py", "train", "--root", out("slabs"), "--mesh", "2,2,1",
                                     "--steps", "3"), {}),
                           (torchrun(3, "examples/data_resume.py", "resume", "--root", out("slabs"), "--mesh", "1,3,1",
                                     "--steps", "4"), {})],
        "slurm_job.py": [([py, "examples/slurm_job.py", "--simulate", "4", "--steps", "6", "--preempt-at", "4", "--root",
                           out("slurm_job/ckpt")], {}),
                         ([py, "examples/slurm_job.py", "--simulate", "4", "--steps", "6", "--root", out("slurm_job/ckpt")],
                          {})],
        "mesh_table.py": [(torchrun(8, "examples/mesh_table.py", "--batch", "2", "--domain", "2", "--model", "-1"), {})],
        "llama_decoder.py": [([*mesh3d, "plan", f"{llama}:llama_8b", "--world", "4096", "--batch", "32", "--domain", "16",
                               "--model", "8", "--input", "1x131072", "--dtype", "int64", "--shard-dims", "1", "--plan",
                               f"{llama}:PLAN_BF16", "--device-memory", "80GiB"], {}),
                             ([*mesh3d, "check", f"{llama}:tiny", "--input", "2x24", "--dtype", "int64", "--shard-dims",
                               "1", "--plan", f"{llama}:PLAN"], {})],
    }


def run_example(name: str, steps: list[tuple[list[str], dict[str, str]]], logs: Path,
                timeout: float) -> tuple[float, int, int, int]:
    """Run one example's commands in order from the checkout; (wall seconds, exit status, stderr lines, warnings)."""
    warning = re.compile(r"\b\w*Warning\b|^\[rank\d+\]:W\d")
    start, lines, warnings = time.perf_counter(), 0, 0
    for k, (argv, extra) in enumerate(steps):
        log = logs / f"{name}.{k}"
        with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
            try:
                code = subprocess.run(argv, cwd=ROOT, env={**os.environ, **extra}, stdout=out, stderr=err,
                                      timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = 124
        err = [line for line in open(f"{log}.err") if line.strip()]
        lines, warnings = lines + len(err), warnings + sum(1 for line in err if warning.search(line))
        if code:
            return time.perf_counter() - start, code, lines, warnings
    return time.perf_counter() - start, 0, lines, warnings


def machine() -> str:
    """The CPU's model name and the number of cores this process may use."""
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        model = platform.processor() or platform.machine()
    return f"{model}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


# ---------------------------------------------------------------------------------------------- the documents
def documents() -> list[Path]:
    """Where times may be stated: README.md, the Markdown under docs/, the examples' sources."""
    return [README, *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]


def measurement(data: dict) -> str:
    """The README's sentence saying how its times were measured."""
    line = (f"Times: wall clock of the commands each docstring shows first, every phase of them (the demo: "
            f"`scripts/demo.sh`), in one run of all of them ({data['machine']}, torch {data['torch']}, load average "
            f"{data['load_at_start']} when the runs began, {data['date']}), written by `scripts/time_examples.py` into "
            f"[docs/example_times.json](docs/example_times.json).")
    return f"{line} {data['note']}" if data.get("note") else line


def rewrite(text: str, path: Path, data: dict) -> str:
    """``text`` of ``path`` with every stated time (and the README's block) written from ``data``."""
    times = data["examples"]

    def known(name: str) -> float:
        if name not in times:
            raise SystemExit(f"{path.relative_to(ROOT)} states the time of {name}, which {JSON.name} does not have")
        return times[name]

    if path.suffix == ".py":
        return DOCSTRING_TIME.sub(lambda m: f"{figure(known(path.name))} (docs/example_times.json)", text)
    text = MARKDOWN_TIME.sub(lambda m: f"{figure(known(m.group(1)))}<!-- time: {m.group(1)} -->", text)
    if BEGIN not in text:
        return text
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    lines = block.strip("\n").split("\n")
    out = [measurement(data)]
    for line in lines[1:]:
        row = ROW.match(line)
        if row:
            line = line[:row.start(2)] + figure(known(row.group(1))) + line[row.end(2):]
        out.append(line)
    return head + BEGIN + "\n" + "\n".join(out) + "\n" + END + tail


def stated(data: dict) -> list[tuple[str, str, str, str]]:
    """Every stated time: (file, example, the figure stated, the figure the json gives)."""
    found = []
    for path in documents():
        text, rel = path.read_text(), str(path.relative_to(ROOT))
        if path.suffix == ".py":
            found += [(rel, path.name, m.group(0).split(" (")[0], "") for m in DOCSTRING_TIME.finditer(text)]
            continue
        found += [(rel, m.group(1), m.group(0).split("<!--")[0], "") for m in MARKDOWN_TIME.finditer(text)]
        if BEGIN in text:
            block = text.split(BEGIN, 1)[1].split(END, 1)[0]
            found += [(rel, r.group(1), r.group(2), "") for r in map(ROW.match, block.split("\n")) if r]
    times = data["examples"]
    return [(f, name, said, figure(times[name]) if name in times else "(not in the json)") for f, name, said, _ in found]


def problems(data: dict) -> list[str]:
    """What disagrees with ``data``: a stated time, the README's measurement sentence, an example left out."""
    bad = [f"{f}: {name} is said to take {said}, the json says {want}" for f, name, said, want in stated(data) if said != want]
    text = README.read_text()
    if BEGIN not in text:
        bad.append(f"README.md has no {BEGIN} block")
    elif text.split(BEGIN, 1)[1].lstrip("\n").split("\n", 1)[0] != measurement(data):
        bad.append("README.md: the sentence on how the times were measured differs from the json's (run --docs)")
    in_table = {name for f, name, _, _ in stated(data) if f == "README.md"}
    for path in sorted((ROOT / "examples").glob("*.py")):
        if not path.name.startswith("_") and (path.name not in data["examples"] or path.name not in in_table):
            bad.append(f"{path.name}: not in {JSON.name} and the README's table of examples")
    return bad


def write_docs(data: dict) -> list[str]:
    """Rewrite every stated time from ``data``; the files changed."""
    changed = []
    for path in documents():
        text = path.read_text()
        new = rewrite(text, path, data)
        if new != text:
            path.write_text(new)
            changed.append(str(path.relative_to(ROOT)))
    return changed


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], metavar="EXAMPLE",
                        help="time only this example (repeatable); prints the times and writes nothing")
    parser.add_argument("--work", type=Path, default=None, help="the examples' outputs and logs (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one command may take")
    parser.add_argument("--docs", action="store_true", help="only rewrite the stated times from docs/example_times.json")
    parser.add_argument("--check", action="store_true", help="only check the stated times against docs/example_times.json")
    args = parser.parse_args()
    if args.docs or args.check:
        data = json.loads(JSON.read_text())
        if args.docs:
            print("rewritten:", ", ".join(write_docs(data)) or "nothing (every stated time agrees)")
        bad = problems(data)
        print("\n".join(bad) if bad else f"every stated time agrees with {JSON.relative_to(ROOT)}")
        return 1 if bad else 0

    work = args.work or Path(tempfile.mkdtemp(prefix="mesh3d-examples-"))
    logs = next(p for k in range(1, 1000) if not (p := work / ("logs" if k == 1 else f"logs-{k}")).exists())
    logs.mkdir(parents=True)
    every = commands(work)
    unknown = [name for name in args.only if name not in every]
    if unknown:
        parser.error(f"no example {', '.join(unknown)}; the examples: {', '.join(every)}")
    chosen = args.only or list(every)
    data = {"machine": machine(), "torch": importlib.metadata.version("torch"),
            "date": datetime.date.today().isoformat(), "load_at_start": round(os.getloadavg()[0], 2), "examples": {}}
    print(f"{data['machine']}, torch {data['torch']}, load average {data['load_at_start']}; outputs and logs in {work}",
          flush=True)
    failed = []
    for name in chosen:
        seconds, code, lines, warnings = run_example(name, every[name], logs, args.timeout)
        data["examples"][name] = round(seconds, 1)
        status = "ok" if code == 0 else f"FAILED (exit {code}; logs: {logs}/{name}.*)"
        print(f"  {name:24s} {seconds:7.1f} s  {status}; stderr: {lines} lines, {warnings} naming a warning", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"{len(failed)} failed ({', '.join(failed)}): nothing written")
        return 1
    if args.only:
        print(f"--only: {JSON.relative_to(ROOT)} and the docs are left as they are")
        return 0
    JSON.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {JSON.relative_to(ROOT)}; rewritten: {', '.join(write_docs(data)) or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
