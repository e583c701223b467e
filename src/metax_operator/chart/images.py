"""Image references: the one format the chart and the runner write, and its inverse.

    <registry>/<name>[:<tag>][@<digest>]

The chart's `metax-operator.image` helper (templates/_helpers.tpl) renders this format for every
image it runs, and the runner's reconcile builds the driver and MXMACA payload references with
`reference`; tests/chart/test_images.py renders the chart and checks the two agree. A digest, when
given, is what the container runtime pulls; the tag stays in the reference for the people
reading it (`kubectl get pods -o wide`) and is ignored for the pull.

The grammar is the distribution project's (github.com/distribution/reference): the schema
(schema_source.yaml) checks each part; what it cannot check alone, that `registry/name` (the
repository) is at most MAX_REPOSITORY characters, is a rule of `validation.image_problems` and of
templates/_validations.tpl.
"""

from __future__ import annotations

#: The longest repository (`registry/name`) the distribution reference grammar accepts.
MAX_REPOSITORY = 255


def reference(registry: str, name: str, tag: str = "", digest: str = "") -> str:
    """`registry/name[:tag][@digest]`, as the chart renders it."""
    ref = f"{registry}/{name}"
    if tag:
        ref += f":{tag}"
    if digest:
        ref += f"@{digest}"
    return ref


def split(ref: str) -> tuple[str, str, str]:
    """(repository, tag, digest) of a reference (tag and digest "" when absent)."""
    repository, _, digest = ref.partition("@")
    slash, colon = repository.rfind("/"), repository.rfind(":")
    if colon > slash:  # a colon before the last slash is a registry port
        repository, tag = repository[:colon], repository[colon + 1 :]
    else:
        tag = ""
    return repository, tag, digest
