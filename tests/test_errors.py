"""Bad input gets a UserError (a ValueError) that names the bad value; an error from JAX is a bug, never one."""

import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import relaymoe_jax as rm
from conftest import mesh_of, random_layer
from models.qwen3 import model as qwen3
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from relaymoe_jax.errors import UserError
from train.cli import main
import train.mesh

ARGS = ("x_TD", "idx_TK", "w_TK", "w_gate_EDF", "w_up_EDF", "w_down_EFD")


def _call(layer, mesh, **kw):
  return rm.moe_ffn(*(layer[a] for a in ARGS), mesh=mesh, **kw)


def _with(**changes):
  layer = random_layer(0, 32, 8, 12, 8, 2)
  layer.update({k: v(layer) for k, v in changes.items()})
  return layer


BAD = [
    ("E not divisible", dict(w_gate_EDF=lambda l: l["w_gate_EDF"][:6], w_up_EDF=lambda l: l["w_up_EDF"][:6],
                             w_down_EFD=lambda l: l["w_down_EFD"][:6]), {},
     "E=6 experts is not divisible by the size 4"),
    ("zero F", dict(w_gate_EDF=lambda l: l["w_gate_EDF"][..., :0], w_up_EDF=lambda l: l["w_up_EDF"][..., :0],
                    w_down_EFD=lambda l: l["w_down_EFD"][:, :0]), {},
     "x_TD's width D=8 and the experts' width F=0 (w_gate_EDF (8, 8, 0"),
    ("top_k > E", dict(idx_TK=lambda l: jnp.zeros((32, 9), jnp.int32), w_TK=lambda l: jnp.zeros((32, 9))), {},
     "top_k=9"),
    ("w_TK shape", dict(w_TK=lambda l: l["w_TK"][:, :1]), {}, "w_TK"),
    ("w_down shape", dict(w_down_EFD=lambda l: jnp.swapaxes(l["w_down_EFD"], 1, 2)), {}, "w_down_EFD"),
    ("x rank", dict(x_TD=lambda l: l["x_TD"][None]), {}, "x_TD"),
    ("float idx", dict(idx_TK=lambda l: l["idx_TK"].astype(jnp.float32)), {}, "idx_TK must hold integer"),
    ("dtype mismatch", dict(w_up_EDF=lambda l: l["w_up_EDF"].astype(jnp.bfloat16)), {}, "w_up_EDF"),
    ("unknown dispatcher", {}, dict(dispatcher="ring_sideways"), "unknown dispatcher 'ring_sideways'"),
    ("unknown option", {}, dict(dispatcher="ring_expert", capacity_factor=1.0), "capacity_factor"),
    ("missing expert axis", {}, dict(expert_axis="experts"), "expert_axis 'experts' is not an axis"),
    ("missing token axis", {}, dict(token_axes=("expert", "batch")), "token axis 'batch'"),
    ("bad capacity", {}, dict(dispatcher="all_to_all", capacity_factor=0.0), "capacity_factor=0.0"),
    ("bad backend", {}, dict(dispatcher="ring_expert", backend="cutlass"), "backend 'cutlass'"),
    ("zero chunk rows", {}, dict(dispatcher="ring_expert", chunk_rows=0), "chunk_rows=0"),
    ("fractional chunk rows", {}, dict(dispatcher="ring_expert", chunk_rows=3.5), "chunk_rows=3.5 must be a positive"),
    ("ascending ladder", {}, dict(dispatcher="ring_token", chunk_rows=(4, 16)), "descending tuple"),
    ("small row cap", {}, dict(dispatcher="ring_expert", max_chunk_rows=64), "max_chunk_rows=64 must be an int of "
                                                                          "at least 128"),
    ("fixed and capped chunks", {}, dict(dispatcher="auto", chunk_rows=256, max_chunk_rows=256),
     "chunk_rows=256 and max_chunk_rows=256: give one"),
    ("kept gate_up without recompute", {}, dict(dispatcher="ring_expert", keep_gate_up=True, recompute=False),
     "keep_gate_up=True needs recompute=True"),
]


@pytest.mark.parametrize("changes,kwargs,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_named(changes, kwargs, message):
  with pytest.raises(UserError, match=message.replace("(", r"\(")):
    _call(_with(**changes), mesh_of((4,), (rm.EXPERT,)), **kwargs)


@pytest.mark.parametrize("dispatcher", sorted(rm.DISPATCHERS))
@pytest.mark.parametrize("bad", [-1, 8, 2**31 - 1, -(2**31)])
def test_out_of_range_expert_id_is_named_eagerly(dispatcher, bad):
  """Concrete ids are checked before any dispatcher runs: the first bad one is named with its position."""
  layer = _with(idx_TK=lambda l: l["idx_TK"].at[3, 0].set(bad))
  with pytest.raises(ValueError, match=rf"idx_TK\[3, 0\] = {bad} is not an expert id in \[0, 8\)$"):
    _call(layer, mesh_of((4,), (rm.EXPERT,)), dispatcher=dispatcher)


def test_out_of_range_expert_ids_are_counted():
  layer = _with(idx_TK=lambda l: l["idx_TK"].at[5, 1].set(-3).at[9, 0].set(8).at[30, 1].set(100))
  with pytest.raises(ValueError, match=r"idx_TK\[5, 1\] = -3 .* \(and 2 more\)"):
    _call(layer, mesh_of((4,), (rm.EXPERT,)))


def test_constant_expert_ids_are_checked_under_jit():
  """Inside the caller's jit, ids closed over as a constant are still concrete, so still checked."""
  layer = _with(idx_TK=lambda l: l["idx_TK"].at[0, 1].set(-1))
  mesh = mesh_of((4,), (rm.EXPERT,))
  step = jax.jit(lambda x: rm.moe_ffn(x, *(layer[a] for a in ARGS[1:]), mesh=mesh))
  with pytest.raises(ValueError, match=r"idx_TK\[0, 1\] = -1"):
    step(layer["x_TD"])


def test_route_rejects_integer_tokens():
  with pytest.raises(ValueError, match="floating-point x_TD; got dtype int32"):
    rm.route(jnp.ones((4, 3), jnp.int32), jnp.ones((3, 8)), top_k=2)


def test_route_rejects_tokens_of_no_width():
  with pytest.raises(UserError, match=r"router_DE \[D, E\], D ≥ 1; got \(4, 0\) and \(0, 8\)"):
    rm.route(jnp.ones((4, 0)), jnp.ones((0, 8)), top_k=2)


@pytest.mark.parametrize("sizes,message", [
    (dict(d_ff=0), "d_ff=0: must be ≥ 1"), (dict(d_ff=-4, shared_d_ff=-1), "d_ff=-4, shared_d_ff=-1: must be ≥ 1"),
    (dict(d_model=0), "d_model=0: must be ≥ 1")])
@pytest.mark.parametrize("layer", ["linen", "nnx"])
def test_the_layers_refuse_a_size_below_one(layer, sizes, message):
  """Named before any parameter is made: a width of 0 divided by zero in the initializer, a negative one failed
  inside MLIR."""
  kwargs = dict(dict(num_experts=4, top_k=2, d_ff=8, mesh=mesh_of((4,), (rm.EXPERT,))), **sizes)
  d_model = kwargs.pop("d_model", 8)
  with pytest.raises(UserError, match=f"^{message}"):
    if layer == "nnx":
      rm.nnx.MoE(d_model, rngs=nnx.Rngs(0), **kwargs)
    else:
      rm.linen.MoE(**kwargs).init(jax.random.key(0), jnp.ones((8, d_model)))


@pytest.mark.parametrize("layer", ["linen", "nnx"])
def test_the_layers_name_a_mesh_without_the_expert_axis_under_set_mesh_too(layer):
  """JAX's `Resource axis: expert of P('expert', None, None) is not found in mesh` was what a Linen layer said under
  `jax.set_mesh`."""
  with jax.set_mesh(mesh_of((4,), ("experts",))), pytest.raises(
      UserError, match=r"^expert_axis 'expert' is not an axis of the mesh \('experts',\)"):
    if layer == "nnx":
      rm.nnx.MoE(8, rngs=nnx.Rngs(0), num_experts=4, top_k=2, d_ff=8)
    else:
      rm.linen.MoE(num_experts=4, top_k=2, d_ff=8).init(jax.random.key(0), jnp.ones((8, 8)))


@pytest.mark.parametrize("top_k", [0, 9])
def test_route_rejects_top_k_out_of_range(top_k):
  with pytest.raises(ValueError, match=f"top_k={top_k}"):
    rm.route(jnp.ones((4, 3)), jnp.ones((3, 8)), top_k=top_k)


ETP_BAD = [
    ("F not divisible by tensor", dict(w_gate_EDF=lambda l: l["w_gate_EDF"][..., :9],
                                       w_up_EDF=lambda l: l["w_up_EDF"][..., :9],
                                       w_down_EFD=lambda l: l["w_down_EFD"][:, :9]), {}, "F=9 is not divisible"),
    ("tensor axis missing", {}, dict(tensor_axis="tp"), "tensor_axis 'tp' is not an axis"),
    ("tensor axis splits tokens", {}, dict(tensor_axis="tensor", token_axes=("expert", "tensor")),
     "cannot also split tokens"),
]


@pytest.mark.parametrize("changes,kwargs,message", [b[1:] for b in ETP_BAD], ids=[b[0] for b in ETP_BAD])
def test_bad_tensor_parallel_input_is_named(changes, kwargs, message):
  kwargs = dict(dict(tensor_axis="tensor"), **kwargs)
  with pytest.raises(ValueError, match=message):
    _call(_with(**changes), mesh_of((4, 2), ("expert", "tensor")), **kwargs)


def test_bad_shared_expert_is_named():
  layer = _with()
  shared = (jnp.ones((8, 4)), jnp.ones((8, 4)), jnp.ones((8, 4)))
  with pytest.raises(ValueError, match="w_down_FD"):
    _call(layer, mesh_of((4,), (rm.EXPERT,)), shared=shared)
  with pytest.raises(ValueError, match="shared_gate_D1"):
    _call(layer, mesh_of((4,), (rm.EXPERT,)), shared=shared[:2] + (jnp.ones((4, 8)),),
          shared_gate_D1=jnp.ones((8, 2)))


CLI = ["--config", "cpu", "compilation_cache_dir=''", "batch_size=8", "seq_len=16", "--compile-only"]


def test_the_cli_shows_a_jax_error_in_project_code_as_a_bug(tmp_path, capsys, monkeypatch):
  """A bug: the trainer's and the model's checks that the batch splits over the mesh are lost, so JAX's shard_map
  raises a ValueError while tracing the project's loss. JAX trims its own frames, so the traceback ends in
  models/loss.py; it is still JAX's error, not one written for the user."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  monkeypatch.setattr(train.mesh, "batch_shards", lambda mesh, runtime: 1)
  monkeypatch.setattr(qwen3, "check_rows", lambda rows, mesh, axes: None)
  with pytest.raises(SystemExit) as exit_info:
    main([*CLI, "batch_size=6", "--out", str(tmp_path / "run")])
  stderr = capsys.readouterr().err
  assert exit_info.value.code == 1, stderr
  assert "Traceback (most recent call last)" in stderr and "\nValueError: shard_map applied to" in stderr, stderr
  assert "error:" not in stderr, stderr
  assert stderr.splitlines()[-1] == ("relaymoe-train: this is a bug, not a problem with the input: please report it "
                                     "with the traceback above (--debug is not needed to see it)")


def test_the_cli_shows_a_bad_config_value_as_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  with pytest.raises(SystemExit) as exit_info:
    main([*CLI, "--out", str(tmp_path / "run"), "model.num_experts_per_tok=0"])
  stderr = capsys.readouterr().err
  assert exit_info.value.code == 2
  assert stderr == "relaymoe-train: error: num_experts_per_tok=0 must be in [1, num_experts=8]\n"


@pytest.mark.parametrize("change,message", [
    (dict(num_key_value_heads=0), "num_key_value_heads=0: must be ≥ 1"),
    (dict(hidden_size=0, num_attention_heads=-2), "hidden_size=0, num_attention_heads=-2: must be ≥ 1"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0: must be ≥ 1"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0: must be ≥ 1"),
    (dict(mlp_only_layers=(1, 2)), r"mlp_only_layers \[2\] are not layers of the 2 \(0 to 1\)"),
    (dict(param_dtype="int8"), r"param_dtype='int8' must be one of \['float32', 'bfloat16', 'float16'\]"),
    (dict(shared_expert_intermediate_size=-1), "shared_expert_intermediate_size=-1 must be ≥ 0"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_model_config_values_that_cannot_work_are_named(change, message):
  with pytest.raises(UserError, match=f"^{message}"):
    load_config("tiny", **change)


def test_a_compute_dtype_that_is_not_floating_point_is_named():
  with pytest.raises(UserError, match=r"^dtype='int32' \(the compute dtype\) must be one of"):
    RuntimeConfig(dtype="int32")


def test_no_emulated_cpu_devices_is_one_line(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--cpu-devices", "0", "--config", "cpu"])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == "relaymoe-train: error: --cpu-devices 0: must be ≥ 1\n"


@pytest.mark.parametrize("mesh_shape,change,runtime,message", [
    ((2, 4, 1), dict(hidden_size=60), dict(fsdp=True),
     r"runtime.fsdp=true splits the parameter embed_VD of shape \(128, 60\) 8 ways \(data × expert\) along a "
     "dimension of 60, which 8 does not divide"),
    ((1, 4, 2), dict(moe_intermediate_size=63), dict(moe_tensor_parallel=True),
     r"runtime.moe_tensor_parallel=true splits the parameter experts_in_EDF of shape \(8, 64, 63\) 2 ways \(tensor\)"),
    ((1, 4, 2), dict(vocab_size=127), {}, r"mesh.tensor=2 splits the parameter lm_head_DV of shape \(64, 127\) 2 "
                                          r"ways \(tensor\) along a dimension of 127"),
], ids=["fsdp", "moe_tensor_parallel", "tensor"])
def test_a_parameter_split_that_does_not_divide_is_named(mesh_shape, change, runtime, message):
  """Found when the model is made from shapes (before the step compiles); JAX refused such a parameter only when
  it was placed, and a --compile-only run reported memory for it."""
  mesh = mesh_of(mesh_shape, ("data", "expert", "tensor"))
  with pytest.raises(UserError, match=f"^{message}"):
    qwen3.abstract(load_config("tiny", **change), mesh, runtime=RuntimeConfig(dtype="float32", **runtime))
  qwen3.abstract(load_config("tiny"), mesh, runtime=RuntimeConfig(dtype="float32", **runtime))  # divides: fine
