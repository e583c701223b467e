"""`driver.upgradePolicy`: parsing, validation and each step's target and toleration (how many
nodes at once is the rollout's own rule: `rollout.budget`).

Seed 000 table 3.11 plus the knobs beyond it: `readinessTimeout`, `allowGpuWorkloads`, and the
node-safety ones (`cordon`, `waitForCompletion`, `drain`, `onTimeout`). `validate` is
shared with the chart's validation module and the runner: a pure function, no I/O, that
returns the parsed `Policy` or raises `UserErrors` with one `UserError` per problem.

The shape (fields, types, enums, ranges, the int-or-percent and duration grammars) is the values
schema's `driver.upgradePolicy`, checked here with that schema fragment; this module adds only
what a schema cannot say: the rules between fields and steps, the label selector's grammar, and
the last step against the number of nodes at run time.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from typing import Any, Mapping

from metax_operator.chart.problems import schema_problems
from metax_operator.chart.schema import fragment
from metax_operator.errors import UserError, UserErrors

DEFAULT_READINESS_TIMEOUT_MS = 600_000
DEFAULT_DRAIN_TIMEOUT_MS = 300_000
DEFAULT_VALIDATION_TIMEOUT_S = 600
#: The validation workload's resources when a CR leaves them out (values.yaml states the same).
DEFAULT_WORKLOAD_RESOURCES = {"limits": {"metax-tech.com/gpu": 1}}
# A label selector as the API server parses it: `k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
# `k notin (a,b)`, comma-separated (keys may carry a DNS prefix).
_SELECTOR_KEY = r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_SELECTOR_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SELECTOR_TERM = (
    rf"\s*(!\s*{_SELECTOR_KEY}|{_SELECTOR_KEY}\s*((==?|!=)\s*{_SELECTOR_VALUE}"
    rf"|\s(not)?in\s*\(\s*{_SELECTOR_VALUE}(\s*,\s*{_SELECTOR_VALUE})*\s*\))?)\s*"
)
_SELECTOR = re.compile(rf"{_SELECTOR_TERM}(,{_SELECTOR_TERM})*")
# ASCII digits and whole-string matches only: the grammar of the schema's patterns (Go regexp).
_PERCENT = re.compile(r"(0|[1-9][0-9]*)%")
_MILLISECONDS = re.compile(r"[0-9]+")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h))+")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


class Fallback(StrEnum):
    """`fallback`: what a step that failed beyond its retries leads to."""

    PAUSE = "pause"  # the runner pauses the rollout until the admin has fixed the nodes
    ROLLBACK = "rollback"  # back to the revision before the rollout


class OnTimeout(StrEnum):
    """`onTimeout`: what becomes of a node whose wait or drain ran out."""

    HOLD = "hold"  # out of the wave, uncordoned, its driver kept
    FAIL = "fail"  # counted failed, as a pod that never got Ready


@dataclass(frozen=True)
class IntOrPercent:
    """An int-or-percent value such as `5` or `"50%"`."""

    value: int
    percent: bool = False

    def of(self, total: int) -> int:
        """The absolute number for `total`: the int itself, or ceil(value% x total)."""
        return (self.value * total + 99) // 100 if self.percent else self.value

    def __str__(self) -> str:
        return f"{self.value}%" if self.percent else str(self.value)


@dataclass(frozen=True)
class Step:
    replicas: IntOrPercent
    pause_ms: int | None = None  # None: wait for the admin to set `pause: false`
    toleration: IntOrPercent = IntOrPercent(0)


@dataclass(frozen=True)
class Validation:
    """`validation`, when enabled: what a swapped node runs before it returns to service."""

    timeout_s: int = DEFAULT_VALIDATION_TIMEOUT_S
    workload_image: str = ""  # the administrator's own check; "" runs none
    workload_command: tuple[str, ...] = ()
    # JSON of the workload's resources (a frozen policy holds no dict)
    workload_resources: str = json.dumps(DEFAULT_WORKLOAD_RESOURCES, sort_keys=True)


class HealthSignal(StrEnum):
    """What the health gate compares the upgraded nodes with the others on (`healthGate`); the
    values are `maxRegression`'s keys."""

    NOT_READY = "notReady"  # the node is not Ready
    GPUS_UNAVAILABLE = "gpusUnavailable"  # fewer allocatable metax-tech.com/* devices than its capacity, or none
    RESTARTS = "restarts"  # its driver or gpu-device pod restarted a container since the step began
    FAILED_GPU_PODS = "failedGpuPods"  # a pod requesting metax-tech.com/* failed on it since the step began


@dataclass(frozen=True)
class HealthGate:
    """`healthGate`, when enabled: the percentage points by which the upgraded nodes' share
    showing each signal may exceed the others' before a step promotes."""

    max_regression: tuple[tuple[HealthSignal, int], ...] = tuple((s, 0) for s in HealthSignal)

    def allowed(self, signal: HealthSignal) -> int:
        return dict(self.max_regression)[signal]


@dataclass(frozen=True)
class Policy:
    enable_rollout: bool = False
    steps: tuple[Step, ...] = ()
    pause: bool = False
    max_parallel: IntOrPercent = IntOrPercent(100, True)
    max_unavailable: IntOrPercent = IntOrPercent(0)
    max_failure_threshold: int = 0
    fallback: Fallback = Fallback.PAUSE
    readiness_timeout_ms: int = DEFAULT_READINESS_TIMEOUT_MS
    allow_gpu_workloads: bool = False
    cordon: bool = True  # cordon a node while its driver pod is replaced
    wait_selector: str = ""  # a wave node's pods matching it must end before its driver is swapped
    wait_timeout_ms: int = 0  # 0: no limit
    drain: bool = False  # evict a wave node's GPU pods before its driver is swapped
    drain_timeout_ms: int = DEFAULT_DRAIN_TIMEOUT_MS
    on_timeout: OnTimeout = OnTimeout.HOLD  # a node whose wait or drain timed out
    validation: Validation | None = None  # None: a node is upgraded once its driver pod is Ready
    health_gate: HealthGate | None = None  # None: a step promotes once its pause is over
    # The raw mapping's step list, canonical, so a restart can tell whether it was edited.
    steps_key: str = field(default="", compare=False)
    # Where the policy is in the ClusterOperator: what the rollout's messages name.
    field: str = field(default="spec.driver.upgradePolicy", compare=False)

    def targets(self, nodes: int) -> list[int]:
        """Each step's target number of upgraded pods for `nodes` eligible pods.

        Percent rounded up, at least 1, capped at `nodes`, never below the previous step's.
        """
        out: list[int] = []
        for step in self.steps:
            own = min(nodes, max(1, step.replicas.of(nodes))) if nodes else 0
            out.append(max(own, out[-1] if out else 0))
        return out

    def tolerations(self, nodes: int) -> list[int]:
        """Failed pods each step allows: the int, or ceil(p% x the step's target)."""
        return [s.toleration.of(t) for s, t in zip(self.steps, self.targets(nodes), strict=True)]

    def last_step_problem(self, nodes: int) -> str | None:
        """Why the last step cannot upgrade all `nodes` pods (an int below N), or None."""
        return _short_last_step(self.steps[-1].replicas, nodes) if self.steps else None


def _short_last_step(last: IntOrPercent, nodes: int) -> str | None:
    if last.percent or last.value >= nodes:
        return None
    return f"the last step's replicas {last.value} is below the {nodes} eligible nodes, so the rest would never be upgraded"


def validate(policy: Any, field_prefix: str = "driver.upgradePolicy", nodes: int | None = None) -> Policy:
    """Parse and check an `upgradePolicy` mapping; defaults of seed table 3.11.

    `nodes`, when known (at run time), also checks that an int last step reaches every node.
    Raises `UserErrors` listing every problem, each naming its field path under `field_prefix`.
    """
    errors = problems(policy, field_prefix, nodes)
    if errors:
        raise UserErrors(errors)
    return build(policy or {})


def problems(policy: Any, field_prefix: str = "driver.upgradePolicy", nodes: int | None = None) -> list[UserError]:
    """The same checks as `validate`, returned as a list (empty when the policy is valid): the
    schema's, then the rules between fields wherever the shapes they read are right."""
    if policy is None:
        return []
    errors = schema_problems(policy, fragment("driver", "upgradePolicy"), field_prefix)
    if not isinstance(policy, Mapping):
        return errors
    path = field_prefix.rstrip(".")
    for key in ("waitForCompletion", "drain"):
        selector = (policy.get(key) or {}).get("podSelector", "") if isinstance(policy.get(key), Mapping) else ""
        if isinstance(selector, str) and selector and not _SELECTOR.fullmatch(selector):
            errors.append(
                UserError(
                    f"{path}.{key}.podSelector",
                    f"is not a label selector: {selector!r}",
                    'write a label selector such as "app=training" or "team in (ml,hpc)"',
                )
            )
    errors += _step_problems(policy.get("upgradeSteps"), f"{path}.upgradeSteps", policy.get("enableRollout") is True, nodes)
    return sorted(
        errors, key=lambda e: [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"[.\[\]]+", e.field)]
    )


def _step_problems(steps: Any, path: str, enabled: bool, nodes: int | None) -> list[UserError]:
    """The rules between steps: steps while the rollout is on, targets that never fall, a last
    step that reaches every node, a pause written two ways."""
    if steps is None or steps == []:
        return [empty_steps(path)] if enabled else []
    if not isinstance(steps, list):
        return []
    errors: list[UserError] = []
    previous: IntOrPercent | None = None
    for i, step in enumerate(steps):
        where = f"{path}[{i}]"
        if not isinstance(step, Mapping):
            previous = None
            continue
        replicas = _parse_int_or_percent(step.get("replicas"))
        if replicas and not (1 <= replicas.value <= (100 if replicas.percent else replicas.value)):
            replicas = None  # out of range: the schema's problem, not a target to compare
        if replicas and previous and replicas.percent == previous.percent and replicas.value < previous.value:
            errors.append(falling_replicas(where, replicas, previous))
        previous = replicas
        if i == len(steps) - 1 and replicas:
            if replicas.percent and replicas.value != 100:
                errors.append(last_step_short_percent(where, replicas))
            elif nodes is not None and (problem := _short_last_step(replicas, nodes)):
                errors.append(UserError(f"{where}.replicas", problem, 'set the last step\'s replicas to "100%"'))
        if "pause" in step and "pauseDuration" in step:
            errors.append(pause_with_duration(where))
    return errors


# The cross-field rules' wording, one function each: the CRD's CEL rules (admission.py) get their
# messages from these too, so the API server refuses with the line `validate` prints.


def empty_steps(path: str) -> UserError:
    return UserError(path, "is empty while enableRollout is true", 'add at least one step, the last with replicas: "100%"')


def falling_replicas(step: str, replicas: object, previous: object) -> UserError:
    """`step` is the step's path (`...upgradeSteps[1]`)."""
    return UserError(
        f"{step}.replicas",
        f"{replicas} is below the previous step's {previous}",
        "targets count upgraded pods in total, so make each step's replicas at least the previous one's",
    )


def last_step_short_percent(step: str, replicas: object) -> UserError:
    return UserError(
        f"{step}.replicas",
        f"the last step reaches only {replicas}",
        'set the last step\'s replicas to "100%" so every node is upgraded',
    )


def pause_with_duration(step: str) -> UserError:
    return UserError(
        f"{step}.pause",
        "is given together with pauseDuration",
        "keep only pauseDuration (empty or {} waits for the admin; milliseconds continue)",
    )


def build(raw: Mapping, where: str = "spec.driver.upgradePolicy") -> Policy:
    """The `Policy` of a mapping that passed `problems` (`validate` checks, then builds); `where`
    it is in the ClusterOperator."""
    steps = tuple(
        Step(
            replicas=_parse_int_or_percent(s["replicas"]),
            pause_ms=_pause_ms(s.get("pauseDuration"))[0],
            toleration=_parse_int_or_percent(s.get("toleration", 0)),
        )
        for s in raw.get("upgradeSteps") or ()
    )
    key = ";".join(f"{s.replicas}/{s.pause_ms}/{s.toleration}" for s in steps)
    readiness = _duration_ms(raw["readinessTimeout"])[0] if "readinessTimeout" in raw else DEFAULT_READINESS_TIMEOUT_MS
    return Policy(
        enable_rollout=raw.get("enableRollout", False),
        steps=steps,
        pause=raw.get("pause", False),
        max_parallel=_parse_int_or_percent(raw.get("maxParallel", "100%")),
        max_unavailable=_parse_int_or_percent(raw.get("maxUnavailable", 0)),
        max_failure_threshold=raw.get("maxFailureThreshold", 0),
        fallback=Fallback(raw.get("fallback", Fallback.PAUSE)),
        readiness_timeout_ms=readiness,
        allow_gpu_workloads=raw.get("allowGpuWorkloads", False),
        cordon=raw.get("cordon", True),
        wait_selector=(raw.get("waitForCompletion") or {}).get("podSelector", ""),
        wait_timeout_ms=_duration_ms((raw.get("waitForCompletion") or {}).get("timeout", 0))[0],
        drain=(raw.get("drain") or {}).get("enable", False),
        drain_timeout_ms=_duration_ms((raw.get("drain") or {}).get("timeout", DEFAULT_DRAIN_TIMEOUT_MS))[0],
        on_timeout=OnTimeout(raw.get("onTimeout", OnTimeout.HOLD)),
        validation=_validation(raw.get("validation") or {}),
        health_gate=_health_gate(raw.get("healthGate") or {}),
        steps_key=key,
        field=where,
    )


def _validation(raw: Mapping) -> Validation | None:
    if not raw.get("enable", False):
        return None
    workload = raw.get("workload") or {}
    return Validation(
        timeout_s=raw.get("timeoutSeconds", DEFAULT_VALIDATION_TIMEOUT_S),
        workload_image=workload.get("image", ""),
        workload_command=tuple(workload.get("command") or ()),
        workload_resources=json.dumps(workload.get("resources", DEFAULT_WORKLOAD_RESOURCES), sort_keys=True),
    )


def _health_gate(raw: Mapping) -> HealthGate | None:
    if not raw.get("enable", False):
        return None
    limits = raw.get("maxRegression") or {}
    return HealthGate(tuple((signal, limits.get(signal.value, 0)) for signal in HealthSignal))


def validation_asked(policy: Any) -> Validation | None:
    """The validation a policy asks for even where the rest of it is invalid: what the runner
    still honours when it cannot decide a pass (a node being validated stays cordoned)."""
    raw = policy.get("validation") if isinstance(policy, Mapping) else None
    if not isinstance(raw, Mapping) or raw.get("enable") is not True:
        return None
    timeout = raw.get("timeoutSeconds")
    return Validation(timeout_s=timeout if _is_int(timeout) and timeout >= 1 else DEFAULT_VALIDATION_TIMEOUT_S)


def _parse_int_or_percent(raw: Any) -> IntOrPercent | None:
    if _is_int(raw):
        return IntOrPercent(raw)  # the caller checks the range
    if isinstance(raw, str) and (m := _PERCENT.fullmatch(raw)):
        return IntOrPercent(int(m.group(1)), True)
    return None


def _pause_ms(raw: Any) -> tuple[int | None, str | None]:
    """(milliseconds or None for a manual pause, problem)."""
    if raw is None or raw == {} or raw == "":
        return None, None
    return _duration_ms(raw)


def _duration_ms(raw: Any) -> tuple[int | None, str | None]:
    if _is_int(raw):
        return (raw, None) if raw >= 0 else (None, f"must not be negative, not {raw}")
    if isinstance(raw, str):
        if _MILLISECONDS.fullmatch(raw):
            return int(raw), None
        if _DURATION.fullmatch(raw):  # exact arithmetic, rounded up: "0.3s" is 300 ms, "0.1ms" 1 ms
            total = sum(Fraction(n) * _UNIT_MS[u] for n, u in _DURATION_PART.findall(raw))
            return math.ceil(total), None
    return None, f'must be milliseconds or a duration such as "10s", not {raw!r}'


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
