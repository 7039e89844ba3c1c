"""The examples/ decoders (Flax Linen and NNX, `rm.linen.MoE` / `rm.nnx.MoE` under scan and remat on a 2 data × 4
expert Explicit mesh) train: a few steps, finite losses that fall."""

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import requires_devices

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # ~11-14 s each; the default run reached 10.3 min on CI's 2 cores; CI's second step runs it
@pytest.mark.parametrize("name", ["linen_decoder", "nnx_decoder"])
def test_example_trains(name):
  requires_devices(8)
  losses = _load(name).train(steps=4)
  assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_examples_set_up_their_own_devices():
  """`python examples/NAME.py` as the README says, in a fresh process with no XLA_FLAGS or NPROC: each example
  makes the 8 emulated CPU devices its 2 × 4 mesh needs (imported, not run: the training is the slow test above)."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC", "JAX_PLATFORMS")}
  check = ("import runpy, sys, jax; runpy.run_path(sys.argv[1]); "
           "print(jax.device_count(), __import__('os').environ['NPROC'])")
  for name in ("linen_decoder", "nnx_decoder"):
    result = subprocess.run([sys.executable, "-c", check, str(EXAMPLES / f"{name}.py")], env=dict(
        env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["8", "256"], (name, result.stdout)
