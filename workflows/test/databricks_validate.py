"""Validates workflows/databricks_job.json against the Jobs API's own types
in the databricks-sdk package: every job under "jobs" must be a jobs/create
body whose top-level keys `JobsAPI.create` takes, and which survives
`JobSettings.from_dict(job).as_dict()` unchanged. from_dict drops what it
does not know (a misspelt key at any depth, an unknown enum value), so a
difference names the path of the mistake. Then the jobs' own wiring: task
keys and depends_on, for-each inputs and {{input}}, job parameter
references, the run_job_task placeholder, and every run_step.py call parsed
by run_step.py's own argument parser (and by the binary's, when
MSSQL_CDC_BIN or mssql-cdc on PATH is there). Last, a few misspellings are
planted in a copy to show that each is caught.

    python databricks_validate.py [JOB.json]   (run by databricks_test.sh)
"""
from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from databricks.sdk.service import jobs

HERE = Path(__file__).resolve().parent
WORKFLOWS = HERE.parent
sys.path.insert(0, str(WORKFLOWS))
import run_step  # noqa: E402

CREATE_KEYS = set(inspect.signature(jobs.JobsAPI.create).parameters) - {"self"}
BIN = shutil.which(os.environ.get("MSSQL_CDC_BIN", "mssql-cdc"))

passed: list[str] = []
failed: list[str] = []


def check(ok: bool, what: str) -> None:
    (passed if ok else failed).append(what)
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)


def diff(want, got, path: str = "") -> list[str]:
    """Where `got` (the round trip) differs from `want` (the file)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in want:
            if k not in got:
                out.append(f"{path}.{k}: dropped by the SDK (unknown key, or an unknown enum value: {json.dumps(want[k])[:80]})")
            else:
                out += diff(want[k], got[k], f"{path}.{k}")
        out += [f"{path}.{k}: added by the SDK" for k in got if k not in want]
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items, {len(got)} after the round trip"]
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in diff(a, b, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: {json.dumps(want)[:80]} became {json.dumps(got)[:80]}"]


def sdk_problems(job: dict) -> list[str]:
    """What the SDK's types do not keep of one jobs/create body."""
    out = [f".{k}: not a jobs/create field" for k in job if k not in CREATE_KEYS]
    body = {k: v for k, v in job.items() if k != "access_control_list"}
    out += diff(body, jobs.JobSettings.from_dict(body).as_dict())
    return out


def all_tasks(job: dict):
    """Every task of a job, nested for-each tasks included: (task, parent or None)."""
    for t in job.get("tasks", []):
        yield t, None
        if "for_each_task" in t:
            yield t["for_each_task"]["task"], t


def wiring_problems(name: str, job: dict) -> list[str]:
    out = []
    params = {p["name"] for p in job.get("parameters", [])}
    top = [t["task_key"] for t in job.get("tasks", [])]
    if len(top) != len(set(top)):
        out.append(f"{name}: task keys repeat: {top}")
    text = json.dumps(job)
    for ref in re.findall(r"\{\{job\.parameters\.([A-Za-z0-9_]+)\}\}", text):
        if ref not in params:
            out.append(f"{name}: {{{{job.parameters.{ref}}}}} names no job parameter ({sorted(params)})")
    clusters = {c["job_cluster_key"] for c in job.get("job_clusters", [])}
    for t, parent in all_tasks(job):
        for d in t.get("depends_on", []):
            if d["task_key"] not in top:
                out.append(f"{name}.{t['task_key']}: depends on unknown task {d['task_key']}")
        if "job_cluster_key" in t and t["job_cluster_key"] not in clusters:
            out.append(f"{name}.{t['task_key']}: unknown job cluster {t['job_cluster_key']}")
        if "for_each_task" in t:
            fe = t["for_each_task"]
            inputs = fe["inputs"]
            if not (inputs.startswith("{{") or isinstance(json.loads(inputs), list)):
                out.append(f"{name}.{t['task_key']}: for-each inputs is neither a reference nor a JSON array")
            if "{{input}}" not in json.dumps(fe["task"]):
                out.append(f"{name}.{t['task_key']}: the for-each task never uses {{{{input}}}}")
        if parent is None and "{{input}}" in json.dumps({k: v for k, v in t.items() if k != "for_each_task"}):
            out.append(f"{name}.{t['task_key']}: {{{{input}}}} outside a for-each task")
        if "spark_python_task" in t:
            spt = t["spark_python_task"]
            if Path(spt["python_file"]).name != "run_step.py":
                out.append(f"{name}.{t['task_key']}: python_file is not run_step.py")
            out += call_problems(f"{name}.{t['task_key']}", spt.get("parameters", []))
    return out


def call_problems(where: str, params: list[str]) -> list[str]:
    """The task's parameters, parsed by run_step.py, and the step's own
    arguments by the binary (placeholders stand in for values)."""
    filled = [re.sub(r"\{\{[^}]+\}\}", "/tmp/x.toml", p) for p in params]
    try:
        a = run_step.parse_args(filled)
    except SystemExit:
        return [f"{where}: run_step.py refuses its parameters {params}"]
    steps = {"stream", "snapshot", "backfill", "status", "apply", "reconcile", "seed", "maintain"}
    if a.step not in steps:
        return [f"{where}: '{a.step}' is not an mssql-cdc step"]
    if BIN:
        proc = subprocess.run([BIN, a.step, *a.args, "--help"], capture_output=True, text=True)
        if proc.returncode != 0:
            return [f"{where}: mssql-cdc {a.step} refuses {a.args}: {proc.stderr.strip()[:200]}"]
    return []


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else WORKFLOWS / "databricks_job.json"
    doc = json.loads(path.read_text())
    check(isinstance(doc.get("jobs"), dict) and doc["jobs"], f"{path.name}: has a 'jobs' object")
    check(set(doc) <= {"about", "jobs"}, f"{path.name}: top level holds only 'about' and 'jobs' ({sorted(doc)})")
    for name, job in doc["jobs"].items():
        p = sdk_problems(job)
        check(not p, f"{name}: the SDK's JobSettings keeps every key and value" + (f": {p}" if p else ""))
        w = wiring_problems(name, job)
        check(not w, f"{name}: tasks, parameters and run_step.py calls are consistent" + (f": {w}" if w else ""))
    stream = doc["jobs"]["stream"]
    steps = [a for t, _ in all_tasks(stream) if "spark_python_task" in t for a in t["spark_python_task"]["parameters"] if a in {"stream", "backfill", "apply", "reconcile", "snapshot", "maintain"}]
    check(steps == ["stream"], f"stream: the stream job runs the stream step and nothing else ({steps})")
    check("schedule" in stream or "continuous" in stream, "stream: on a schedule (or continuous) of its own")
    everything = [a for job in doc["jobs"].values() for t, _ in all_tasks(job) if "spark_python_task" in t for a in t["spark_python_task"]["parameters"]]
    for step in ("stream", "backfill", "apply", "reconcile", "maintain"):
        check(step in everything, f"some job runs {step}")
    check(all("for_each_task" in t for n in ("stream", "backfill", "silver", "maintain") for t in doc["jobs"][n]["tasks"]), "stream, backfill, silver and maintain go over the tables with a for-each task")
    retries = [t.get("max_retries", 0) for job in doc["jobs"].values() for t, _ in all_tasks(job)]
    check(all(r == 0 for r in retries), "no task is retried by Databricks (run_step.py retries exit 75 itself; 2 and 3 must not be retried)")
    run_jobs = [t["run_job_task"]["job_id"] for t, _ in all_tasks(doc["jobs"]["silver"]) if "run_job_task" in t]
    check(run_jobs == [0], "silver: its run_job_task holds the placeholder job id 0 the description tells to replace")

    # Planted mistakes: each must be caught.
    plants = {
        "a misspelt top-level key": lambda j: j.__setitem__("max_concurent_runs", 1),
        "a misspelt task key": lambda j: j["tasks"][0]["for_each_task"]["task"].__setitem__("spark_python_tsk", {}),
        "an unknown enum value": lambda j: j["schedule"].__setitem__("pause_status", "UNPAUSD"),
        "a misspelt cluster field": lambda j: j["job_clusters"][0]["new_cluster"].__setitem__("num_worker", 1),
        "a runner flag run_step.py lacks": lambda j: j["tasks"][0]["for_each_task"]["task"]["spark_python_task"]["parameters"].insert(0, "--retires"),
    }
    for what, plant in plants.items():
        job = copy.deepcopy(stream)
        plant(job)
        check(bool(sdk_problems(job) or wiring_problems("planted", job)), f"the validator catches {what}")
    if BIN:
        job = copy.deepcopy(stream)
        job["tasks"][0]["for_each_task"]["task"]["spark_python_task"]["parameters"] += ["--max-batchs", "5"]
        check(bool(wiring_problems("planted", job)), "the validator catches a step argument the binary lacks")
    else:
        print("(no mssql-cdc binary: the steps' own arguments were not checked)")

    print(f"\ndatabricks_validate: {len(passed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
