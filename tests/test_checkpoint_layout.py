"""A checkpoint resumes only into the layout it was saved from: with the loss-free router bias
(`model.router_bias_update_rate`) switched on or off in between, the restore is refused before any array is read,
naming the bias array (docs/training.md: "a checkpoint without it does not resume with it, and the reverse, naming
the array")."""

import jax
import jax.numpy as jnp
import pytest

from models.qwen3 import model as qwen3
from models.qwen3.config import load_config
from relaymoe_jax.errors import UserError
from train.config import MeshConfig
from train.mesh import build_mesh
from train.rundir.checkpoints import Checkpoints


def _state(rate, mesh):
  config = load_config("tiny", num_hidden_layers=1, router_bias_update_rate=rate)
  abstract = qwen3.abstract(config, mesh)[1]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), abstract.to_pure_dict())


@pytest.mark.parametrize("saved, resumed", [(0.01, 0.0), (0.0, 0.01)], ids=["bias-then-none", "none-then-bias"])
def test_resuming_across_a_router_bias_change_is_refused_naming_the_array(tmp_path, saved, resumed):
  mesh = build_mesh(MeshConfig(data=1, expert=1), jax.devices()[:1])
  with Checkpoints(tmp_path / "checkpoints", 2) as checkpoints:
    checkpoints.save(1, _state(saved, mesh), {"step": 1})
  with Checkpoints(tmp_path / "checkpoints", 2) as checkpoints:
    assert jax.tree.structure(checkpoints.restore(_state(saved, mesh))[0]) == jax.tree.structure(_state(saved, mesh))
    with pytest.raises(UserError, match=r"does not fit this model's parameters.*router_bias_E"):
      checkpoints.restore(_state(resumed, mesh))
