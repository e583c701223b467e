"""What one runner pass over an unchanged cluster costs the API server: requests and bytes.

The chart installed (Helm 3, no hooks) on the real control plane with 10 kwok GPU nodes and the
CR bootstrapped, as the runner e2e tests do; every request counted at the client (a wrapper of
the kubernetes `ApiClient.request` every call ends in, with the bytes of each answer) as the
chart's runner ServiceAccount. Printed side by side:
- before: the reads a pass made live until the CR, DaemonSets, ConfigMaps and Service came from
  watch caches (`reconcile.observe` over the live client, then the rollout's GET of the CR and of
  the driver DaemonSet);
- after: `STEADY_PASSES` passes of the runner once it converged (reconcile and rollout step),
  with the CPU time of one pass; then what its watch caches cost per minute with no pass at all
  (bookmarks, a watch reopened), which does not grow with the number of passes.
`python -m tests.bench steady_pass`.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from metax_operator import contract
from metax_operator.contract import DRIVER_DAEMONSET
from metax_operator.runtime import reconcile
from metax_operator.runtime.kube import Client
from metax_operator.runtime.run import Runner
from tests.controlplane import ControlPlane
from tests.e2e.tools import bootstrap, install_chart, release_values, service_account_kubeconfig

NS = "bench-steady"
RELEASE = "metax"
STEADY_PASSES = 20
IDLE = 90.0  # seconds


class Traffic:
    """Requests sent and answer bytes received through one kubernetes `ApiClient` (the bytes of
    streamed answers, the watches', are counted by the informers themselves)."""

    def __init__(self, api_client):
        self.requests, self.bytes = 0, 0
        send = api_client.request

        def counted(method, url, *args, **kwargs):
            self.requests += 1
            answer = send(method, url, *args, **kwargs)
            if kwargs.get("_preload_content", True):
                self.bytes += len(answer.data or b"")
            return answer

        api_client.request = counted

    def since(self, mark: tuple[int, int]) -> tuple[int, int]:
        return self.requests - mark[0], self.bytes - mark[1]

    def mark(self) -> tuple[int, int]:
        return self.requests, self.bytes


def cache_bytes(runner: Runner) -> int:
    return sum(informer.stats.bytes for informer in runner.caches())


@contextlib.contextmanager
def installed_chart(prefix: str) -> Iterator[tuple[ControlPlane, object, Path, Path]]:
    """A control plane with 10 kwok GPU nodes, the chart installed in `NS` (Helm 3, no hooks) and
    the CR bootstrapped: yields (cp, admin api, tmp, the runner ServiceAccount's kubeconfig)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        cp = ControlPlane.start(Path(tmp) / "cp", gpu_nodes=10, plain_nodes=0)
        try:
            admin = cp.api()
            install_chart(
                cp, admin, Path(tmp), RELEASE, NS, {"registry": "registry.example", "driver": {"payload": {"version": "1"}}}
            )
            bootstrap(cp, Path(tmp), RELEASE, release_values(cp, RELEASE, NS))
            yield cp, admin, Path(tmp), service_account_kubeconfig(cp, Path(tmp), "metax-operator-runner", NS)
        finally:
            cp.stop()


def main() -> None:
    with installed_chart("bench-steady-") as (_cp, _admin, _tmp, kubeconfig):
        api = Client.connect(str(kubeconfig))
        traffic = Traffic(api.api_client)
        runner = Runner(api, NS, lambda: True)
        deadline = time.monotonic() + 120
        while runner.run_pass():  # until a pass writes nothing
            if time.monotonic() > deadline:
                raise TimeoutError("the runner did not converge in 120 s")
        runner.run_pass()

        mark = traffic.mark()
        reconcile.observe(api, NS)
        api.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
        api.get("apps/v1", "DaemonSet", DRIVER_DAEMONSET, NS)
        live_requests, live_bytes = traffic.since(mark)

        mark, cpu = traffic.mark(), time.process_time()
        for _ in range(STEADY_PASSES):
            writes = runner.run_pass()
            assert writes == 0, f"a pass over an unchanged cluster wrote {writes} times"
        cpu = (time.process_time() - cpu) / STEADY_PASSES
        requests, received = traffic.since(mark)
        # What the watches cost with no pass at all: their bookmarks, and reopening a watch
        # the server closed (every 5 to 10 minutes).
        mark, watched = traffic.mark(), cache_bytes(runner)
        time.sleep(IDLE)
        idle_requests, _ = traffic.since(mark)
        watched = cache_bytes(runner) - watched
        print(
            f"one runner pass over an unchanged cluster (chart installed, {len(runner.caches())} watch caches, "
            f"counted at the client as the runner's ServiceAccount):"
        )
        print(
            f"  before (the CR, DaemonSets, ConfigMaps, Service read live): {live_requests} requests, "
            f"{live_bytes:,} bytes per pass"
        )
        print(
            f"  after (read from the caches), mean of {STEADY_PASSES} passes: "
            f"{requests / STEADY_PASSES:g} requests, {received / STEADY_PASSES:g} bytes per pass; "
            f"{cpu * 1000:.1f} ms CPU per pass (target: 0 requests)"
        )
        print(
            f"  the watch caches, whatever the number of passes: {watched * 60 / IDLE:,.0f} bytes and "
            f"{idle_requests * 60 / IDLE:g} requests per minute (measured over {IDLE:g} s idle)",
            flush=True,
        )
        for cache in (runner.objects, runner.watches, runner.workloads):
            cache.stop()


if __name__ == "__main__":
    main()
