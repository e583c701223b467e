"""Bad input to every command ends in one `error:` line and exit status 1, never a traceback.

Every command `metax-operator --help` lists (and every `rollout` subcommand) is fed: an unknown
option; where it reads a file, one that is not UTF-8; where it takes a number, nan and inf; where
it talks to the API server, a kubeconfig that does not exist and one whose server does not answer
(a closed port on loopback). The installed `metax-operator` script runs each, as a user would.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from metax_operator import cli
from metax_operator.commands import rollout as rollout_cli
from tests.helm import CHART

SCRIPT = Path(sys.executable).with_name("metax-operator")
NOT_UTF8 = b"registry: caf\xe9\n"
UNREACHABLE = {
    "apiVersion": "v1",
    "kind": "Config",
    "current-context": "c",
    "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
    "users": [{"name": "u", "user": {"token": "t"}}],
    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
}


def commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command path (the top-level commands, and the subcommands of those that have them)
    and its parser."""
    out = {}
    for name, sub in _choices(cli.build_parser()).items():
        nested = _choices(sub)
        out.update({(name, child): parser for child, parser in nested.items()} if nested else {(name,): sub})
    return out


def _choices(parser: argparse.ArgumentParser) -> dict:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


# What each command that reaches the API server needs besides the kubeconfig. (`{values}`,
# `{crd}`: files the fixture writes.)
API_ARGS = {
    ("preflight",): ["--values", "{values}"],
    ("upgrade-crds",): ["--crd", "{crd}"],
    ("bootstrap",): ["--values", "{values}", "--release", "metax"],
    ("rollback-hold",): ["--namespace", "metax-operator"],
    ("cleanup",): ["--namespace", "metax-operator"],
    ("test",): ["--namespace", "metax-operator"],
    ("run",): ["--namespace", "metax-operator", "--once"],
    ("wait-for",): ["--namespace", "metax-operator", "--node", "n1", "--component", "gpuLabel"],
    ("rollout", "status"): [],
    ("rollout", "pause"): [],
    ("rollout", "resume"): [],
    ("rollout", "undo"): [],
    ("nodes",): [],
    ("gather",): [],
}
# A file argument given a file that is not UTF-8 (stdin for the post-renderer).
FILE_ARGS = {
    ("preflight",): ["--values", "{bad}"],
    ("upgrade-crds",): ["--crd", "{bad}"],
    ("bootstrap",): ["--values", "{bad}", "--release", "metax"],
    ("validate",): ["-f", "{bad}"],
    ("rollout", "simulate"): ["--nodes", "10", "--policy", "{bad}"],
    ("postrender",): [],
}
# A number argument given nan and inf (and a size too large to compute).
NUMBER_ARGS = {
    ("run",): ["--namespace", "x", "--interval", "{n}"],
    ("cleanup",): ["--namespace", "x", "--timeout", "{n}"],
    ("wait-for",): ["--namespace", "x", "--node", "n", "--component", "gpuLabel", "--timeout", "{n}"],
    ("rollout", "simulate"): ["--nodes", "10", "--policy", "{policy}", "--interval", "{n}"],
    ("rollout", "status"): ["--interval", "{n}"],
}
SIZES = [
    ["rollout", "simulate", "--nodes", "10000000", "--policy", "{policy}"],
    ["rollout", "simulate", "--nodes", "10", "--policy", "{policy}", "--ready-latency", "inf"],
    ["run", "--namespace", "x", "--lease-duration", str(10**30)],
]


def cases() -> list[tuple[str, list[str], bytes]]:
    out = [(f"{' '.join(c)}: unknown option", [*c, "--no-such-option"], b"") for c in commands()]
    for command, args in API_ARGS.items():
        for name, kubeconfig in (("missing", "{missing}"), ("unreachable", "{unreachable}")):
            out.append((f"{' '.join(command)}: {name} kubeconfig", [*command, *args, "--kubeconfig", kubeconfig], b""))
    for command, args in FILE_ARGS.items():
        out.append((f"{' '.join(command)}: not UTF-8", [*command, *args], NOT_UTF8))
    for command, args in NUMBER_ARGS.items():
        for n in ("nan", "inf", "-inf"):
            out.append((f"{' '.join(command)}: {n}", [*command, *[a.replace("{n}", n) for a in args]], b""))
    out += [(f"size: {' '.join(argv)}", argv, b"") for argv in SIZES]
    return out


CASES = cases()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cli-errors")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values.update(registry="cr.example.com/metax")
    values["driver"]["payload"]["version"] = "2.32.0.6"
    paths = {
        "values": tmp / "values.json",
        "bad": tmp / "bad.yaml",
        "policy": tmp / "policy.yaml",
        "unreachable": tmp / "unreachable.kubeconfig",
    }
    paths["values"].write_text(json.dumps(values))
    paths["bad"].write_bytes(NOT_UTF8)
    paths["policy"].write_text(yaml.safe_dump({"upgradePolicy": {"enableRollout": True, "upgradeSteps": [{"replicas": "100%"}]}}))
    paths["unreachable"].write_text(yaml.safe_dump(UNREACHABLE))
    return {
        **{k: str(v) for k, v in paths.items()},
        "missing": str(tmp / "missing.kubeconfig"),
        "crd": str(CHART / "crds" / "clusteroperators.gpu.metax-tech.com.yaml"),
    }


def test_every_command_has_an_unknown_option_case_and_every_api_command_kubeconfig_cases():
    assert {tuple(argv[:-1]) for name, argv, _ in CASES if name.endswith("unknown option")} == set(commands())
    assert len(commands()) == len(cli.COMMANDS) - 1 + len(rollout_cli.SUBCOMMANDS)
    takes_kubeconfig = {path for path, parser in commands().items() if "--kubeconfig" in parser._option_string_actions}
    assert takes_kubeconfig == set(API_ARGS)


@pytest.mark.parametrize("name, argv, stdin", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_and_exit_status_1(name, argv, stdin, files, tmp_path):
    argv = [arg.format(**files) if "{" in arg else arg for arg in argv]
    result = subprocess.run(
        [SCRIPT, *argv], input=stdin, capture_output=True, timeout=180, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    )
    err = result.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1 and err.splitlines()[-1] == errors[0], err
