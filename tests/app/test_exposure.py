"""Exposure: the app listens on 127.0.0.1 by default; remote code stays off unless asked for, loudly."""

from __future__ import annotations

import inspect
import re
import tomllib

from kvlens.cli import main
from kvlens.engine.models import load_model
from tests.conftest import ROOT, TEXTS


def test_app_binds_to_loopback_by_default():
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^HOST \?= 127\.0\.0\.1$", makefile, re.M)
    assert "--server.address $(HOST)" in makefile


def test_remote_code_is_off_by_default_and_loud_when_on(capsys):
    assert inspect.signature(load_model).parameters["trust_remote_code"].default is False
    code = main(
        [
            "ppl",
            "--policy",
            "full",
            "--text-file",
            str(TEXTS / "1961-Kennedy.txt"),
            "--model",
            "/nonexistent/dir",
            "--trust-remote-code",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "WARNING: --trust-remote-code is on" in err
