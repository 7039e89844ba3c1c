"""The README's two commands, in order, in one directory: `relaymoe-train` (shortened) leaves `runs/cpu` there, and
the tests run after it still pass (the one that once failed on it: an earlier run where a test expected none)."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # trains (~40 s on 2 cores), then a test in its own pytest; CI's second step runs it
def test_the_tests_pass_after_relaymoe_train_in_the_same_directory(tmp_path):
  train = subprocess.run([sys.executable, "-m", "train.cli", "steps=20", "tensorboard=false"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=_env())
  assert train.returncode == 0, train.stderr[-2000:]
  assert (tmp_path / "runs" / "cpu" / "run_config.json").exists()
  tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{REPO}/tests/test_train_safety.py::test_cli_errors_are_one_line"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_env())
  assert tests.returncode == 0, tests.stdout[-3000:]
  assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["runs"]  # nothing beside it


def _env():
  return dict(os.environ, XLA_FLAGS="", PYTHONPATH=str(REPO))
