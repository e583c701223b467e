"""The in-cluster commands' log lines: JSON or text, level and format from the options or from
$LOG_LEVEL and $LOG_FORMAT (the chart sets those from the `log` values), a bad value refused."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from metax_operator import cli, jsonlog


def log_two_events(capsys, monkeypatch, env: dict, *argv: str) -> list[str]:
    """Parse `argv` as the commands do, set up logging, log one info and one debug event."""
    for name in ("LOG_LEVEL", "LOG_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    jsonlog.add_arguments(parser)
    args = parser.parse_args(list(argv))
    try:
        jsonlog.setup(args.log_level, args.log_format)
        log = logging.getLogger("runner")
        jsonlog.event(log, "apply", daemonset="metax-driver", changed=["a b"], count=3)
        jsonlog.event(log, "detail", logging.DEBUG)
    finally:
        logging.getLogger().handlers[:] = []
        logging.getLogger().setLevel(logging.WARNING)
    return capsys.readouterr().err.splitlines()


def test_json_at_info_by_default(capsys, monkeypatch):
    (line,) = log_two_events(capsys, monkeypatch, {})
    record = json.loads(line)
    assert {k: record[k] for k in ("level", "logger", "action", "daemonset", "changed", "count")} == {
        "level": "info",
        "logger": "runner",
        "action": "apply",
        "daemonset": "metax-driver",
        "changed": ["a b"],
        "count": 3,
    }


def test_level_and_format_from_the_environment(capsys, monkeypatch):
    lines = log_two_events(capsys, monkeypatch, {"LOG_LEVEL": "debug", "LOG_FORMAT": "text"})
    assert len(lines) == 2
    assert lines[0].split(" ", 1)[1] == 'info runner apply daemonset=metax-driver changed=["a b"] count=3'
    assert lines[1].split(" ", 1)[1] == "debug runner detail"


def test_options_win_over_the_environment(capsys, monkeypatch):
    (line,) = log_two_events(
        capsys, monkeypatch, {"LOG_LEVEL": "debug", "LOG_FORMAT": "text"}, "--log-level", "info", "--log-format", "json"
    )
    assert json.loads(line)["action"] == "apply"


@pytest.mark.parametrize(
    "command", [["run", "--namespace", "x"], ["wait-for", "--namespace", "x", "--node", "n", "--component", "driver"]]
)
@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"LOG_LEVEL": "loud"}, "argument --log-level: 'loud' is not one of debug, info, warn, error"),
        ({"LOG_FORMAT": "xml"}, "argument --log-format: 'xml' is not one of json, text"),
    ],
)
def test_a_bad_value_in_the_environment_is_one_line_naming_it(capsys, monkeypatch, command, env, fragment):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(command) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and fragment in err, err
