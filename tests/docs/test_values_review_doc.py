"""docs/values-review.md does what it says, with the real tools, in a GitOps repository made of
the page's own snippets (each block is marked, tests/doc_blocks.py):

- the pre-commit hook: the page's `.pre-commit-config.yaml` (its `repo` and `rev` pointed at a
  commit of this working tree) and commands, run by the real `pre-commit` (PyPI), which installs
  the package from that commit as it would from the published repository; a good commit passes,
  the page's broken HelmRelease is refused with the page's error lines and no commit is made;
- the CI forms: the page's plain shell commands and the `run:` steps of its GitHub Actions job,
  with this repository as the `.metax-operator` submodule the job checks out;
- the editor's schema: every values file in examples/ and in the page names values.schema.json in
  its `yaml-language-server` modeline, and passes `check-jsonschema` (PyPI) and `validate`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.doc_blocks import blocks, unmarked_code_blocks
from tests.helm import BIN, CHART

PAGE = CHART / "docs" / "values-review.md"
BLOCKS = blocks(PAGE)
KINDS = {"values", "manifest", "manifest-bad", "pre-commit-config", "shell", "refusal", "github-workflow"}
MODELINE = "# yaml-language-server: $schema="
VENV_BIN = Path(sys.executable).parent
#: Where the page's snippets say the chart's repository is checked out in the GitOps repository.
CHECKOUT = ".metax-operator"


def the(kind: str, *args: str) -> str:
    found = [b.text for b in BLOCKS if b.kind == kind and b.args == args]
    assert len(found) == 1, f"{PAGE} has {len(found)} `{kind} {' '.join(args)}` blocks, not one"
    return found[0]


def files(kind: str) -> dict[str, str]:
    """The page's snippets of `kind`: the path each names in the GitOps repository, its text."""
    return {b.args[0]: b.text for b in BLOCKS if b.kind == kind}


def test_every_code_block_is_marked_for_checking():
    assert unmarked_code_blocks(PAGE) == []
    assert {b.kind for b in BLOCKS} == KINDS


def run(command: list[str] | str, cwd: Path, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    """`command` (a string: a bash script, stopped by its first failure) in `cwd`."""
    if isinstance(command, str):
        command = ["bash", "-euo", "pipefail", "-c", command]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if check and result.returncode:
        pytest.fail(f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}", pytrace=False)
    return result


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """A user's environment: Helm 3.18 in $HELM_BIN, this venv's pre-commit and check-jsonschema on
    PATH, a git identity, pre-commit's cache in a directory of its own."""
    home = tmp_path_factory.mktemp("home")
    return {
        **os.environ,
        "HELM_BIN": str(BIN / "helm3"),
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "PRE_COMMIT_HOME": str(home / "pre-commit"),
        "HOME": str(home),
        "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip")),
        "GIT_AUTHOR_NAME": "admin",
        "GIT_AUTHOR_EMAIL": "admin@example.com",
        "GIT_COMMITTER_NAME": "admin",
        "GIT_COMMITTER_EMAIL": "admin@example.com",
    }


@pytest.fixture(scope="module")
def hook_source(tmp_path_factory, env) -> tuple[Path, str]:
    """This working tree (its tracked and new files, as they are now) committed in a repository of
    its own: what the page's `repo:` and `rev:` name. Returns the repository and the commit."""
    source = tmp_path_factory.mktemp("metax-operator")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=CHART,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (CHART / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CHART / name, source / name)
    run(["git", "init", "-q", "-b", "main"], source, env)
    run(["git", "add", "-A"], source, env)
    run(["git", "commit", "-q", "-m", "metax-operator"], source, env)
    return source, run(["git", "rev-parse", "HEAD"], source, env).stdout.strip()


def gitops_repository(path: Path, env: dict) -> Path:
    """A GitOps repository holding the page's good snippets, committed."""
    path.mkdir()
    run(["git", "init", "-q", "-b", "main"], path, env)
    for name, text in {**files("values"), **files("manifest")}.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    (path / "clusters" / "namespace.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: metax}\n")
    return path


def break_release(repo: Path, env: dict) -> None:
    """The page's broken HelmRelease, staged."""
    ((name, text),) = files("manifest-bad").items()
    assert name in files("manifest"), "the broken release replaces one of the page's good files"
    (repo / name).write_text(text)
    run(["git", "add", name], repo, env)


def refusal() -> list[str]:
    return the("refusal").splitlines()


#: The two tests that build a GitOps repository's own Python environments (pre-commit's, the CI
#: job's virtualenv), each installing the package and its dependencies from the package index:
#: about three minutes of a worker, the GitOps tier's (`make e2e`).
ENVIRONMENTS = pytest.mark.e2e


@ENVIRONMENTS
def test_pre_commit_passes_a_good_commit_and_refuses_a_bad_helm_release(tmp_path, env, hook_source):
    source, commit = hook_source
    repo = gitops_repository(tmp_path / "gitops", env)
    config = yaml.safe_load(the("pre-commit-config"))
    assert [hook["id"] for hook in config["repos"][0]["hooks"]] == [
        hook["id"] for hook in yaml.safe_load((CHART / ".pre-commit-hooks.yaml").read_text())
    ]
    config["repos"][0].update(repo=str(source), rev=commit)  # the page's repository and version: this tree
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    run(["git", "add", "-A"], repo, env)

    result = run(the("shell", "pre-commit"), repo, env)  # pre-commit install; pre-commit run --all-files
    assert "metax-operator values" in result.stdout and "Passed" in result.stdout, result.stdout
    result = run(["git", "commit", "-m", "three clusters"], repo, env)
    assert "metax-operator values" in result.stdout + result.stderr
    head = run(["git", "rev-parse", "HEAD"], repo, env).stdout

    break_release(repo, env)
    result = run(["git", "commit", "-m", "driver 3.0"], repo, env, check=False)
    assert result.returncode == 1
    output = (result.stdout + result.stderr).splitlines()
    assert [line for line in output if line.startswith("error:")] == refusal()
    assert run(["git", "rev-parse", "HEAD"], repo, env).stdout == head, "the refused commit was made"


@pytest.fixture
def ci_repository(tmp_path, env, hook_source) -> Path:
    """The GitOps repository as the page's CI job checks it out: with this repository as the
    `.metax-operator` submodule."""
    source, _ = hook_source
    repo = gitops_repository(tmp_path / "gitops", env)
    run(["git", "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(source), CHECKOUT], repo, env)
    run(["git", "add", "-A"], repo, env)
    run(["git", "commit", "-q", "-m", "three clusters"], repo, env)
    return repo


@ENVIRONMENTS
def test_the_ci_forms_pass_the_good_files_and_annotate_the_bad_helm_release(ci_repository, env):
    repo = ci_repository
    shell = the("shell", "ci")  # a venv in the repository, pip install of the checkout, validate
    result = run(shell, repo, env)
    checked = result.stdout.splitlines()
    assert [line.split(": ")[0].rsplit(":", 2)[0] for line in checked] == sorted(files("values") | files("manifest"))
    assert all(line.endswith(": values are valid") for line in checked)

    break_release(repo, env)
    validate = shell.splitlines()[-1]
    assert " validate " in validate
    result = run(validate, repo, env, check=False)  # the check again (the venv is there)
    assert result.returncode == 1
    assert result.stderr.splitlines() == refusal()

    # The GitHub Actions job's `run:` steps, in the job's Python environment (the `uses:` steps
    # set it up: the checkout with its submodule is the repository above, Helm is $HELM_BIN).
    workflow = yaml.safe_load(the("github-workflow"))
    steps = [step["run"] for job in workflow["jobs"].values() for step in job["steps"] if "run" in step]
    job_env = {**env, "PATH": f"{repo / '.venv-metax' / 'bin'}:{env['PATH']}"}
    for step in steps[:-1]:
        run(step, repo, job_env)
    result = run(steps[-1], repo, job_env, check=False)
    assert result.returncode == 1
    annotations = [line for line in result.stdout.splitlines() if line.startswith("::")]
    expected = []
    for line in refusal():
        name, line_number, column, message = line.removeprefix("error: ").split(":", 3)
        message = message.strip().replace("%", "%25")
        expected.append(f"::error file={name},line={line_number},col={column},title=metax-operator validate::{message}")
    assert annotations == expected


def modeline_schema(text: str, place: Path, root: Path) -> Path:
    """The schema a file's modeline names, the file being at `place` (the path from `root`)."""
    first = text.splitlines()[0]
    assert first.startswith(MODELINE), f"{place}: the first line is not the `{MODELINE}...` modeline"
    return ((root / place).parent / first.removeprefix(MODELINE)).resolve()


def values_files(tmp_path: Path) -> list[Path]:
    """examples/ and the page's values snippets, the snippets at their paths in a GitOps repository
    whose `.metax-operator` is this repository; each modeline names this repository's schema."""
    repo = tmp_path / "gitops"
    (repo / CHECKOUT).parent.mkdir(parents=True)
    (repo / CHECKOUT).symlink_to(CHART)
    found = sorted((CHART / "examples").glob("*.yaml"))
    for name, text in files("values").items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
        found.append(repo / name)
    assert len(found) > len(files("values")) >= 1
    for path in found:
        assert modeline_schema(path.read_text(), path, Path("/")) == (CHART / "values.schema.json").resolve()
    return found


def test_examples_and_the_page_values_pass_check_jsonschema_and_validate(tmp_path, env):
    found = values_files(tmp_path)
    result = run(["check-jsonschema", "--schemafile", CHART / "values.schema.json", *found], tmp_path, env)
    assert "ok -- validation done" in result.stdout
    # the examples are rollout policies: the registry and driver version come from the user's own values
    result = run(
        [
            "metax-operator",
            "validate",
            *found,
            "--set",
            "registry=cr.example.com/metax",
            "--set-string",
            "driver.payload.version=2.32.0.6",
        ],
        tmp_path,
        env,
    )
    assert len(result.stdout.splitlines()) == len(found)
    # the page's own check-jsonschema command, in the GitOps repository
    result = run(the("shell", "check-jsonschema"), tmp_path / "gitops", env)
    assert "ok -- validation done" in result.stdout


def test_check_jsonschema_refuses_what_the_editor_would_mark(tmp_path, env):
    """The schema check can fail: the broken release's values, as a values file with the modeline."""
    ((_, text),) = files("manifest-bad").items()
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(yaml.safe_load(text)["spec"]["values"]))
    result = run(["check-jsonschema", "--schemafile", CHART / "values.schema.json", bad], tmp_path, env, check=False)
    assert result.returncode == 1
    assert "$.driver.payload.version: 3.0 is not of type 'string'" in result.stdout
    assert "$.driver.upgradePolicy.upgradeSteps[1].replicas" in result.stdout
