"""`metax-operator run` as it is (the real CLI and Runner), with measuring hooks wrapped around it
from outside, for the runner's benchmark at scale (bench_scale.py):

- each pass: its wall time, the CPU of the main thread (the pass's own work), the CPU of the
  whole process meanwhile (the watch threads and the pass's request threads too), its writes,
  whether the rollout decided in it (the engine ran, rather than waiting for a cache) and whether
  every watch cache the runner started had listed by its end;
- each LIST of a watch cache: wall time, CPU of its thread, pages, bytes, objects kept;
- every 10 s: RSS, process CPU, the main thread's CPU, and per watch cache its events, bytes and
  the CPU of its thread (from /proc/self/task/TID/stat).

Each is one JSON line in $SCALE_EVENTS, its `t` the system's monotonic clock (the benchmark's
too). `python -m tests.bench.scale_runner run ARGS...` takes `metax-operator`'s arguments.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from metax_operator import cli
from metax_operator.runtime import informer as informer_module
from metax_operator.runtime import rollout_pass
from metax_operator.runtime import run as run_module

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
MAIN_THREAD = threading.get_native_id()
_out = open(os.environ.get("SCALE_EVENTS", os.devnull), "a", buffering=1)  # open for the process's life
_out_lock = threading.Lock()
_informers: dict[str, tuple[informer_module.Informer, int]] = {}  # name -> (informer, native thread id)
_decided = threading.Event()  # the rollout decided in the pass running


def emit(**fields) -> None:
    fields.setdefault("t", round(time.monotonic(), 3))
    with _out_lock:
        _out.write(json.dumps(fields) + "\n")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def thread_cpu(tid: int) -> float:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # the thread ended
        return -1.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _wrap_pass(run_pass):
    def measured(runner):
        wall, cpu, process = time.monotonic(), time.thread_time(), time.process_time()
        outcome, writes = "ok", None
        _decided.clear()
        try:
            writes = run_pass(runner)
            return writes
        except BaseException as err:
            outcome = type(err).__name__
            raise
        finally:
            emit(
                ev="pass",
                wall=round(time.monotonic() - wall, 4),
                cpu=round(time.thread_time() - cpu, 4),
                cpu_process=round(time.process_time() - process, 4),
                writes=writes,
                outcome=outcome,
                decided=_decided.is_set(),
                synced=runner.watches.started and all(cache.synced for cache in runner.caches()),
            )

    return measured


def _wrap_decide(decide):
    def measured(rollout, *args, **kwargs):
        plan = decide(rollout, *args, **kwargs)
        if isinstance(plan, rollout_pass.Plan):
            _decided.set()
        return plan

    return measured


def _wrap_relist(relist):
    def measured(informer):
        wall, cpu = time.monotonic(), time.thread_time()
        lists, received = informer.stats.list_requests, informer.stats.bytes
        relist(informer)
        emit(
            ev="list",
            name=informer.name,
            start=round(wall, 3),
            wall=round(time.monotonic() - wall, 3),
            cpu=round(time.thread_time() - cpu, 3),
            pages=informer.stats.list_requests - lists,
            bytes=informer.stats.bytes - received,
            kept=len(informer.snapshot()),
            rss=round(rss_mb(), 1),
        )

    return measured


def _wrap_thread(run):
    def registered(informer):
        _informers[informer.name] = (informer, threading.get_native_id())
        return run(informer)

    return registered


def _sample() -> None:
    while True:
        time.sleep(10)
        caches = {
            name: {"events": i.stats.events, "bytes": i.stats.bytes, "cpu": thread_cpu(tid)}
            for name, (i, tid) in list(_informers.items())
        }
        emit(
            ev="sample",
            rss=round(rss_mb(), 1),
            cpu=round(time.process_time(), 3),
            main_cpu=thread_cpu(MAIN_THREAD),
            caches=caches,
        )


def main(argv: list[str]) -> int:
    run_module.Runner.run_pass = _wrap_pass(run_module.Runner.run_pass)
    rollout_pass.RolloutPass.decide = _wrap_decide(rollout_pass.RolloutPass.decide)
    informer_module.Informer._relist = _wrap_relist(informer_module.Informer._relist)
    informer_module.Informer._run = _wrap_thread(informer_module.Informer._run)
    threading.Thread(target=_sample, name="scale-sampler", daemon=True).start()
    emit(ev="start", pid=os.getpid(), rss=round(rss_mb(), 1))
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
