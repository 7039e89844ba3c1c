"""Which tile kernels context-parallel attention uses, and (on a GPU) cuDNN's tiles against causal attention."""

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from models.attention import cudnn
from models.attention.context_parallel import XLA_TILES, context_attention
from models.attention.cudnn import CUDNN_TILES, tile_kernels
from models.sharding import MESH_AXES
from train.config import RunConfig
from train.plan import search as plan_search


def test_xla_tiles_where_cudnn_cannot_attend(caplog):
  assert tile_kernels("auto", "cpu", jnp.bfloat16) is XLA_TILES
  assert tile_kernels("xla", "gpu", jnp.bfloat16) is XLA_TILES
  with caplog.at_level(logging.WARNING):
    assert tile_kernels("auto", "gpu", jnp.float32) is XLA_TILES
  assert "takes bfloat16 or float16, not float32" in caplog.text


def test_heads_wider_than_cudnn_takes_get_xla_tiles(monkeypatch, caplog):
  """JAX's cuDNN check refuses heads over 128 unless it sees a Hopper (Qwen3.5's attention has 256): under context
  parallelism "auto" then takes XLA's tiles with a warning, "cudnn" says why; before, the tile call raised JAX's
  NotImplementedError inside the step."""
  monkeypatch.setattr(cudnn, "jax_cudnn", type("JaxCudnn", (), dict(
      _dot_product_attention_bwd_p_wrapper=None, check_cudnn_version=staticmethod(lambda: 90800),
      check_compute_capability=staticmethod(lambda capability: False))))
  with caplog.at_level(logging.WARNING):
    assert tile_kernels("auto", "gpu", jnp.bfloat16, 256) is XLA_TILES
  assert "heads of at most 128, a multiple of 8, not 256" in caplog.text
  with pytest.raises(ValueError, match="not 256"):
    tile_kernels("cudnn", "gpu", jnp.bfloat16, 256)
  assert tile_kernels("auto", "gpu", jnp.bfloat16, 128) is CUDNN_TILES
  monkeypatch.setattr(cudnn.jax_cudnn, "check_compute_capability", staticmethod(lambda capability: True))
  assert tile_kernels("auto", "gpu", jnp.bfloat16, 256) is CUDNN_TILES  # a Hopper takes 256
  assert tile_kernels("auto", "gpu", jnp.bfloat16, 100) is XLA_TILES


def test_compiling_for_another_hosts_gpus_the_checks_see_their_compute_capability(monkeypatch):
  """`relaymoe-plan --topology` from a CPU host: JAX's cuDNN checks read this host's GPU (none: no Hopper, heads of
  at most 128, no packed layout); inside `checks_see(target)` they read the target's, and after it their own again.
  `search` compiles inside it (mutant killed: the search's `checks_see` dropped)."""
  if cudnn.jax_cudnn is None:
    pytest.skip("this JAX has no cuDNN attention module")
  own = cudnn.jax_cudnn.check_compute_capability
  hopper, ampere = (types.SimpleNamespace(platform="gpu", compute_capability=c) for c in ("9.0", "8.0"))
  with cudnn.checks_see(hopper):
    assert cudnn.max_head_dim() == 256 and cudnn.jax_cudnn.check_compute_capability("9.0")
    assert cudnn.jax_cudnn.is_cuda_compute_capability_equal("9.0")
  with cudnn.checks_see(ampere):
    assert cudnn.max_head_dim() == 128
  with cudnn.checks_see(None):  # this host's own devices
    assert cudnn.jax_cudnn.check_compute_capability is own
  assert cudnn.jax_cudnn.check_compute_capability is own and cudnn.max_head_dim() == (256 if own("9.0") else 128)

  seen = []
  planner = types.SimpleNamespace(plan=lambda: seen.append(cudnn.max_head_dim()))
  monkeypatch.setattr(plan_search, "make_planner", lambda *_, **__: planner)
  run = types.SimpleNamespace(run_config=RunConfig(model="tiny"), model_config=None,
                              mesh=types.SimpleNamespace(shape={"data": 1, "expert": 1, "tensor": 1}))
  plan_search.search(run, variants=("ring",), devices=[hopper], log=lambda *_: None)
  assert seen == [256]


def test_asking_for_cudnn_where_it_cannot_attend_names_why():
  with pytest.raises(ValueError, match="attention_implementation='cudnn' under context parallelism: the devices are "
                                       "cpu, not GPUs"):
    tile_kernels("cudnn", "cpu", jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [CUDNN_TILES, XLA_TILES], ids=lambda k: k.name)
def test_tiles_on_a_gpu_attend_as_causal_attention(kernels):
  """bf16 inputs, output and the gradients of q, k and v against float32 causal attention of the same inputs
  (within 2e-2 relative: bfloat16 keeps 8 bits). One device holds the sequence's two chunks; tiles of 256 rows make
  8 query tiles, each with its diagonal pair and up to 7 key tiles before it, merged by their logsumexp."""
  if jax.default_backend() != "gpu" or kernels is CUDNN_TILES and tile_kernels("auto", "gpu", jnp.bfloat16) is XLA_TILES:
    pytest.skip("cuDNN tiles attend on a GPU with cuDNN; run `pytest -m gpu` there")
  mesh = jax.make_mesh((1, 1, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:1])
  rng = np.random.default_rng(5)
  q, k, v, do = (jnp.asarray(rng.normal(size=(2, 2048, h, 128)), jnp.bfloat16) for h in (8, 2, 2, 8))
  scale = 128 ** -0.5

  def tiled(q, k, v):
    return context_attention(q, k, v, mesh=mesh, scale=scale, kernels=kernels, tile=256)

  def whole(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="xla")

  out, vjp = jax.vjp(jax.jit(tiled), q, k, v)
  as_f32 = [a.astype(jnp.float32) for a in (q, k, v, do)]
  ref_out, ref_vjp = jax.vjp(jax.jit(whole), *as_f32[:3])
  assert out.dtype == jnp.bfloat16
  for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *vjp(do)), (ref_out, *ref_vjp(as_f32[3]))):
    assert_close(g.astype(jnp.float32), r, 2e-2, name)
