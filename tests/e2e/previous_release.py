"""The previous release as a site has it: the newest release CHANGELOG.md names with its commit,
made again from that commit (`git archive`): its chart packaged and pushed by the real helm, its
tools image built by that commit's own image build (image/build.py of the commit) and pushed.

Until the next `scripts/release bump`, the previous release and this working tree carry one
version, so one chart tag and one tools image tag would name two releases. So the previous chart
goes to a repository of its own (`oci://HOST/previous/metax/metax-operator`), and its tools image into
the tools image's repository under the tag `VERSION-COMMIT` (12 hex digits), installed pinned by
digest (`tools.image.digest`, as a site that pins its images does): by tag alone, the real node
would run whichever image it pulled first under that tag.

The image is built as root into `$METAX_CACHE/previous-release/COMMIT` (the commit's build keeps
its own Debian base, wheels and builds there, and leaves this tree's cache alone), so a warm run
only checks it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from release import versions
from tests import registry
from tests.controlplane import CACHE, REPO
from tests.helm import BIN

#: What makes a release: the chart and the package its image runs.
RELEASED = ("Chart.yaml", "values.yaml", "values.schema.json", "templates", "crds", "files", "src", "image")
PREVIOUS = "previous"  # the registry path the previous chart goes under, before registry.PROJECT


@dataclass(frozen=True)
class Release:
    version: str
    commit: str
    chart: str  # oci://HOST/previous/metax/metax-operator
    digest: str  # its tools image's manifest digest, pushed into HOST/metax/metax-operator-tools
    tree: Path  # its files (git archive)


def previous() -> versions.Entry:
    """The newest release CHANGELOG.md records a commit for (a release being made has none yet)
    that is not this tree (right after a release is recorded, the one before it)."""
    entries = versions.Repo(REPO).entries().values()
    found = next((e for e in entries if e.version != "Unreleased" and e.commit and not _is_this_tree(e.commit)), None)
    assert found is not None, "CHANGELOG.md records no released commit other than this tree: nothing to upgrade from"
    return found


def _is_this_tree(commit: str) -> bool:
    """Whether the commit's chart and package are this working tree's."""
    diff = ["git", "-C", str(REPO), "diff", "--quiet", commit, "--", *RELEASED]
    return subprocess.run(diff, capture_output=True).returncode == 0


def extract(commit: str, dest: Path) -> Path:
    """The commit's tree in `dest`, as `git archive COMMIT` gives it."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def build_image(tree: Path, commit: str) -> dict[str, str]:
    """The commit's tools image by the commit's own build (its image/build.py, run by this tree's
    .venv, whose build tools pyproject pins; the build keys its cache on their versions);
    {layout, reference, digest}. The tree has no git history: the build time is the commit's."""
    show = ["git", "-C", str(REPO), "show", "-s", "--format=%ct", commit]
    epoch = subprocess.run(show, capture_output=True, text=True, check=True)
    done = subprocess.run(
        [str(REPO / ".venv/bin/python"), str(tree / "image/build.py"), "build"],
        capture_output=True,
        text=True,
        cwd=tree,
        env={
            **os.environ,
            "METAX_CACHE": str(CACHE / "previous-release" / commit),
            "SOURCE_DATE_EPOCH": epoch.stdout.strip(),
            "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the tree the build hashes
        },
    )
    assert done.returncode == 0, f"the image build of {commit[:12]} failed:\n{done.stderr[-3000:]}"
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def publish(cluster, work: Path) -> Release:
    """The previous release in the cluster's registry, as its site pushed it: the chart by `helm
    package` and `helm push`, the tools image by `skopeo copy`."""
    entry = previous()
    tree = extract(entry.commit, work / "tree")
    image = build_image(tree, entry.commit)
    host = cluster.cp.registry
    target = f"{host}/{registry.PROJECT}/{registry.TOOLS_IMAGE}:{entry.version}-{entry.commit[:12]}"
    registry.push_image(Path(image["layout"]), image["reference"].rsplit(":", 1)[1], target, cluster.cp.ca)
    chart = registry.push_chart(BIN / "helm3", tree, f"{host}/{PREVIOUS}", cluster.cp.ca, work / "chart")
    return Release(entry.version, entry.commit, chart, image["digest"], tree)
