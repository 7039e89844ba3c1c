"""The examples/ decoders (Flax Linen and NNX, `rm.linen.MoE` / `rm.nnx.MoE` under scan and remat on a 2 data × 4
expert Explicit mesh) train: a few steps, finite losses that fall."""

import importlib.util
import math
import pathlib

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
