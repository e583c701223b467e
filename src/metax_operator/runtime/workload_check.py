"""The runner's workload check: the CR condition `WorkloadsValid` from `workloads.problems` over
what the runner's watches see (a Warning Event on the CR when it turns False, as for every
condition: `cr_status.transition_events`), one problem per line.

Inputs, all from watch-fed caches, so a pass costs no request:
- the nodes carrying the sGPU mode or the QoS policy label: two informers of their metadata with
  label-existence selectors, so a cluster where nobody set those labels sends nothing;
- HAMi's scheduler pods (`workloads.HAMI_SCHEDULER_SELECTOR`, every namespace), for whether one is
  Ready. Why pods by label: a Ready scheduler pod is what sGPU pods actually need, the runner may
  already list and watch pods cluster-wide, and HAMi's own chart sets that label; a value an admin
  sets would say HAMi is there when it has stopped;
- the GPU pods of the rollout's cluster-wide pod watch (`rollout_observe.Watches.gpu_pods`), with
  their `METAX_MACA_VERSION` values;
- the CR spec of the pass: `runtime.deploy`, `maca.deploy`, `maca.payload.images`.
Until the caches have listed once the check sets nothing (the condition keeps its last value).
"""

from __future__ import annotations

import logging

from metax_operator import contract, workloads
from metax_operator.conditions import FALSE, TRUE, Condition, CrCondition, CrReason
from metax_operator.jsonlog import event
from metax_operator.runtime import reconcile
from metax_operator.runtime.informer import SYNC_TIMEOUT, Informer
from metax_operator.runtime.kube import Client

log = logging.getLogger("metax_operator.workloads")


class WorkloadCheck:
    """`reconcile` is a reconciler (see `reconcile.RECONCILERS`) reading the caches started by `start`."""

    def __init__(self, api: Client, gpu_pods: Informer, resync: float = 1800.0):
        self.gpu_pods = gpu_pods
        self.started = False
        self.labelled = [
            Informer(
                api,
                "/api/v1/nodes",
                label_selector=label,
                project=workloads.node_labels,
                metadata_only=True,  # labels are all it reads of a Node
                resync=resync,
                name=f"nodes-{label.rsplit('.', 1)[-1]}",
            )
            for label in (contract.MODE_LABEL, contract.QOS_LABEL)
        ]
        self.hami = Informer(
            api,
            "/api/v1/pods",
            label_selector=workloads.HAMI_SCHEDULER_SELECTOR,
            project=workloads.ready,
            resync=resync,
            name="hami-scheduler",
        )

    @property
    def informers(self) -> tuple[Informer, ...]:
        """The caches of its own (the GPU-pod cache is the rollout's)."""
        return (*self.labelled, self.hami)

    def start(self) -> None:
        """Start its caches, once."""
        if not self.started:
            for informer in self.informers:
                informer.start()
            self.started = True

    def stop(self) -> None:
        for informer in self.informers:
            informer.stop()

    def reconcile(self, observed: reconcile.Observed) -> reconcile.Outcome:
        out = reconcile.Outcome()
        if observed.cr is None:
            return out
        if not all(i.wait_synced(SYNC_TIMEOUT) for i in (*self.labelled, self.hami, self.gpu_pods)):
            event(log, "workloads-wait-cache", logging.WARNING, msg="the node and pod caches have not listed yet")
            return out
        nodes: dict[str, dict[str, str]] = {}
        for informer in self.labelled:
            for name, labels in informer.snapshot().items():
                nodes.setdefault(name, {}).update(labels)
        found = workloads.problems(
            nodes,
            self.gpu_pods.snapshot().values(),
            runtime_deployed=_deployed(observed.spec, "runtime"),
            maca_images=workloads.payload_images(observed.spec) if _deployed(observed.spec, "maca") else None,
            hami_running=any(self.hami.snapshot().values()),
        )
        if found:
            out.conditions.append(
                Condition(CrCondition.WORKLOADS_VALID, FALSE, CrReason.WORKLOAD_MISCONFIGURED, "\n".join(map(str, found)))
            )
        else:
            out.conditions.append(
                Condition(
                    CrCondition.WORKLOADS_VALID,
                    TRUE,
                    CrReason.VALID,
                    "node sGPU labels, sGPU prerequisites and the GPU pods' METAX_MACA_VERSION check out",
                )
            )
        return out


def _deployed(spec: dict, key: str) -> bool:
    return bool((spec.get(key) or {}).get("deploy", contract.DEFAULT_DEPLOY[key]))
