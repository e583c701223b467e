"""The harness starts kwok again only when kwok dies of its own startup race; any other death of
kwok is raised. A stand-in kwok (a script reading the harness's kwok config) dies as told on its
first start and serves its health endpoint on the next."""

from __future__ import annotations

import sys
import time

import pytest

from tests.controlplane import KWOK_STARTUP_RACE, ControlPlane, ControlPlaneError

STAND_IN = f"""#!{sys.executable}
import http.server, os, pathlib, sys, yaml
config = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--config="))
options = next(d for d in yaml.safe_load_all(open(config)) if d.get("kind") == "KwokConfiguration")["options"]
starts = pathlib.Path(os.environ["STAND_IN_STARTS"])
starts.write_text(str(int(starts.read_text() or 0) + 1) if starts.exists() else "1")
if starts.read_text() == "1":
    print(os.environ["STAND_IN_FIRST_DEATH"], flush=True)
    sys.exit(2)
host, port = options["serverAddress"].rsplit(":", 1)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

http.server.HTTPServer((host, int(port)), Health).serve_forever()
"""


@pytest.fixture
def plane(tmp_path, monkeypatch):
    kwok = tmp_path / "kwok"
    kwok.write_text(STAND_IN)
    kwok.chmod(0o755)
    stages = tmp_path / "kwok-stages"
    stages.mkdir()
    for name in ("pod-ready", "pod-delete"):
        (stages / f"{name}.yaml").write_text("{}\n")
    monkeypatch.setenv("STAND_IN_STARTS", str(tmp_path / "starts"))
    plane = ControlPlane(workdir=tmp_path / "cluster")
    plane.workdir.mkdir()
    monkeypatch.setattr(plane, "binary", lambda name: {"kwok": kwok, "kwok-stages": stages}[name])
    yield plane
    plane.stop()


def test_kwok_dead_of_its_startup_race_is_started_again(plane, monkeypatch, tmp_path):
    monkeypatch.setenv("STAND_IN_FIRST_DEATH", KWOK_STARTUP_RACE)
    plane._start_kwok(time.monotonic() + 30)
    assert plane.components["kwok"].process.poll() is None
    assert (tmp_path / "starts").read_text() == "2"


def test_any_other_death_of_kwok_is_raised_with_its_log(plane, monkeypatch, tmp_path):
    monkeypatch.setenv("STAND_IN_FIRST_DEATH", "failed to install crd: forbidden")
    with pytest.raises(ControlPlaneError, match=r"kwok exited with status 2 \(failed to install crd: forbidden\)"):
        plane._start_kwok(time.monotonic() + 30)
    assert (tmp_path / "starts").read_text() == "1"
