"""The `metax-operator` entry point: every subcommand is registered by the module COMMANDS names."""

import argparse
import importlib
import os
import subprocess
import sys

from metax_operator import cli
from tests.helm import BIN


def test_commands_name_the_module_that_registers_each_subcommand():
    for command, module in cli.COMMANDS.items():
        subparsers = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"metax_operator.{module}").register(subparsers)
        assert command in subparsers.choices, f"metax_operator.{module} does not register {command!r}"


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "metax_operator.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in cli.COMMANDS:
        assert command in out.stdout


def test_a_command_imports_only_its_own_module():
    code = "import sys; from metax_operator import cli; cli.build_parser(['validate']);print('kubernetes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_user_error_is_one_line_and_exit_status_1(tmp_path):
    values = tmp_path / "v.yaml"
    values.write_text("driver: {deployPolicy: Sometimes}\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "metax_operator.cli",
            "validate",
            "-f",
            str(values),
            "--set",
            "registry=r.example/metax",
            "--set-string",
            "driver.payload.version=1",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HELM_BIN": str(BIN / "helm3")},
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and "driver.deployPolicy" in out.stderr
    assert "Traceback" not in out.stderr
