"""Nothing silently wrong around the held-out loss, the router bias, the load metrics and the profile: each input
that cannot work is one line before anything compiles, each number is the right one (issue 49)."""

import json
import math
import struct

import pytest
from tensorboardX.proto import event_pb2

from models.qwen3.config import load_config
from models.qwen35.config import load_config as load_qwen35_config
from relaymoe_jax.errors import UserError
from train.metrics import MetricsLog


def tensorboard_scalars(directory):
  scalars = {}
  for path in directory.rglob("events*"):
    data = path.read_bytes()
    while data:
      (length,) = struct.unpack("<Q", data[:8])
      event = event_pb2.Event.FromString(data[12:12 + length])
      data = data[12 + length + 4:]
      scalars |= {(event.step, v.tag): v.simple_value for v in event.summary.value}
  return scalars


def test_tensorboard_worst_layer_is_the_worst_layer_not_a_sum(tmp_path):
  log = MetricsLog(tmp_path, total_steps=4, start_step=0, tensorboard=True, moe_layers=[0, 1, 2])
  log.write(dict(step=1, dead_experts=[2, 5, 1], dropped_pairs=[0, 7, 3], expert_load_cv=[0.1, 0.4, 0.2]))
  log.close()
  scalars = tensorboard_scalars(tmp_path / "tensorboard")
  assert scalars[(1, "moe/dead_experts_worst_layer")] == 5
  assert scalars[(1, "moe/dropped_pairs_worst_layer")] == 7
  assert scalars[(1, "moe/expert_load_cv_worst_layer")] == pytest.approx(0.4)


@pytest.mark.parametrize("rate", [math.inf, math.nan, -0.1])
@pytest.mark.parametrize("load", [load_config, load_qwen35_config], ids=["qwen3", "qwen35"])
def test_a_router_bias_rate_that_is_not_finite_is_named(load, rate):
  with pytest.raises(UserError, match=f"^router_bias_update_rate={rate} must be finite and ≥ 0"):
    load("tiny" if load is load_config else "qwen3.5-tiny", router_bias_update_rate=rate)
