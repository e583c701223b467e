"""What the hook commands share: the values file and the API options."""

from __future__ import annotations

import argparse
from pathlib import Path

from metax_operator.contract import GPU_NODE_LABEL, HOOK_VALUES_FILE
from metax_operator.errors import UserError
from metax_operator.runtime import kube
from metax_operator.yamltext import load_one, read_text

CRD_API_VERSION = "apiextensions.k8s.io/v1"


def add_api_arguments(parser: argparse.ArgumentParser, namespace: bool = True) -> None:
    kube.add_arguments(parser)
    if namespace:
        parser.add_argument("--namespace", required=True, help="the release namespace")


def add_values_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--values",
        "-f",
        default=HOOK_VALUES_FILE,
        type=Path,
        help=f"the release's values, JSON or YAML (default: {HOOK_VALUES_FILE})",
    )


def load_values(path: Path) -> dict:
    """The values document (the hook ConfigMap holds them as JSON, a YAML document)."""
    text = read_text(path, "mount the hook values ConfigMap or pass --values FILE")
    values = load_one(text, str(path))
    if not isinstance(values, dict):
        raise UserError(str(path), "must hold a mapping of values", "pass the chart's values")
    return values


def gpu_nodes(nodes: list[dict]) -> list[dict]:
    """The nodes gpu-label labelled as having MetaX GPUs."""
    return [n for n in nodes if (n["metadata"].get("labels") or {}).get(GPU_NODE_LABEL) == "true"]
