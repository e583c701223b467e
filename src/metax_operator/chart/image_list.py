"""`metax-operator images`: every image the values make the cluster pull, offline.

    metax-operator images [-f FILE]... [--set K=V]... [--set-string K=V]... [--set-json K=JSON]...
                          [--set-literal K=V]... [--set-file K=FILE]... [--output text|json]
                          [--chart DIR] [--helm PATH]

The list is read from the chart as Helm renders it for the values (`helm template`, hooks and the
`helm test` pod included): the image of every container and init container of every object. So
it holds each component, the tools image (the runner, the hook Jobs, the test pod, the wait-for
init containers) and the payloads (the driver's and each MXMACA image: the driver and maca pods
pull them as init containers, and the runner sets those from the same values), and it cannot
drift from the templates. A reference carries its digest where the values pin one
(`registry/name:tag@sha256:…`, images.reference).

The values are checked first, as `metax-operator validate` checks them (the same problems, the
same one line each). Output: `text`, one reference per line, sorted (what a mirroring script
reads); `json`, `{"images": [{"reference", "repository", "tag", "digest", "pulledBy"}]}`,
`pulledBy` naming `Kind/name/container` for each place the image runs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import yaml

from metax_operator.chart import images, validate
from metax_operator.errors import UserErrors

#: The lists of a pod spec whose entries are containers with an image.
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "images", help="list every image the values make the cluster pull (offline)", description=__doc__.splitlines()[0]
    )
    validate.add_values_arguments(parser)
    parser.add_argument("--output", choices=("text", "json"), default="text", help="text (default, one per line) or json")
    parser.set_defaults(func=run)


def run(args) -> int:
    chart = validate.chart_dir(args.chart)
    helm = validate.find_helm(args.helm)
    with tempfile.TemporaryDirectory(prefix="metax-images-") as tmp:
        files, sets = validate.values_flags(args, Path(tmp))
        flags = [*files, *sets]
        errors = validate.problems(chart, helm, flags)
        if errors:
            raise UserErrors(errors)
        pulled = pulled_images(yaml.safe_load_all(validate.render(chart, flags, helm)))
    if args.output == "json":
        listed = []
        for ref, where in sorted(pulled.items()):
            repository, tag, digest = images.split(ref)
            listed.append({"reference": ref, "repository": repository, "tag": tag, "digest": digest, "pulledBy": where})
        print(json.dumps({"images": listed}, indent=2))
    else:
        print("\n".join(sorted(pulled)))
    return 0


def pulled_images(objects) -> dict[str, list[str]]:
    """Each image the objects' pods run -> the `Kind/name/container`s running it."""
    pulled: dict[str, list[str]] = {}
    for obj in objects:
        if not isinstance(obj, dict):
            continue
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        for container in _containers(obj):
            pulled.setdefault(container["image"], []).append(f"{where}/{container.get('name')}")
    return pulled


def _containers(node):
    """Every container of a pod spec anywhere in `node` (a Pod's, a workload's pod template, a
    CronJob's job template)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in CONTAINER_LISTS and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict) and "image" in c)
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)
