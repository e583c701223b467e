"""What the runner owns on an object it applies (server-side apply, field manager
`metax-operator-runner`): whether an apply would change anything (`needs_write`), the smallest
partial object that keeps what it owns and adds what is missing (`minimal`), and the fields a
manager owns (`owned_fields`, from `metadata.managedFields`).

Owning no more than it must keeps the runner out of Helm's way: a field it co-owned at an equal
value would make the next server-side `helm upgrade` (Helm 4) that changes it conflict. Fields it
owns stay in every apply, or the API server would remove them.
"""

from __future__ import annotations

import json
from typing import Any

from metax_operator.chart.daemonset import covers, item_names, pod_of
from metax_operator.contract import RUNNER_FIELD_MANAGER


def needs_write(desired: dict, live: dict) -> bool:
    """Whether applying `desired` would change anything.

    Write when the live object lacks a desired value, or when the runner still owns a field it no
    longer wants (an apply without it lets the API server remove it). A field Helm rendered with
    the same value (after a post-rendered install) needs no write.
    """
    owned = owned_fields(live, RUNNER_FIELD_MANAGER)
    return not covers(live.get("spec"), desired["spec"]) or not covers(desired["spec"], owned.get("spec"))


def minimal(desired: dict, live: dict) -> dict:
    """`desired` cut to the fields the live object lacks plus those the runner already owns.

    Owning no more than it must keeps the runner out of Helm's way: a field it co-owned at an
    equal value would make the next server-side `helm upgrade` (Helm 4) that changes it conflict.
    Owned fields stay in, or the API server would remove them.
    """
    want, have = desired["spec"]["template"]["spec"], pod_of(live)
    owned_spec = owned_fields(live, RUNNER_FIELD_MANAGER).get("spec") or {}
    owned = pod_of({"spec": owned_spec})
    pod = {
        f: v
        for f, v in want.items()
        if f not in ("containers", "initContainers") and (f in owned or not covers(have.get(f), v, f))
    }
    for kind in ("containers", "initContainers"):
        live_items = {c["name"]: c for c in have.get(kind) or []}
        owned_items = {c.get("name"): c for c in owned.get(kind) or []}
        items = []
        for item in want.get(kind) or []:
            live_item, owned_item = live_items.get(item["name"], {}), owned_items.get(item["name"], {})
            kept = {}
            if "image" in item and ("image" in owned_item or live_item.get("image") != item["image"]):
                kept["image"] = item["image"]
            env = [
                e
                for e in item.get("env") or []
                if e["name"] in item_names(owned_item.get("env")) or not covers(live_item.get("env"), [e])
            ]
            if env:
                kept["env"] = env
            if kept:
                items.append({"name": item["name"], **kept})
        if items:
            pod[kind] = items
    spec: dict[str, Any] = {"template": {"spec": pod}}
    strategy = desired["spec"].get("updateStrategy")
    if strategy is not None and (
        "updateStrategy" in owned_spec or not covers((live.get("spec") or {}).get("updateStrategy"), strategy)
    ):
        spec["updateStrategy"] = strategy
    return {**desired, "spec": spec}


def owned_fields(obj: dict, manager: str) -> dict:
    """The part of `obj` that `manager` owns by apply (its managedFields entry projected on obj)."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            return _project(obj, entry.get("fieldsV1") or {})
    return {}


def _project(value: Any, fields: dict) -> Any:
    """`value` restricted to a fieldsV1 set: `f:` fields, `k:` keyed items, `v:` set values."""
    if not fields:
        return value
    if isinstance(value, dict):
        return {
            name[2:]: _project(value[name[2:]], sub)
            for name, sub in fields.items()
            if name.startswith("f:") and name[2:] in value
        }
    if isinstance(value, list):
        out = []
        for name, sub in fields.items():
            if name.startswith("k:"):
                key = json.loads(name[2:])
                out += [
                    _project(item, sub)
                    for item in value
                    if isinstance(item, dict) and all(item.get(k) == v for k, v in key.items())
                ]
            elif name.startswith("v:") and json.loads(name[2:]) in value:
                out.append(json.loads(name[2:]))
        return out
    return value
