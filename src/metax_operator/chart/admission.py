"""The API server's copy of the cross-field rules: CEL, with the messages `validate` prints.

Each rule's wording is written once, in the Python function that `validate`, the pre-install
hook and the runner use (validation.py, upgrade_policy.py); `message()` turns that function into a CEL
`messageExpression`, so `kubectl patch` with a bad policy is refused (422) with the same line.
The predicates are CEL written here beside them; tests/chart/test_admission.py runs every case of
tests/data/bad_values.yaml, accepted and refused, and generated policies through both and fails
on any difference.

Where each rule runs (docs/hooks.md, "Admission"):
- `crd_rules()`: the CRD's `x-kubernetes-validations`, on every API server that enforces them
  (1.25 and later; 1.23 and 1.24 drop them). They see only the object being written (and, in
  transition rules, its old value). Two forms: the portable one (the chart's `crds/`), which
  every supported API server admits, each rule with a static `message`; and the whole one
  (files/, applied by the upgrade-crds hook from FULL_CRD_MINOR), with validate's lines, values
  and all, as messageExpressions.
- `policy_validations()`: a ValidatingAdmissionPolicy (templates/admission/, generated), for
  what CRD rules cannot see: `pause` and `pauseDuration` have no single type, so the CRD keeps
  them untyped and CEL cannot read them there; and the rollout in progress is known from the old
  object's status, which a rule on `spec` cannot read. The chart installs it where the API server
  serves ValidatingAdmissionPolicy: v1 (Kubernetes 1.30 and later), else v1beta1 (1.28 and 1.29,
  where it is turned on). Where it is not served, the bootstrap hook refuses the values' frozen
  edits itself and the runner holds a `kubectl` one (`rollout.freeze`).
- `warning_validations()`: a second policy whose binding only warns.

CEL's cost estimator decides what a rule may do: a string of unknown length makes a rule too
dear, hence the schema's maxLength/maxItems on what rules read, and `string(dyn(x))`.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from metax_operator.chart import problems, seed_spellings, validation
from metax_operator.chart import upgrade_policy as policy
from metax_operator.chart.schema import fragment, percent_pattern
from metax_operator.contract import CR_GROUP, CR_NAME, CR_PLURAL, CR_VERSION, PREREQUISITES, SEED_SPELLINGS
from metax_operator.errors import UserError
from metax_operator.lookup import lookup

#: The first Kubernetes minor that admits the whole CRD: its CEL cost estimator bounds a
#: messageExpression's `string(dyn(x))` and a `matches` on an int-or-string field; older ones
#: estimate them as unbounded and refuse the CRD (measured: 1.28 and 1.33 refuse, 1.34 admits).
FULL_CRD_MINOR = 34
POLICY = "driver.upgradePolicy"
STEPS = f"{POLICY}.upgradeSteps"
#: The only spec fields an admin may change while a driver rollout is in progress (seed §3.2.8).
ROLLOUT_CONTROLS = ("pause", "enableRollout")
#: How the spec is compared while a rollout is in progress: at each level (a path below `spec`),
#: every key but the one compared a level down (or, at the last, the rollout's controls).
FREEZE_LEVELS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    ((), ("driver",)),
    # driver.enableRollout: the seed's spelling; driver.pools: each pool's rollout holds its own
    # edits (rollout/freeze.py), the driver's does not hold theirs.
    (("driver",), ("upgradePolicy", "enableRollout", "pools")),
    (("driver", "upgradePolicy"), ROLLOUT_CONTROLS),
)
_MARK = re.compile("\x00([0-9]+)\x00")


def message(make: Callable[..., UserError], *expressions: str) -> str:
    """A CEL messageExpression giving `str(make(...))` with each argument the value of a CEL
    expression: `make` is called with placeholders that are then cut out of its text."""
    parts = _MARK.split(_marked(make, len(expressions)))
    # string(dyn(x)): the cost estimator takes string() of a typed value as unbounded, of dyn not
    out = [f"string(dyn({expressions[int(part)]}))" if i % 2 else literal(part) for i, part in enumerate(parts) if i % 2 or part]
    return " + ".join(out)


def static_message(make: Callable[..., UserError], count: int) -> str:
    """`str(make(...))` with `…` for each of its `count` arguments: the rule's `message`, which the
    portable CRD says, and the whole CRD where its messageExpression fails."""
    return _MARK.sub("…", _marked(make, count))


def _marked(make: Callable[..., UserError], count: int) -> str:
    return str(make(*(f"\x00{i}\x00" for i in range(count))))


def literal(text: str) -> str:
    """`text` as a CEL string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def regex(pattern: str) -> str:
    """`pattern` as a CEL raw string literal (no escapes to double)."""
    assert "'" not in pattern
    return f"r'{pattern}'"


def _rule(rule: str, make: Callable[..., UserError], *expressions: str) -> dict:
    """A CRD rule whose message is `make`'s line (with `expressions` as its arguments)."""
    if expressions:
        return {"rule": rule, "message": static_message(make, len(expressions)), "messageExpression": message(make, *expressions)}
    return {"rule": rule, "message": str(make())}


def _indices(count: int) -> str:
    """CEL: the list literal [0, 1, …, count - 1]. A comprehension over it reads a list by index:
    the CEL of API servers before 1.33 has no two-variable comprehension (`exists(i, s, …)`), and
    the cost of one over a literal is known exactly, so every server's estimator admits it."""
    return "[" + ", ".join(str(i) for i in range(count)) + "]"


def _first(indices: str, size: str, condition: str, text: str) -> str:
    """CEL for a messageExpression: `text` (which reads `i`) at the first index `i` below `size`
    where `condition` holds."""
    return f"{indices}.filter(i, i < {size} && {condition}).map(i, {text})[0]"


# --- rules of the CRD ---------------------------------------------------------------------------


def for_server(portable_crd: dict, full_crd: dict, minor: int) -> dict:
    """The CRD an API server of Kubernetes 1.`minor` takes: whole from FULL_CRD_MINOR, else the
    portable one (`crd_rules(full=False)`)."""
    return full_crd if minor >= FULL_CRD_MINOR else portable_crd


def _has(root: str, *path: str) -> str:
    """CEL: every field of `path` under `root` is set (has() of each level)."""
    return " && ".join(f"has({root}.{'.'.join(path[: i + 1])})" for i in range(len(path)))


def _deployed(component: str) -> str:
    return f"({_has('self', component, 'deploy')} && self.{component}.deploy)"


def _int_replicas(step: str) -> str:
    return f"(type({step}.replicas) == int && {step}.replicas >= 1)"


def _percent_replicas(step: str) -> str:
    return f"(type({step}.replicas) == string && {step}.replicas in {_PERCENTS})"


def _percents(zero_ok: bool) -> str:
    """CEL: the map literal {'1%': 1, …, '100%': 100} (from '0%' with `zero_ok`): the strings the
    schema's percent pattern allows, with their values. A lookup in it costs the same whatever
    the string, where every estimator before 1.34 takes `matches` or `<` on an int-or-string
    field (CEL's dyn) as unbounded."""
    values = range(0 if zero_ok else 1, 101)
    assert all(re.fullmatch(percent_pattern(zero_ok), f"{v}%") for v in values)
    return "{" + ", ".join(f"'{v}%': {v}" for v in values) + "}"


_PERCENTS = _percents(False)


def _valid_replicas(step: str) -> str:
    """The step's replicas are valid (the schema's minimum and pattern): upgrade_policy.py compares only
    valid replicas, and schema errors do not stop CEL."""
    return f"({_int_replicas(step)} || {_percent_replicas(step)})"


def _replicas_below(step: str, other: str) -> str:
    """Both of one kind (int or valid percent) and `step`'s below `other`'s. `a - b < 0`, not
    `a < b`: on CEL's dyn, `<` might compare strings of any length, `-` only numbers."""
    a, b = f"{step}.replicas", f"{other}.replicas"
    return (
        f"((type({a}) == int && type({b}) == int && {a} - {b} < 0)"
        f" || ({_percent_replicas(step)} && {_percent_replicas(other)} && {_PERCENTS}[{a}] < {_PERCENTS}[{b}]))"
    )


def _steps_rules(node: dict, full: bool) -> list[dict]:
    """On `upgradeSteps` (self is the list, `node` its CRD schema): a rule over the step at each
    index `i` (`self[i]`) up to the schema's maxItems; the single-field checks only when `full`."""
    indices = _indices(node["maxItems"])
    step, previous = "self[i]", "self[i - 1]"
    falling = f"i > 0 && {_valid_replicas(step)} && {_valid_replicas(previous)} && {_replicas_below(step, previous)}"

    def falls(i, r, p):
        return policy.falling_replicas(f"{STEPS}[{i}]", r, p)

    last = "self[size(self) - 1]"
    rules = []
    for key, child in node["items"]["properties"].items() if full else ():
        if valid := _single_field_check(child, f"{step}.{key}"):
            bad = f"has({step}.{key}) && !{valid}"
            make = _schema_error(key, True)
            rules.append(
                {
                    "rule": f"!{indices}.exists(i, i < size(self) && {bad})",
                    "message": static_message(make, 2),
                    "messageExpression": _first(indices, "size(self)", bad, message(make, "i", _shown(f"{step}.{key}"))),
                }
            )
    return rules + [
        {
            "rule": f"!{indices}.exists(i, i < size(self) && {falling})",
            "message": static_message(falls, 3),
            "messageExpression": _first(
                indices, "size(self)", falling, message(falls, "i", f"{step}.replicas", f"{previous}.replicas")
            ),
        },
        _rule(
            f"size(self) == 0 || !{_percent_replicas(last)} || {last}.replicas == '100%'",
            lambda i, r: policy.last_step_short_percent(f"{STEPS}[{i}]", r),
            "size(self) - 1",
            f"{last}.replicas",
        ),
    ]


def _policy_rules(node: dict, full: bool) -> list[dict]:
    """On `upgradePolicy` (its CRD schema `node`); the single-field checks only when `full`."""
    rules = [
        _rule(
            "!(has(self.enableRollout) && self.enableRollout) || (has(self.upgradeSteps) && size(self.upgradeSteps) > 0)",
            lambda: policy.empty_steps(STEPS),
        )
    ]
    for key, child in node["properties"].items() if full else ():
        if _single_field_check(child, "v"):
            valid = _single_field_check(child, f"self.{key}")
            rules.append(_rule(f"!has(self.{key}) || {valid}", _schema_error(key, False), "0", _shown(f"self.{key}")))
    return rules


# The checks of a single policy field are the schema's; the CRD has them too, but says them in
# its own words (`... in body should match '^(100|...'`). These rules add validate's line (a
# pattern does not stop CEL; a type or enum error does), in the whole CRD only: they refuse
# nothing the schema admits, and a `matches` on an int-or-string field costs more than the
# estimators before 1.34 allow.


def _single_field_check(node: dict, value: str) -> str:
    """CEL: `value` passes `node`'s int-or-string minimum and pattern; "" for other fields. (An
    enum needs no copy: a value outside it stops the API server before any CEL rule, with its own
    `Unsupported value: "abort": supported values: "pause", "rollback"`.)"""
    if node.get("x-kubernetes-int-or-string") and "pattern" in node:
        return (
            f"((type({value}) == int && {value} >= {node.get('minimum', 0)})"
            f" || (type({value}) == string && {value}.matches({regex(node['pattern'])})))"
        )
    return ""


def _schema_error(key: str, in_step: bool) -> Callable[[str, str], UserError]:
    """validate's line for a bad value of policy field `key` (of the step at index `i` when
    `in_step`), as a function of the index and the value shown: the values schema's wording,
    taken from validation.py."""
    step = {"replicas": "100%", key: _PLACEHOLDER}
    raw = {"upgradeSteps": [step]} if in_step else {key: _PLACEHOLDER}
    (error,) = problems.schema_problems(raw, fragment("driver", "upgradePolicy"), POLICY)
    return lambda i, v: UserError("", str(error).replace("[0]", f"[{i}]").replace(repr(_PLACEHOLDER), v))


def _shown(value: str) -> str:
    """CEL: `value` as validate shows it (a string quoted, an int as is)."""
    return f'(type({value}) == string ? "\'" + {value} + "\'" : string(dyn({value})))'


def _spec_rules() -> list[dict]:
    """On `spec`. Every field is guarded with has(): the API server also checks the rules
    against the schema's `{}` defaults."""
    rules = [_rule("has(self.registry) && size(self.registry) > 0", validation.registry_missing)]
    for component, prerequisites in PREREQUISITES.items():
        for prerequisite in prerequisites:
            rules.append(
                _rule(
                    f"!{_deployed(component)} || {_deployed(prerequisite)}",
                    lambda c=component, p=prerequisite: validation.dependency_problem(c, p),
                )
            )
    return rules


def _driver_rules() -> list[dict]:
    """On `driver`. Turning on the virtualised firmware is not refused here: the CR cannot know
    which firmware a GPU runs (the seed's upgrade of virtualised firmware sets fwEnableVirt with
    PreferCloud in one patch); the warn policy says it (`warning_validations`)."""
    return [
        _rule(
            "!(has(self.deploy) && self.deploy) || (has(self.deployPolicy) && self.deployPolicy == 'Never')"
            " || (has(self.payload) && has(self.payload.version) && size(self.payload.version) > 0)",
            validation.payload_version_missing,
        ),
        _rule(
            "!(has(self.deploy) && self.deploy) || !(has(self.deployPolicy) && self.deployPolicy == 'Never')"
            " || !(has(self.fwUpgradePolicy) && self.fwUpgradePolicy == 'PreferCloud')",
            validation.firmware_without_payload,
        ),
    ]


def _service_rules(node: dict) -> list[dict]:
    """On `exporter.service` (its CRD schema `node`)."""
    kind = "(has(self.type) ? self.type : 'ClusterIP')"
    external = "(has(self.externalName) && size(self.externalName) > 0)"
    ports = "(has(self.nodePortRange) ? self.nodePortRange : '')"
    is_range = f"{ports}.matches({regex(node['properties']['nodePortRange']['pattern'])})"
    low, high = f"int({ports}.split('-')[0])", f"int({ports}.split('-')[1])"
    backwards = f"({low} > {high} || {high} > 65535)"
    with_port = ", ".join(f"'{t}'" for t in validation.SERVICE_TYPES_WITH_PORT)
    return [
        _rule(f"!{is_range} || !{backwards}", validation.node_port_range_backwards, ports),
        _rule(
            f"!{is_range} || {backwards} || {kind} != 'NodePort' || !has(self.port) || self.port > 65535"
            f" || ({low} <= self.port && self.port <= {high})",
            validation.node_port_outside_range,
            "self.port",
            ports,
        ),
        _rule(f"!has(self.port) || {kind} in [{with_port}]", validation.port_with_type, kind),
        _rule(f"{kind} != 'ExternalName' || {external}", validation.external_name_missing),
        _rule(f"{kind} == 'ExternalName' || !{external}", validation.external_name_with_type, kind),
    ]


def _cel_name(key: str) -> str:
    """A property name as CEL reads it (`vfio-manager` is `vfio__dash__manager`)."""
    return key.replace("_", "__underscores__").replace("-", "__dash__").replace(".", "__dot__")


def _seed_spelling_rules() -> dict[tuple[str, ...], list[dict]]:
    """The seed's spellings in the spec (seed_spellings.cr_problems), each rule on the deepest
    node holding both spellings: a whole component refused, a single field where it disagrees
    with the chart's key."""
    rules: dict[tuple[str, ...], list[dict]] = {}
    for seed, key in SEED_SPELLINGS.items():
        common = len(os.path.commonprefix([seed, key]))
        s, k = seed_spellings.dotted(seed), seed_spellings.dotted(key)
        if len(seed) - common != 1 or common == len(key):
            raise ValueError(f"contract.SEED_SPELLINGS: {s} is not one key beside {k}")
        given = f"self.{_cel_name(seed[-1])}"
        if len(key) == 1:  # a whole component
            rule = _rule(f"!has({given})", lambda s=s, k=k: seed_spellings.whole_component_in_cr(s, k))
        else:
            have = _has("self", *map(_cel_name, key[common:]))
            ours = "self." + ".".join(map(_cel_name, key[common:]))
            rule = _rule(
                f"!has({given}) || ({have} && {given} == {ours})",
                lambda a, b, s=s, k=k: seed_spellings.conflict(s, a, k, b, s, k),
                given,
                ours,  # unset: the messageExpression fails and the API server says `message`
            )
        rules.setdefault(seed[:common], []).append(rule)
    return rules


def crd_rules(spec: dict, *, full: bool) -> dict[tuple[str, ...], list[dict]]:
    """The CRD's `x-kubernetes-validations`, by the spec path of the node that carries them
    (`spec`: the CRD's spec schema, for the single-field checks). `full`: with validate's lines
    as messageExpressions and the single-field checks (for FULL_CRD_MINOR and later); else the
    portable rules every API server with CEL admits, each with its static `message`."""
    upgrade_policy = spec["properties"]["driver"]["properties"]["upgradePolicy"]
    rules = {
        (): _spec_rules(),
        ("driver",): _driver_rules(),
        ("driver", "upgradePolicy"): _policy_rules(upgrade_policy, full),
        ("driver", "upgradePolicy", "upgradeSteps"): _steps_rules(upgrade_policy["properties"]["upgradeSteps"], full),
        ("exporter", "service"): _service_rules(spec["properties"]["exporter"]["properties"]["service"]),
    }
    for path, extra in _seed_spelling_rules().items():
        rules[path] = rules.get(path, []) + extra
    if not full:
        rules = {path: [{k: v for k, v in r.items() if k != "messageExpression"} for r in node] for path, node in rules.items()}
    return rules


# --- the ValidatingAdmissionPolicy ----------------------------------------------------------------

TEMPLATE = "templates/admission/validatingadmissionpolicy.yaml"
#: The ValidatingAdmissionPolicy APIs the chart renders the policy with, the first one the API
#: server serves: v1 from Kubernetes 1.30; v1beta1 on 1.28 and 1.29, where a site turned it on
#: (feature gate ValidatingAdmissionPolicy, runtime-config admissionregistration.k8s.io/v1beta1).
POLICY_API_VERSIONS = ("admissionregistration.k8s.io/v1", "admissionregistration.k8s.io/v1beta1")
VAP_API = f"{POLICY_API_VERSIONS[0]}/ValidatingAdmissionPolicy"
_PLACEHOLDER = "@@0@@"


def frozen_during_rollout(field: str, phase: str) -> UserError:
    return UserError(
        field,
        f"cannot change while a driver rollout is in progress (phase {phase})",
        "only driver.upgradePolicy.pause and driver.upgradePolicy.enableRollout can: let the rollout "
        "finish, or set enableRollout: false to roll it back, then change the field",
    )


def frozen_changes(old: dict, new: dict) -> list[str]:
    """The fields of spec `new` that differ from spec `old` and may not change while a driver
    rollout is in progress, named and ordered as the policy's `variables.changed` names them (the
    changed and added keys of each level, then its removed ones)."""
    changed = []
    for path, skip in FREEZE_LEVELS:
        new_map, old_map = _mapping(lookup(new, *path)), _mapping(lookup(old, *path))
        prefix = _field_prefix(path)
        changed += [prefix + k for k in new_map if k not in skip and (k not in old_map or new_map[k] != old_map[k])]
        changed += [prefix + k for k in old_map if k not in skip and k not in new_map]
    return changed


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _field_prefix(path: tuple[str, ...]) -> str:
    """How the refusal names a field below `path` (`driver.upgradePolicy.` for that level)."""
    return "".join(f"{key}." for key in path)


def virt_firmware_warning() -> UserError:
    return UserError(
        "driver.fwEnableVirt",
        "turned on with driver.fwUpgradePolicy PreferCloud: driver-manager upgrades GPUs to the "
        "virtualised firmware, which is supported only where they run virtualised firmware already "
        "(mx-smi --show-vbios on the node: SRIOV Support), never from non-virtualised firmware",
        "on servers with non-virtualised firmware set fwEnableVirt back to false, or set "
        "fwUpgradePolicy: Never and flash the virtualised firmware by hand on a server model that supports it",
    )


def vfio_firmware_warning() -> UserError:
    return UserError(
        "driver.fwUpgradePolicy",
        "PreferCloud does not upgrade the firmware of GPUs bound to vfio-pci "
        "(vfioManager.vfioConfig): their firmware stays as it is",
        "to upgrade them, remove them from vfioManager.vfioConfig for the upgrade",
    )


def _pause_duration_pattern() -> str:
    choices = fragment("driver", "upgradePolicy", "upgradeSteps")["items"]["properties"]["pauseDuration"]["anyOf"]
    return next(c["pattern"] for c in choices if "pattern" in c)


def _changed(new: str, old: str, prefix: str, skip: tuple[str, ...]) -> str:
    """CEL: the keys (as `prefix` + key) whose values differ between maps `new` and `old`."""
    kept = " && ".join(f"k != '{key}'" for key in skip) or "true"
    return (
        f"{new}.filter(k, {kept} && (!(k in {old}) || {new}[k] != {old}[k])).map(k, '{prefix}' + k)"
        f" + {old}.filter(k, {kept} && !(k in {new})).map(k, '{prefix}' + k)"
    )


def _map_at(root: str, *path: str) -> str:
    """CEL: the map at `root`.`path`, or {} where a level is missing."""
    guard = _has(root, *path)
    return f"({guard} ? {root}.{'.'.join(path)} : {{}})"


def policy_variables() -> list[dict]:
    """The policy's variables after `runnerUser` (the runner's user name, from the template)."""
    status = "oldObject.status.upgradeStatus"
    return [
        {
            "name": "steps",
            "expression": f"({_has('object', 'spec', 'driver', 'upgradePolicy', 'upgradeSteps')}"
            " ? object.spec.driver.upgradePolicy.upgradeSteps : [])",
        },
        # In progress: the runner's status says so (`upgrading`: phase Progressing, Terminating or
        # Disabling). The runner's own writes (pause, the rollback of spec.driver) pass.
        {
            "name": "upgrading",
            "expression": f"request.operation == 'UPDATE' && {_has('oldObject', 'status', 'upgradeStatus', 'upgrading')}"
            f" && {status}.upgrading == true && request.userInfo.username != variables.runnerUser",
        },
        {
            "name": "changed",
            "expression": " + ".join(
                _changed(
                    _map_at("object", "spec", *path),
                    _map_at("oldObject", "spec", *path),
                    _field_prefix(path),
                    skip,
                )
                for path, skip in FREEZE_LEVELS
            ),
        },
    ]


def policy_validations() -> list[dict]:
    """The validations of the deny policy (see the module's docstring)."""
    steps = "variables.steps"
    indices = _indices(fragment("driver", "upgradePolicy", "upgradeSteps")["maxItems"])
    step = f"{steps}[i]"
    both = f"has({step}.pause) && has({step}.pauseDuration)"
    duration = f"{step}.pauseDuration"
    bad_duration = (
        f"has({duration}) && {duration} != null && !(type({duration}) == map && size({duration}) == 0)"
        f" && !(type({duration}) == int && {duration} >= 0)"
        f" && !(type({duration}) == string && {duration}.matches({regex(_pause_duration_pattern())}))"
    )

    def check(bad: str, text: str) -> dict:
        return {
            "expression": f"!{indices}.exists(i, i < size({steps}) && {bad})",
            "messageExpression": _first(indices, f"size({steps})", bad, text),
        }

    return [
        {**validation, "reason": "Invalid"}  # 422, as the CRD's rules (else 403)
        for validation in (
            check(both, message(lambda i: policy.pause_with_duration(f"{STEPS}[{i}]"), "i")),
            check(bad_duration, message(_schema_error("pauseDuration", True), "i", _shown(duration))),
            {
                "expression": "!variables.upgrading || size(variables.changed) == 0",
                "messageExpression": message(
                    frozen_during_rollout, "variables.changed[0]", "oldObject.status.upgradeStatus.phase"
                ),
            },
        )
    ]


def warning_validations() -> list[dict]:
    """The validations of the warn policy: allowed, but said (kubectl prints `Warning: ...`)."""
    firmware = f"{_has('object', 'spec', 'driver', 'fwUpgradePolicy')} && object.spec.driver.fwUpgradePolicy == 'PreferCloud'"
    vfio = (
        f"{_has('object', 'spec', 'vfioManager', 'deploy')} && object.spec.vfioManager.deploy == true"
        f" && has(object.spec.vfioManager.vfioConfig) && size(object.spec.vfioManager.vfioConfig) > 0"
    )
    virt = lambda obj: f"{_has(obj, 'spec', 'driver', 'fwEnableVirt')} && {obj}.spec.driver.fwEnableVirt == true"  # noqa: E731
    turned_on = f"request.operation == 'UPDATE' && {virt('object')} && !({virt('oldObject')})"
    spellings = [
        {"expression": f"!({_has('object', 'spec', *map(_cel_name, seed))})", "message": str(seed_spellings.cr_notice(seed, key))}
        for seed, key in SEED_SPELLINGS.items()
        if len(key) > 1  # a whole component in the seed's spelling is refused (crd_rules)
    ]
    return spellings + [
        {
            "expression": f"!({firmware} && {vfio})",
            "message": str(vfio_firmware_warning()),
        },
        {
            "expression": f"!({firmware} && {turned_on})",
            "message": str(virt_firmware_warning()),
        },
    ]


def _policy(name: str, variables: list[dict], validations: list[dict], action: str) -> str:
    """One ValidatingAdmissionPolicy and its binding, as template text (name: a template expression)."""
    import yaml

    match = {
        "resourceRules": [
            {"apiGroups": [CR_GROUP], "apiVersions": [CR_VERSION], "operations": ["CREATE", "UPDATE"], "resources": [CR_PLURAL]}
        ]
    }
    body = yaml.safe_dump(
        {"failurePolicy": "Fail", "matchConstraints": match, "variables": variables, "validations": validations},
        sort_keys=False,
        width=1000,
    )
    assert "{{" not in body, "a CEL expression would read as a template action"
    spec = "\n".join("  " + line for line in body.splitlines())
    return f"""---
apiVersion: {{{{ $api }}}}
kind: ValidatingAdmissionPolicy
metadata:
  {{{{- include "metax-operator.metadata" (merge (dict "name" {name}) $ctx) | nindent 2 }}}}
spec:
{spec}
---
apiVersion: {{{{ $api }}}}
kind: ValidatingAdmissionPolicyBinding
metadata:
  {{{{- include "metax-operator.metadata" (merge (dict "name" {name}) $ctx) | nindent 2 }}}}
spec:
  policyName: {{{{ {name} }}}}
  validationActions: [{action}]
"""


def render_template(generated_note: str) -> str:
    """templates/admission/validatingadmissionpolicy.yaml, headed by `generated_note`."""
    runner = {
        "name": "runnerUser",
        "expression": "{{ printf \"'system:serviceaccount:%s:%s-runner'\" .Release.Namespace "
        '(include "metax-operator.fullname" .) | quote }}',
    }
    runner_line = f"  - name: {runner['name']}\n    expression: {runner['expression']}\n"
    deny = _policy("$name", policy_variables(), policy_validations(), "Deny")
    deny = deny.replace("  variables:\n", "  variables:\n" + runner_line, 1)
    warn = _policy('(printf "%s-warnings" $name)', [], warning_validations(), "Warn")
    warn = warn.replace("  variables: []\n", "")
    return f"""{{{{- /* {generated_note}
The API server's half of the cross-field rules that CRD rules cannot express (docs/hooks.md,
"Admission"); installed with the first of {", ".join(POLICY_API_VERSIONS)} the API server serves. */}}}}
{{{{- include "metax-operator.seedSpellings" . -}}}}
{{{{- $api := "" }}}}
{{{{- range $version := list {" ".join(f'"{v}"' for v in POLICY_API_VERSIONS)} }}}}
{{{{- if and (not $api) ($.Capabilities.APIVersions.Has (printf "%s/ValidatingAdmissionPolicy" $version)) }}}}
{{{{- $api = $version }}}}
{{{{- end }}}}
{{{{- end }}}}
{{{{- if $api }}}}
{{{{- $name := printf "%s-{CR_NAME}" (include "metax-operator.fullname" .) }}}}
{{{{- $ctx := dict "root" $ "key" "admission" "clusterScoped" true }}}}
{deny}{warn}{{{{- end }}}}
"""
