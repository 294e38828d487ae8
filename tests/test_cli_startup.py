"""`hybridflow` answers help and file errors without importing torch, transformers or ray (issue 16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "ray")

_PROBE = """
import contextlib, io, json, sys
from hybridflow.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exit:
        code = exit.code
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                  "heavy": [name for name in ("torch", "transformers", "ray") if name in sys.modules]}))
"""


def _probe(*argv: str) -> dict:
    result = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, cwd=REPO,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=True)
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["sft", "--help"], ["rm", "--help"],
                                  ["export", "--help"]])
def test_help_imports_no_heavy_library(argv):
    result = _probe(*argv)
    assert result["code"] == 0 and "usage: hybridflow" in result["out"]
    assert result["heavy"] == []


def test_a_malformed_or_missing_config_file_is_reported_without_importing_torch(tmp_path):
    (tmp_path / "bad.yaml").write_text("trainer: [\n")
    result = _probe("train", str(tmp_path / "bad.yaml"))
    assert result["code"] == 2 and result["heavy"] == []
    assert result["err"] == (f"hybridflow train: error: config file {tmp_path / 'bad.yaml'}:2:1: YAML syntax error: "
                             f"expected the node content, but found '<stream end>' (while parsing a flow node at "
                             f"line 2)\n")
    result = _probe("sft", str(tmp_path / "absent.yaml"))
    assert result["code"] == 2 and result["heavy"] == []
    assert result["err"] == f"hybridflow sft: error: config file '{tmp_path / 'absent.yaml'}' does not exist\n"
