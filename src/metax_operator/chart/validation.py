"""The rules values.schema.json cannot express, and the checks of the two ConfigMaps' contents.

One implementation for every consumer: `metax-operator validate`, the pre-install hook (values)
and the runner (`validate_cr_spec` on the ClusterOperator spec, the ConfigMap parsers when an
admin edits `driver-config` or `metax-vfio-config`). The chart's render-time copy of the
cross-field rules is templates/_validations.tpl; tests/data/bad_values.yaml runs every case
through both, under Helm 3 and Helm 4, so the two cannot drift.

Every problem is a `UserError` naming the field path and the fix; a function raises them all
at once as `UserErrors`.

Regular expressions (`vfioConfig[].nodeName`) are matched by vfio-manager, a Go program, so they
are compiled with RE2 (the `google-re2` wheel), the syntax Go's regexp implements: a pattern
Python's `re` accepts but Go refuses (lookarounds, backreferences) is refused here too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Mapping

import yaml

from metax_operator.chart import images, pools, seed_spellings
from metax_operator.chart import upgrade_policy as policy
from metax_operator.chart.problems import regex_problem, schema_problems
from metax_operator.chart.schema import build_values_schema, fragment
from metax_operator.contract import (
    COMPONENTS,
    MODULE_PARAMS,
    NODE_MODULE_PARAMS,
    NODE_VFNUMS,
    PREREQUISITES,
    VFIO_CONFIG_KEY,
    ConfigMapKey,
)
from metax_operator.errors import UserError, UserErrors

SERVICE_TYPES_WITH_PORT = ("NodePort", "LoadBalancer")


def dependency_problem(component: str, prerequisite: str) -> UserError:
    return UserError(
        f"{component}.deploy",
        f"is true but its prerequisite {prerequisite}.deploy is false",
        f"set {prerequisite}.deploy=true or {component}.deploy=false",
    )


# The cross-field rules' wording, one function each (admission.py builds the CRD's CEL messages
# from them too).


def registry_missing() -> UserError:
    return UserError("registry", "is required", "set it to DOMAIN/PROJECT, e.g. --set registry=cr.example.com/metax")


def payload_version_missing() -> UserError:
    return UserError(
        "driver.payload.version",
        "is required unless driver.deployPolicy is Never",
        "set the driver version, e.g. --set driver.payload.version=2.32.0.6",
    )


def firmware_without_payload() -> UserError:
    return UserError(
        "driver.fwUpgradePolicy",
        "PreferCloud flashes the firmware the driver payload carries, and driver.deployPolicy Never deploys no payload",
        "set driver.fwUpgradePolicy=Never, or a driver.deployPolicy that deploys the payload "
        "(PreferCloud, PreferHost or PreferNewer)",
    )


def pools_without_runner() -> UserError:
    return UserError(
        "driver.pools",
        "needs the runner: it puts each GPU node into its pool and rolls each pool's driver out",
        "set runner.enabled=true, or remove driver.pools",
    )


def node_port_range_backwards(ports: object) -> UserError:
    return UserError(
        "exporter.service.nodePortRange",
        f"{ports} is not a range of ports",
        "write LOW-HIGH within 1-65535, as the API server's --service-node-port-range",
    )


def node_port_outside_range(port: object, ports: object) -> UserError:
    return UserError(
        "exporter.service.port",
        f"{port} is outside the node port range {ports}",
        "use a port in the range, leave it empty to let Kubernetes choose, or set "
        "exporter.service.nodePortRange to the cluster's --service-node-port-range",
    )


def port_with_type(kind: object) -> UserError:
    return UserError(
        "exporter.service.port",
        f"is only valid with type NodePort or LoadBalancer, not {kind}",
        "remove the port, or set exporter.service.type=NodePort or LoadBalancer",
    )


def external_name_missing() -> UserError:
    return UserError(
        "exporter.service.externalName", "is required with type ExternalName", "set it to the DNS name the Service points to"
    )


def external_name_with_type(kind: object) -> UserError:
    return UserError(
        "exporter.service.externalName",
        f"is only valid with type ExternalName, not {kind}",
        "remove it, or set exporter.service.type=ExternalName",
    )


def validate_values(values: Mapping, schema: Mapping | None = None) -> None:
    """Check merged chart values as `helm template` does; raise `UserErrors` listing every problem."""
    _raise(values_problems(values, schema))


def values_problems(values: Mapping, schema: Mapping | None = None, defaults: Mapping | None = None) -> list[UserError]:
    """values.schema.json's problems (`schema`, else the package's own copy), or when there are
    none, the rules templates/_validations.tpl applies at render time: what a render refuses.
    The product manual's spellings are read as the chart's keys first (seed_spellings.normalise,
    with the chart's values.yaml `defaults` where known)."""
    errors = schema_problems(values, values_schema() if schema is None else schema)
    if errors:  # the rules assume the schema's shapes, as the render does
        return errors
    spelled = seed_spellings.normalise(values, defaults)
    if spelled.errors:
        return spelled.errors
    values = spelled.values
    errors = _spec_problems(values)
    if pools.pools_of(values.get("driver")) and not (values.get("runner") or {}).get("enabled"):
        errors.append(pools_without_runner())
    errors += _schedule_problems((values.get("runner") or {}).get("schedule"))
    errors += _deprecated_tolerations_problems(values.get("tolerations"))
    return errors


@functools.cache
def values_schema() -> dict:
    """values.schema.json as generated from the package's schema source (without descriptions)."""
    return build_values_schema("")


def validate_cr_spec(spec: Mapping) -> None:
    """The same rules on a ClusterOperator `spec` (field paths start at `spec.`): the runner
    checks them because API servers older than 1.25 ignore the CRD's CEL rules, and the CRD
    cannot check regular expressions, GPU lists or ConfigMap-shaped maps."""
    _raise(cr_spec_problems(spec))


def cr_spec_problems(spec: Mapping) -> list[UserError]:
    return [_prefixed("spec.", e) for e in seed_spellings.cr_problems(spec) + _spec_problems(spec)]


def _spec_problems(values: Mapping) -> list[UserError]:
    """Rules shared by values and the CR spec (the CR spec is the values less chart settings)."""
    errors: list[UserError] = []
    if not values.get("registry"):
        errors.append(registry_missing())
    for component, prerequisites in PREREQUISITES.items():
        if _deployed(values, component):
            errors += [dependency_problem(component, p) for p in prerequisites if not _deployed(values, p)]
    driver = values.get("driver") or {}
    if _deployed(values, "driver") and driver.get("deployPolicy") != "Never" and not (driver.get("payload") or {}).get("version"):
        errors.append(payload_version_missing())
    if _deployed(values, "driver") and driver.get("deployPolicy") == "Never" and driver.get("fwUpgradePolicy") == "PreferCloud":
        errors.append(firmware_without_payload())
    errors += policy.problems(driver.get("upgradePolicy"), "driver.upgradePolicy")
    errors += pools.problems(driver)
    errors += driver_config_problems(driver.get("config") or {}, "driver.config")
    errors += vfio_config_problems((values.get("vfioManager") or {}).get("vfioConfig") or [], "vfioManager.vfioConfig")
    errors += _service_problems((values.get("exporter") or {}).get("service") or {})
    errors += image_problems(values)
    return errors


def image_problems(values: Mapping) -> list[UserError]:
    """Every image reference's repository (`registry/name`) within the distribution grammar's
    length; the schema checks each part alone. Images absent from the mapping (a CR spec has only
    the payloads) are not checked."""
    common = values.get("registry") or ""
    sites = [(f"{key}.image", (values.get(key) or {}).get("image")) for key in (*COMPONENTS, "tools")]
    sites.append(("driver.payload", (values.get("driver") or {}).get("payload")))
    maca = (values.get("maca") or {}).get("payload") or {}
    sites += [
        (f"maca.payload.images[{i}]", {"registry": maca.get("registry"), "name": images.split(entry)[0]})
        for i, entry in enumerate(maca.get("images") or [])
        if isinstance(entry, str)
    ]
    errors = []
    for field, image in sites:
        if isinstance(image, Mapping) and image.get("name"):
            length = len(image.get("registry") or common) + 1 + len(image["name"])
            if length > images.MAX_REPOSITORY:
                errors.append(
                    UserError(
                        field,
                        f"the image repository (registry/name) is {length} characters long, more than {images.MAX_REPOSITORY}",
                        "shorten the registry or the image name",
                    )
                )
    return errors


def _deployed(values: Mapping, component: str) -> bool:
    return bool((values.get(component) or {}).get("deploy"))


def _service_problems(service: Mapping) -> list[UserError]:
    errors = []
    kind = service.get("type", "ClusterIP")
    port, ports = service.get("port"), str(service.get("nodePortRange") or "")
    low, _, high = ports.partition("-")
    if not (low.isdigit() and high.isdigit()):  # the schema and the CRD require it, in this format
        pass
    elif int(low) > int(high) or int(high) > 65535:
        errors.append(node_port_range_backwards(ports))
    elif kind == "NodePort" and port is not None and not int(low) <= port <= int(high):
        errors.append(node_port_outside_range(port, ports))
    if service.get("port") is not None and kind not in SERVICE_TYPES_WITH_PORT:
        errors.append(port_with_type(kind))
    if kind == "ExternalName" and not service.get("externalName"):
        errors.append(external_name_missing())
    if kind != "ExternalName" and service.get("externalName"):
        errors.append(external_name_with_type(kind))
    return errors


_CRON_NAMES = {
    name: number
    for names, first in (("jan feb mar apr may jun jul aug sep oct nov dec", 1), ("sun mon tue wed thu fri sat", 0))
    for number, name in enumerate(names.split(), first)
}


def _schedule_problems(schedule: Any) -> list[UserError]:
    """The ranges of a cron schedule run forwards (the schema checks the rest of its grammar)."""
    errors = []
    for part in (schedule or "").replace(",", " ").split():
        low, dash, high = part.partition("/")[0].partition("-")
        if dash and _cron_value(low) > _cron_value(high):
            errors.append(
                UserError(
                    "runner.schedule", f"the range {low}-{high} runs backwards", f"write the smaller value first: {high}-{low}"
                )
            )
    return errors


def _cron_value(text: str) -> int:
    return _CRON_NAMES[text.lower()] if text.lower() in _CRON_NAMES else int(text)


def _deprecated_tolerations_problems(value: Any) -> list[UserError]:
    """`tolerations` given as a string (`--set-file tolerations=FILE`): the schema cannot look
    inside, so parse it as the templates do and check each toleration."""
    if not isinstance(value, str):
        return []
    tolerations = parse_tolerations(value)
    if not isinstance(tolerations, list):
        return [
            UserError(
                "tolerations",
                "the file must hold a YAML list of tolerations or a mapping `tolerations: [...]`",
                "fix the file given with --set-file tolerations=FILE; better, move them to podTemplateSpec.spec.tolerations",
            )
        ]
    return schema_problems(tolerations, fragment("tolerations"), "tolerations")


def parse_tolerations(text: str) -> Any:
    """The deprecated `tolerations` string: a YAML list, or the seed's `{tolerations: [...]}`;
    None (no tolerations) when empty. Returns whatever else it finds for the caller to refuse."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(doc, Mapping) and set(doc) == {"tolerations"}:
        doc = doc["tolerations"]
    return [] if doc is None else doc


# --- driver-config and metax-vfio-config -------------------------------------------------------


def driver_config_problems(config: Mapping, prefix: str) -> list[UserError]:
    """`driver.config` of the values: the contents of the three driver-config keys."""
    errors: list[UserError] = []
    for key in ("nodeVfnums", "moduleParams", "nodeModuleParams"):
        if key in config:
            errors += schema_problems(config[key], fragment("driver", "config", key), f"{prefix}.{key}")
    return errors


def vfio_config_problems(entries: Any, prefix: str) -> list[UserError]:
    """`vfioConfig` entries: the schema's shape, nodeName an RE2 regex, gpus without duplicates."""
    errors = schema_problems(entries, fragment("vfioManager", "vfioConfig"), prefix)
    if errors:
        return errors
    for i, entry in enumerate(entries):
        problem = regex_problem(entry["nodeName"])
        if problem:
            errors.append(
                UserError(
                    f"{prefix}[{i}].nodeName",
                    f"{entry['nodeName']!r} is not a valid regular expression: {problem}",
                    "write it in Go (RE2) syntax: no lookarounds or backreferences",
                )
            )
        gpus = entry["gpus"].split(",") if entry["gpus"] != "all" else []
        duplicates = list(dict.fromkeys(g for g in gpus if gpus.count(g) > 1))
        if duplicates:
            errors.append(
                UserError(f"{prefix}[{i}].gpus", f"lists GPU {', '.join(duplicates)} more than once", "list each GPU index once")
            )
    return errors


def _load_configmap_value(text: str | None, where: str) -> Any:
    try:
        return yaml.safe_load(text or "")
    except yaml.YAMLError as err:
        raise UserErrors(
            [UserError(where, f"is not valid YAML: {err}".replace("\n", " "), "fix the ConfigMap with kubectl edit")]
        ) from None


def _where(key: ConfigMapKey) -> str:
    return f"configmap/{key.configmap}[{key.key}]"


def parse_node_vfnums(text: str | None) -> dict[str, int]:
    """driver-config key `node-vfnums` (seed §3.2.6): `nodes: {NODE: {vfnum: N}}` → {NODE: N}."""
    where = _where(NODE_VFNUMS)
    doc = _load_configmap_value(text, where) or {"nodes": {}}
    if not isinstance(doc, Mapping) or set(doc) != {"nodes"}:
        _raise(
            [
                UserError(
                    where, "must be a mapping with the one key `nodes`", "write `nodes:` then one `NODE: {vfnum: N}` per node"
                )
            ]
        )
    nodes = doc["nodes"] or {}
    _raise(schema_problems(nodes, fragment(*NODE_VFNUMS.field), f"{where}.nodes"))
    return {node: entry["vfnum"] for node, entry in nodes.items()}


def parse_module_params(text: str | None) -> dict[str, Any]:
    """driver-config key `module-params` (seed §3.2.7): cluster-wide kernel module parameters."""
    where = _where(MODULE_PARAMS)
    params = _load_configmap_value(text, where) or {}
    _raise(schema_problems(params, fragment(*MODULE_PARAMS.field), where))
    return dict(params)


def parse_node_module_params(text: str | None) -> dict[str, dict[str, Any]]:
    """driver-config key `node-module-params` (seed §3.2.7): {NODE: {param: value}}."""
    where = _where(NODE_MODULE_PARAMS)
    params = _load_configmap_value(text, where) or {}
    _raise(schema_problems(params, fragment(*NODE_MODULE_PARAMS.field), where))
    return {node: dict(p or {}) for node, p in params.items()}


def parse_vfio_config(text: str | None) -> list[dict[str, str]]:
    """metax-vfio-config content (seed §3.2.6.1): a list of {nodeName: REGEX, gpus: "0,1" | "all"}."""
    where = f"configmap/{VFIO_CONFIG_KEY.configmap}"
    entries = _load_configmap_value(text, where) or []
    _raise(vfio_config_problems(entries, where))
    return [dict(e) for e in entries]


#: The parser of each ConfigMap key admins edit in place.
CONFIGMAP_PARSERS: dict[ConfigMapKey, Callable[[str | None], object]] = {
    NODE_VFNUMS: parse_node_vfnums,
    MODULE_PARAMS: parse_module_params,
    NODE_MODULE_PARAMS: parse_node_module_params,
    VFIO_CONFIG_KEY: parse_vfio_config,
}


def configmap_problems(name: str, data: Mapping | None) -> list[UserError]:
    """What is wrong with the keys of ConfigMap `name` (its `data`), by their parsers."""
    return list(_configmap_problems(name, tuple(sorted((data or {}).items()))))


@functools.lru_cache(maxsize=16)
def _configmap_problems(name: str, items: tuple[tuple[str, str], ...]) -> tuple[UserError, ...]:
    """`configmap_problems`, once per content: the runner checks both ConfigMaps at every pass,
    and they change only when an admin edits them."""
    data = dict(items)
    problems: list[UserError] = []
    for key, parse in CONFIGMAP_PARSERS.items():
        if key.configmap != name:
            continue
        try:
            parse(data.get(key.key))
        except UserErrors as err:
            problems += err.errors
        except UserError as err:
            problems.append(err)
    return tuple(problems)


def _prefixed(prefix: str, error: UserError) -> UserError:
    return UserError(prefix + error.field, error.problem, error.fix)


def _raise(errors: list[UserError]) -> None:
    if errors:
        raise UserErrors(errors)
