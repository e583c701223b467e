"""The post-renderer against `kubectl kustomize` applying the same strategic-merge patches.

Inputs: (a) the chart's output with the seed's podTemplateSpec example (global node-type=general,
maca node-type=gpu), the real chart when it renders at the repo root, else the fixture chart;
(b) 5,000 documents: copies of (a) with every object renamed. The kustomize side gets one
strategic-merge patch per component (targeted by the component annotation) carrying the merged
nodeSelector/affinity/tolerations, so both produce the same DaemonSets (checked). Prints median
wall time, peak RSS of the child and the ratios, and what the post-renderer adds to
`helm template` under Helm 3 and Helm 4.
"""

import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import yaml

from metax_operator.chart.merge import MANAGED_FIELDS, inputs_from_annotations, merge_scheduling
from metax_operator.contract import COMPONENT_ANNOTATION, DAEMONSETS, SCHEDULING_INPUTS_ANNOTATION
from tests.chart.test_postrender import CHART_REQUIRED, EXECUTABLE, FIXTURE_CHART, HELM3, HELM4, REPO, SEED_VALUES, helm_env

KUBECTL = HELM3.parent / "kubectl"
DOCUMENTS = 5000
RUNS = {"chart": 7, "5000 documents": 3}
# kustomize needs many minutes for 5,000 documents (20 on a loaded 2-CPU machine), so it runs
# once there and is stopped after this many seconds: the ratio is then a lower bound.
KUSTOMIZE_RUNS = {"chart": 7, "5000 documents": 1}
KUSTOMIZE_LIMIT = int(os.environ.get("METAX_BENCH_KUSTOMIZE_LIMIT", "300"))

# Runs one command and prints its wall time, CPU time (with its children's), peak RSS (KiB) and
# exit status, killing it after a time limit. A separate small process forks it, because a
# child's peak RSS counts what it shared with its parent before exec, and this benchmark holds
# 5,000 documents in memory.
_MEASURE = """
import os, signal, sys, time
limit, stdin, stdout, *command = sys.argv[1:]
started = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.dup2(os.open(stdin, os.O_RDONLY), 0)
    os.dup2(os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.execv(command[0], command)
signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
signal.alarm(int(limit))
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - started, usage.ru_utime + usage.ru_stime, usage.ru_maxrss,
      os.waitstatus_to_exitcode(status))
"""


class Sample(NamedTuple):
    wall: float  # seconds, median of the runs
    cpu: float  # seconds of CPU (user + system), median of the runs
    rss: float  # MiB, the highest of the runs
    stopped: bool  # killed at the time limit (wall and cpu are then lower bounds)


def measure(command: list, stdin: Path, stdout: Path, runs: int, limit: int = 3600, env: dict | None = None) -> Sample:
    """`runs` runs of `command`, each measured from its own rusage."""
    samples = []
    for _ in range(runs):
        result = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(limit), stdin, stdout, *map(str, command)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        wall, cpu, rss, status = result.stdout.split()
        if status not in ("0", "-9"):
            raise SystemExit(f"{command[0]} failed: {result.stderr}")
        samples.append((float(wall), float(cpu), int(rss) / 1024, status == "-9"))
    return Sample(
        statistics.median(s[0] for s in samples),
        statistics.median(s[1] for s in samples),
        max(s[2] for s in samples),
        any(s[3] for s in samples),
    )


def chart_output(work: Path) -> tuple[str, Path, dict]:
    """The rendered chart (without post-renderer), which chart it is, and the values used."""
    values = work / "values.yaml"
    for name, chart, extra in (("chart", REPO, CHART_REQUIRED), ("fixture chart", FIXTURE_CHART, {})):
        values.write_text(yaml.safe_dump({**SEED_VALUES, **extra}))
        result = subprocess.run([HELM3, "template", "release", chart, "-f", values], capture_output=True, text=True)
        if result.returncode == 0 and SCHEDULING_INPUTS_ANNOTATION in result.stdout:
            return result.stdout, chart, {"name": name, "values": values}
    raise SystemExit("neither the chart nor the fixture chart renders")


def many_documents(text: str, count: int) -> str:
    """`count` documents: copies of those in `text`, each copy's objects renamed `<name>-<copy>`."""
    documents = [d for d in re.split(r"(?m)^---\n", text) if d.strip()]
    out = []
    while len(out) < count:
        copy = len(out) // len(documents)
        for document in documents[: count - len(out)]:
            out.append(
                re.sub(r"(?m)^(  name: )(\S+)", lambda m, copy=copy: f"{m.group(1)}{m.group(2)}-{copy}", document, count=1)
            )
    return "---\n" + "---\n".join(out)


def kustomization(directory: Path, manifest: Path) -> None:
    """A kustomization applying, per component, the merged scheduling fields as a strategic-merge patch."""
    patches = []
    for document in yaml.load_all(manifest.read_text(), Loader=yaml.CSafeLoader):
        if not document or document.get("kind") != "DaemonSet":
            continue
        annotations = document["metadata"].get("annotations") or {}
        key = annotations.get(COMPONENT_ANNOTATION)
        if key is None or key in {p["key"] for p in patches}:
            continue
        result, _ = merge_scheduling(inputs_from_annotations(annotations))
        patch = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": DAEMONSETS[key]},
            "spec": {"template": {"spec": result}},
        }
        (directory / f"patch-{key}.yaml").write_text(yaml.safe_dump(patch))
        patches.append(
            {
                "key": key,
                "path": f"patch-{key}.yaml",
                "target": {"kind": "DaemonSet", "annotationSelector": f"{COMPONENT_ANNOTATION}={key}"},
            }
        )
    (directory / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [manifest.name], "patches": [{"path": p["path"], "target": p["target"]} for p in patches]})
    )


def scheduling_of_daemonsets(path: Path) -> dict:
    return {
        d["metadata"]["name"]: {k: d["spec"]["template"]["spec"].get(k) for k in MANAGED_FIELDS}
        for d in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader)
        if d and d.get("kind") == "DaemonSet"
    }


def compare(label: str, manifest: Path, work: Path) -> None:
    kustomize_dir = work / f"kustomize-{label.replace(' ', '-')}"
    kustomize_dir.mkdir()
    (kustomize_dir / manifest.name).write_text(manifest.read_text())
    kustomization(kustomize_dir, kustomize_dir / manifest.name)
    ours_out, theirs_out = work / "ours.yaml", work / "theirs.yaml"
    ours = measure([EXECUTABLE], manifest, ours_out, RUNS[label])
    theirs = measure([KUBECTL, "kustomize", kustomize_dir], manifest, theirs_out, KUSTOMIZE_RUNS[label], limit=KUSTOMIZE_LIMIT)
    bound = ">" if theirs.stopped else ""
    same = (
        "not checked (kustomize stopped)"
        if theirs.stopped
        else scheduling_of_daemonsets(ours_out) == scheduling_of_daemonsets(theirs_out)
    )
    documents = manifest.read_text().count("\nkind: ")
    print(
        f"{label} ({documents} documents):\n"
        f"  post-renderer  wall {ours.wall:8.3f} s  cpu {ours.cpu:8.3f} s  peak {ours.rss:6.1f} MiB"
        f"  (median of {RUNS[label]})\n"
        f"  kustomize      wall {bound}{theirs.wall:7.3f} s  cpu {bound}{theirs.cpu:7.3f} s  peak {theirs.rss:6.1f} MiB"
        f"  (median of {KUSTOMIZE_RUNS[label]}{', stopped at the limit' if theirs.stopped else ''})\n"
        f"  ratio          {bound}{theirs.wall / ours.wall:.1f}x faster (wall), {bound}{theirs.cpu / ours.cpu:.1f}x"
        f" less CPU, {theirs.rss / ours.rss:.1f}x less memory; same DaemonSets: {same}",
        flush=True,
    )
    if same is False:
        raise SystemExit(f"{label}: the post-renderer and kustomize disagree on the DaemonSets")


def added_to_helm_template(chart: Path, values: Path, work: Path, runs: int = 7) -> None:
    env = helm_env(work / "helm-home")
    subprocess.run([HELM4, "plugin", "install", REPO / "postrender"], env=env, check=True, capture_output=True)
    for helm, post_renderer in ((HELM3, str(EXECUTABLE)), (HELM4, "metax-postrender")):
        base = [helm, "template", "release", chart, "-f", values]
        without = measure(base, Path(os.devnull), work / "out.yaml", runs, env=env)
        with_it = measure(base + ["--post-renderer", post_renderer], Path(os.devnull), work / "out.yaml", runs, env=env)
        print(
            f"helm template, {helm.name}: wall {without.wall:.3f} s without, {with_it.wall:.3f} s with the"
            f" post-renderer ({with_it.wall - without.wall:+.3f} s); cpu {without.cpu:.3f} s without,"
            f" {with_it.cpu:.3f} s with ({with_it.cpu - without.cpu:+.3f} s); median of {runs}",
            flush=True,
        )


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-postrender-") as tmp:
        work = Path(tmp)
        rendered, chart, used = chart_output(work)
        print(f"input (a): the {used['name']} ({chart}) with the seed's podTemplateSpec example", flush=True)
        small, large = work / "chart.yaml", work / "many.yaml"
        small.write_text(rendered)
        large.write_text(many_documents(rendered, DOCUMENTS))
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
        compare("chart", small, work)
        compare("5000 documents", large, work)
        added_to_helm_template(chart, used["values"], work)


if __name__ == "__main__":
    main()
