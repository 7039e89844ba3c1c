"""The trainer with gradient accumulation and auxiliary-loss-free balancing: per-layer expert load in
metrics.jsonl and TensorBoard against the step's own counts, the router bias moved by hand's rule and kept in
checkpoints, and a zero rate changing nothing."""

import json

import jax
import numpy as np
import pytest

from conftest import tensorboard_events
from test_train import tiny_run, _eight_devices  # noqa: F401  (the trainer's fixtures)
from train.rundir.checkpoints import Checkpoints
from train.step import abstract_train_state
from train.loop import run
from train.mesh import build_mesh
from train.sources import model_config_for
from train.step import make_optimizer

RATE = 0.01
LISTS = ("expert_load_max", "expert_load_min", "expert_load_cv", "dead_experts", "router_entropy", "dropped_pairs")


def _events(directory):
  """Every TensorBoard value's (step, tag, kind) written under `directory`."""
  return [(e.step, v.tag, v.WhichOneof("value")) for e in tensorboard_events(directory) for v in e.summary.value]


@pytest.mark.slow  # trains two runs of its own (compiles ~1-2 min on 2 cores); CI's second step runs it
def test_accumulating_run_logs_expert_load_and_moves_the_router_bias(tmp_path):
  config = tiny_run(tmp_path, steps=3, batch_size=16, micro_batches=2, checkpoint_every=3, tensorboard=True,
                    model_overrides={"router_bias_update_rate": RATE})
  history = run(config)
  tokens = 16 * 16
  bias = np.zeros((2, 8), np.float32)
  for record in history:
    counts = np.asarray(record["expert_tokens"])
    assert counts.shape == (2, 8) and (counts.sum(1) == tokens * 2).all()  # pairs: tokens × top-k, per layer
    mean = counts.mean(1)
    np.testing.assert_allclose(record["expert_load_max"], counts.max(1) / mean, rtol=1e-6)
    np.testing.assert_allclose(record["expert_load_min"], counts.min(1) / mean, rtol=1e-6)
    np.testing.assert_allclose(record["expert_load_cv"], counts.std(1) / mean, rtol=1e-5)
    assert record["dead_experts"] == list((counts == 0).sum(1)) and record["dropped_pairs"] == [0, 0]
    assert all(0 < h <= np.log(8) for h in record["router_entropy"])
    bias = bias + RATE * np.sign(mean[:, None] - counts)
  logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert all(len(r[k]) == 2 for r in logged for k in LISTS) and "expert_tokens" not in logged[0]
  events = _events(tmp_path / "run" / "tensorboard")
  assert {(2, f"moe/tokens_per_expert/layer_{i}", "histo") for i in (0, 1)} <= set(events)
  assert (2, "moe/expert_load_cv_worst_layer", "simple_value") in events

  model_config = model_config_for(config)
  optimizer, _ = make_optimizer(config.optim, config.steps)
  _, abstract = abstract_train_state(model_config, config.runtime, build_mesh(config.mesh), optimizer)
  with Checkpoints(tmp_path / "run" / "checkpoints", 2) as checkpoints:
    state, _ = checkpoints.restore(abstract)
  stored = state.params["layers"][0]["stacked"]["mlp"]["router_bias_E"]
  np.testing.assert_allclose(np.asarray(stored), bias, atol=1e-7)
  assert np.any(bias)

  # At rate 0 the model has no bias at all, and its first step is the biased run's (whose bias starts at zero).
  plain = run(tiny_run(tmp_path / "plain", steps=1, batch_size=16, micro_batches=2, checkpoint_every=0))
  assert plain[0]["loss"] == history[0]["loss"] and plain[0]["expert_tokens"] == history[0]["expert_tokens"]
  _, plain_state = abstract_train_state(model_config_for(tiny_run(tmp_path)), config.runtime,
                                        build_mesh(config.mesh), optimizer)
  assert not any("router_bias" in jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_leaves_with_path(plain_state.params))
