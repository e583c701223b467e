"""The CR spec mapped onto a component DaemonSet the chart rendered, and back.

`desired_daemonset` is what the runner's reconcile applies for a CR spec: the scheduling fields
(the podTemplateSpec rules of `merge.py` over the base the chart recorded in the DaemonSet's
annotations), the environment variables the chart renders from CR fields (`ENV`), the payload
images and the update strategy. `restored_driver_spec` is its inverse for the driver,
which a rollback writes back to the CR. Pure functions of their arguments: the runtime's
reconcile and the rollout's restore both use them.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from metax_operator.chart import images
from metax_operator.chart.merge import MANAGED_FIELDS, SchedulingInputs, inputs_from_annotations, merge_scheduling
from metax_operator.contract import (
    COMPONENT_ENV,
    COMPONENT_UPDATE_STRATEGY,
    DAEMONSETS,
    DRIVER_PAYLOAD_CONTAINER,
    DRIVER_UPDATE_STRATEGY,
    LOG_ENV,
    MACA_PAYLOAD_PREFIX,
    PAYLOAD_IMAGE_ENV,
)
from metax_operator.errors import UserError
from metax_operator.lookup import lookup

#: The environment variables the chart renders from CR fields (`metax-operator.valuesEnv`, from
#: the same contract): component -> {VAR: path under `spec.<component>`}.
ENV = {key: {**LOG_ENV, **COMPONENT_ENV.get(key, {})} for key in DAEMONSETS}


def desired_daemonset(key: str, ds: dict, spec: dict) -> tuple[dict, list[str]]:
    """The partial DaemonSet the runner applies for component `key`, and the fields it sets.

    Raises UserError when the chart's annotations on the DaemonSet are missing or broken.
    """
    meta = ds["metadata"]
    annotations = meta.get("annotations") or {}
    scheduling, _ = merge_scheduling(scheduling_inputs(spec, key, inputs_from_annotations(annotations)), prefix="spec.")
    pod_spec: dict[str, Any] = dict(scheduling)
    live = pod_of(ds)
    component = spec.get(key) or {}
    containers = []
    for container in live.get("containers") or []:
        env = []
        present = item_names(container.get("env"))
        for var, path in ENV[key].items():
            value = lookup(component, *path)
            if var in present and value is not None:
                text = _env_value(value)  # the API drops an empty value: so do we, to compare alike
                env.append({"name": var, "value": text} if text else {"name": var})
        if env:
            containers.append({"name": container["name"], "env": env})
    if containers:
        pod_spec["containers"] = containers
    init = _payload_images(key, live, spec)
    if init:
        pod_spec["initContainers"] = init
    desired = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"template": {"spec": pod_spec}},
    }
    changed = [f for f in pod_spec if not covers(live.get(f), pod_spec[f], f)]
    strategy = DRIVER_UPDATE_STRATEGY if key == "driver" else COMPONENT_UPDATE_STRATEGY
    desired["spec"]["updateStrategy"] = copy.deepcopy(strategy)
    if not covers((ds.get("spec") or {}).get("updateStrategy"), strategy):
        changed.append("updateStrategy")
    return desired, changed


def restored_driver_spec(ds: dict, template: dict, spec: dict, recorded: str = "") -> dict | None:
    """The CR's `spec.driver` to write back when a rollback restores the driver DaemonSet to the
    pod `template` of an older ControllerRevision: one under which this reconcile leaves that
    template exactly as it is. Anything else would re-create the abandoned revision at the next
    pass and the rollback would flip between the two revisions forever.

    `recorded` (`lastCoDriverSpec`, JSON) is used when it reproduces the template. It is empty
    when the runner first met the pods already at an older revision (nothing recorded the older
    revision's spec), and stale if the CR changed while no runner ran; then the fields this
    reconcile maps into the template are read back from it: the payload reference, the
    environment variables of `ENV["driver"]` and, when the CR's podTemplateSpec no longer gives
    the template's scheduling fields, those fields themselves as `spec.driver.podTemplateSpec`.
    Everything else (deploy, config, upgradePolicy...) stays as the CR has it. None when neither
    reproduces the template (a DaemonSet the chart did not render).
    """
    at = {**ds, "spec": {**(ds.get("spec") or {}), "template": template}}
    current = spec.get("driver") or {}
    candidates = []
    try:
        candidates.append({**json.loads(recorded), "upgradePolicy": current.get("upgradePolicy", {})})
    except (TypeError, ValueError):  # none recorded (or not a JSON object): the template decides
        pass
    try:
        candidates.append(_driver_spec_of(at, spec))
        return next((c for c in candidates if _reproduces(at, {**spec, "driver": c})), None)
    except UserError:  # the chart's annotations on the DaemonSet are broken
        return None


def _driver_spec_of(ds: dict, spec: dict) -> dict:
    """The CR's spec.driver with every field the reconcile maps into `ds`'s template read back
    from that template (the inverse of `desired_daemonset` for the driver)."""
    driver = copy.deepcopy(spec.get("driver") or {})
    pod = pod_of(ds)
    env = {e["name"]: e.get("value", "") for c in pod.get("containers") or [] for e in c.get("env") or [] if "valueFrom" not in e}
    for var, path in ENV["driver"].items():
        if var in env:
            _set(driver, path, _from_env(env[var], lookup(driver, *path)))
    image = next((c.get("image") for c in pod.get("initContainers") or [] if c.get("name") == DRIVER_PAYLOAD_CONTAINER), None)
    if image:
        payload = driver.setdefault("payload", {})
        repository, tag, digest = images.split(image)
        own, common = payload.get("registry") or "", spec.get("registry") or ""
        # The split between registry and name is ambiguous (both may hold slashes): prefer the
        # registries the CR names, so that only what changed is written.
        registry = next(
            (r for r in (own or common, common) if r and repository.startswith(r + "/")), repository.rpartition("/")[0]
        )
        if registry != (own or common):
            payload["registry"] = "" if registry == common else registry
        payload.update(name=repository[len(registry) + 1 :], version=tag)
        if digest or "digest" in payload:
            payload["digest"] = digest
    scheduling = {f: pod[f] for f in MANAGED_FIELDS if f in pod}
    merged, _ = merge_scheduling(
        scheduling_inputs({**spec, "driver": driver}, "driver", inputs_from_annotations(ds["metadata"].get("annotations") or {})),
        prefix="spec.",
    )
    if merged != scheduling:
        driver["podTemplateSpec"] = {"spec": scheduling}
    return driver


def _reproduces(ds: dict, spec: dict) -> bool:
    """Whether the reconcile of `spec` leaves `ds`'s pod template as it is."""
    desired, changed = desired_daemonset("driver", ds, spec)
    pod, live = desired["spec"]["template"]["spec"], pod_of(ds)
    return set(changed) <= {"updateStrategy"} and all(pod.get(f) == live.get(f) for f in MANAGED_FIELDS)


def _from_env(text: str, like: Any) -> Any:
    """The CR value an environment variable holds (the inverse of `_env_value`), typed like the
    value the CR has there now."""
    if isinstance(like, bool):
        return text == "true"
    if isinstance(like, int) and text.lstrip("-").isdigit():
        return int(text)
    if isinstance(like, list):
        return text.split(",") if text else []
    return text


def covers(have: Any, want: Any, name: str = "") -> bool:
    """Every value in `want` is in `have`: maps key by key, lists of named items by name, other
    lists and `nodeSelector` (an atomic map in the API) whole."""
    if want is None:
        return True
    if isinstance(want, dict) and name != "nodeSelector":
        return isinstance(have, dict) and all(covers(have.get(k), v, k) for k, v in want.items())
    if isinstance(want, list) and want and all(isinstance(i, dict) and "name" in i for i in want):
        if not isinstance(have, list):
            return False
        by_name = {i.get("name"): i for i in have if isinstance(i, dict)}
        return all(i["name"] in by_name and covers(by_name[i["name"]], i) for i in want)
    return have == want


def scheduling_inputs(spec: dict, key: str, recorded: SchedulingInputs | None = None) -> SchedulingInputs:
    """The merge inputs of component `key`: the base the chart recorded, the rest from the CR."""
    return (recorded or SchedulingInputs(component=key))._replace(
        global_pts=spec.get("podTemplateSpec") or None,
        component_pts=(spec.get(key) or {}).get("podTemplateSpec") or None,
        deprecated_tolerations=spec.get("tolerations") or None,
    )


def _payload_images(key: str, live: dict, spec: dict) -> list[dict]:
    """Init containers whose image the CR sets (the driver payload, the MXMACA payloads)."""
    registry = spec.get("registry")
    if key == "driver":
        payload = (spec.get("driver") or {}).get("payload") or {}
        registry = payload.get("registry") or registry
        if (
            DRIVER_PAYLOAD_CONTAINER in item_names(live.get("initContainers"))
            and registry
            and payload.get("name")
            and payload.get("version")
        ):
            image = images.reference(registry, payload["name"], payload["version"], payload.get("digest") or "")
            return [_payload_container(DRIVER_PAYLOAD_CONTAINER, image)]
    if key == "maca":
        payload = (spec.get("maca") or {}).get("payload") or {}
        registry = payload.get("registry") or registry
        entries = payload.get("images")
        containers = payload_containers(live)
        if registry and entries is not None and len(entries) == len(containers):
            return [_payload_container(name, f"{registry}/{entry}") for name, entry in zip(containers, entries, strict=False)]
    return []


def _payload_container(name: str, image: str) -> dict:
    """A payload init container's image, and the variable that names it in its one-line failure
    (`metax-operator.payloadContainer`)."""
    return {"name": name, "image": image, "env": [{"name": PAYLOAD_IMAGE_ENV, "value": image}]}


def payload_containers(pod_spec: dict) -> list[str]:
    """The MXMACA pod's `payload-N` init containers, in N order."""
    names = [
        n
        for n in item_names(pod_spec.get("initContainers"))
        if n.startswith(MACA_PAYLOAD_PREFIX) and n.removeprefix(MACA_PAYLOAD_PREFIX).isdigit()
    ]
    return sorted(names, key=lambda n: int(n.removeprefix(MACA_PAYLOAD_PREFIX)))


def pod_of(ds: dict) -> dict:
    return lookup(ds, "spec", "template", "spec") or {}


def item_names(items: list | None) -> list[str]:
    return [i.get("name") for i in items or [] if isinstance(i, dict)]


def _set(obj: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        obj = obj.setdefault(part, {})
    obj[path[-1]] = value


def _env_value(value: Any) -> str:
    """The text `metax-operator.valuesEnv` renders for a value (`true`, `5`, a comma-joined list)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)
