"""Hugging Face checkpoints (`models.hf.transfer`): tiny qwen3_moe and qwen2_moe checkpoints written by transformers
(tests/fixtures/hf, made by make_fixtures.py) import to transformers' logits under every dispatcher, export back
bit-exactly, land in the model's own sharding on 8 devices, and bad checkpoints are named. `pytest -m hf` also
compares live with transformers (torch and transformers installed)."""

import functools
import json
import os
import pathlib
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from conftest import CONTEXT_MESHES, mesh_of, place_tokens, requires_devices, trainer_mesh
import relaymoe_jax as rm
from models.hf import transfer as hf, safetensors_io
from models.qwen3 import hf_config, hf_names
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from relaymoe_jax.errors import UserError

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
FAMILIES = ("qwen3_moe", "qwen2_moe")
LOGITS_ATOL = 1e-4


@pytest.fixture(autouse=True)
def _eight_devices():
  requires_devices(8)


@functools.cache
def _reference(family):
  ref = np.load(FIXTURES / family / "reference.npz")
  return ref["tokens"], ref["logits"]


_logits = nnx.jit(lambda model, tokens: model(tokens))  # one compile per config, shared by the tests


def _from_hf(path, param_dtype="float32", **runtime):
  """The model of a Hugging Face directory, float32 parameters and compute, `runtime` fields on top."""
  return hf.from_hf(path, mesh=trainer_mesh(), runtime=RuntimeConfig(**{"dtype": "float32", **runtime}),
                    param_dtype=param_dtype)


@functools.cache
def _loaded(family, **runtime):
  return _from_hf(FIXTURES / family, **{"dispatcher": "dense", **runtime})


def _params(model):
  return {k: np.asarray(v) for k, v in hf_names.param_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def _tensors(directory):
  """{key: NumPy array} of every safetensors file in `directory` (bf16 read through its raw bytes)."""
  checkpoint = safetensors_io.Checkpoint(directory)
  return {k: checkpoint.read(k, hf._normalize((slice(None),) * len(e.shape), e.shape))
          for k, e in checkpoint.entries.items()}


def _rewrite(family, out_dir, edit):
  """A copy of fixture `family` in out_dir whose tensors are `edit(tensors)` (one file)."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  shutil.copy(FIXTURES / family / "config.json", out_dir / "config.json")
  save_file(edit(_tensors(FIXTURES / family)), out_dir / "model.safetensors", metadata={"format": "pt"})
  return out_dir


def _assert_same_params(actual, expected):
  assert actual.keys() == expected.keys()
  for path in expected:
    np.testing.assert_array_equal(actual[path], expected[path], err_msg=str(path))


# --- Import ------------------------------------------------------------------------------------------------------

DEFAULT_DISPATCHERS = {("qwen3_moe", d) for d in rm.DISPATCHERS} | {("qwen2_moe", "ring_expert"),
                                                                          ("qwen2_moe", "dense")}
DISPATCH_CASES = [pytest.param(f, d, marks=() if (f, d) in DEFAULT_DISPATCHERS else pytest.mark.slow)
                  for f in FAMILIES for d in sorted(rm.DISPATCHERS)]


@pytest.mark.parametrize("family,dispatcher", DISPATCH_CASES)
def test_import_gives_transformers_logits(family, dispatcher):
  tokens, expected = _reference(family)
  logits = np.asarray(_logits(_loaded(family, dispatcher=dispatcher), tokens))
  assert np.abs(logits - expected).max() <= LOGITS_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_unscanned_layers_give_the_same_logits(family):
  tokens, expected = _reference(family)
  unrolled = np.asarray(_logits(_loaded(family, scan_layers=False), tokens))
  scanned = np.asarray(_logits(_loaded(family), tokens))
  assert np.abs(unrolled - expected).max() <= LOGITS_ATOL
  np.testing.assert_allclose(unrolled, scanned, atol=1e-5)


def test_import_onto_an_explicit_mesh_without_tensor_gives_transformers_logits():
  """`jax.make_mesh` gives Explicit axes; 'tensor' left out is taken as size 1."""
  tokens, expected = _reference("qwen3_moe")
  mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices()[:8])
  model = hf.from_hf(FIXTURES / "qwen3_moe", mesh=mesh, runtime=RuntimeConfig(dtype="float32", dispatcher="dense"),
                     param_dtype="float32")
  assert np.abs(np.asarray(_logits(model, tokens)) - expected).max() <= LOGITS_ATOL


HF_SET_MESH_DEFAULT = {("explicit", "rows"), ("expert-only-auto", "unsharded")}  # ~3 s each on 2 cores
HF_SET_MESH_CASES = [pytest.param(k, p, marks=() if (k, p) in HF_SET_MESH_DEFAULT else pytest.mark.slow)
                     for k in sorted(CONTEXT_MESHES) for p in ("unsharded", "rows")]


@pytest.mark.parametrize("kind,placement", HF_SET_MESH_CASES)
def test_import_under_jax_set_mesh_gives_transformers_logits(kind, placement):
  """`from_hf` and the call under `jax.set_mesh` of an Explicit, expert-only or Auto mesh, tokens unsharded or
  over rows: transformers' logits, on the context's mesh."""
  tokens, expected = _reference("qwen3_moe")
  shape, names, explicit = CONTEXT_MESHES[kind]
  mesh = mesh_of(shape, names, explicit=explicit)
  with jax.set_mesh(mesh):
    model = hf.from_hf(FIXTURES / "qwen3_moe", mesh=mesh, runtime=RuntimeConfig(dtype="float32"),
                       param_dtype="float32")
    logits = _logits(model, place_tokens(tokens, mesh, placement))
  assert logits.sharding.mesh == mesh
  assert np.abs(np.asarray(logits) - expected).max() <= LOGITS_ATOL


def _spec(array):
  spec = tuple(array.sharding.spec)
  return spec + (None,) * (array.ndim - len(spec))


@pytest.mark.parametrize("overrides", [{}, dict(fsdp=True, scan_layers=False)], ids=["stacked", "fsdp-unrolled"])
def test_parameters_load_into_the_models_own_sharding(overrides):
  config = hf_config.config_from_hf(FIXTURES / "qwen3_moe", param_dtype="float32")
  model = _from_hf(FIXTURES / "qwen3_moe", **overrides)
  _, _, abstract = hf.abstract_state(config, trainer_mesh(), RuntimeConfig(dtype="float32", **overrides))
  loaded = hf_names.param_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert loaded.keys() == abstract.keys()
  for path, array in loaded.items():
    assert array.sharding.is_equivalent_to(abstract[path].sharding, array.ndim), path
    assert array.dtype == np.float32, path
  experts = next(a for p, a in loaded.items() if p[-1] == "w_gate_EDF")
  assert _spec(experts)[-3] == "expert" and experts.addressable_shards[0].data.shape[-3] == 8 // 4
  if overrides.get("fsdp"):
    assert _spec(loaded[("layers", 0, "attn", "q_DH")]) == (("data", "expert"), "tensor")
  _assert_same_params(_params(model), _params(_loaded("qwen3_moe", **{k: v for k, v in overrides.items()
                                                                        if k != "fsdp"})))


def _fused(tensors):
  """The per-expert tensors of `tensors` as transformers holds them: gate_up_proj [E, 2F, D], down_proj [E, D, F]."""
  out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
  layers = sorted({k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k})
  for prefix in layers:
    experts = range(len({k for k in tensors if k.startswith(prefix + ".mlp.experts.")}) // 3)
    stack = lambda name: np.stack([tensors[f"{prefix}.mlp.experts.{e}.{name}.weight"] for e in experts])  # noqa
    out[f"{prefix}.mlp.experts.gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], axis=1)
    out[f"{prefix}.mlp.experts.down_proj"] = stack("down_proj")
  return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_expert_layout_loads_the_same_parameters(family, tmp_path):
  fused = _rewrite(family, tmp_path, _fused)
  assert any(k.endswith("gate_up_proj") for k in _tensors(fused))
  _assert_same_params(_params(_from_hf(fused, dispatcher="dense")),
                      _params(_loaded(family)))


def test_bfloat16_checkpoint_loads_and_exports_bit_exactly(tmp_path):
  to_bf16 = lambda tensors: {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}  # noqa: E731
  source = _rewrite("qwen3_moe", tmp_path / "bf16", to_bf16)
  as_f32 = _from_hf(source)
  expected = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in _params(_loaded("qwen3_moe")).items()}
  _assert_same_params(_params(as_f32), expected)
  as_bf16 = hf.from_hf(source, mesh=trainer_mesh(), param_dtype="bfloat16")
  hf.to_hf(as_bf16, tmp_path / "out")
  assert_same_tensors(tmp_path / "out", source)
  assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  hf.to_hf(_loaded("qwen3_moe"), tmp_path / "cast", dtype="bfloat16")  # float32 parameters written as bf16
  assert_same_tensors(tmp_path / "cast", source)
  assert json.loads((tmp_path / "cast" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_tied_checkpoint_holding_a_copy_of_the_head_loads(tmp_path):
  """Some tied checkpoints still store lm_head.weight (the embeddings again); transformers ignores it, so do we."""
  with_head = lambda t: dict(t, **{"lm_head.weight": t["model.embed_tokens.weight"]})  # noqa: E731
  _assert_same_params(_params(_from_hf(_rewrite("qwen2_moe", tmp_path, with_head), dispatcher="dense")),
                      _params(_loaded("qwen2_moe")))


# --- Export ------------------------------------------------------------------------------------------------------


def assert_same_tensors(actual_dir, expected_dir):
  """Two Hugging Face directories hold the same tensors: keys, dtypes, shapes and bytes."""
  actual, expected = _tensors(actual_dir), _tensors(expected_dir)
  assert sorted(actual) == sorted(expected)
  for key in expected:
    assert actual[key].dtype == expected[key].dtype and actual[key].shape == expected[key].shape, key
    assert actual[key].tobytes() == expected[key].tobytes(), key


@pytest.mark.parametrize("family,max_shard_bytes", [("qwen3_moe", 100_000), ("qwen2_moe", None)])
def test_export_reproduces_every_tensor_bit_exactly(family, max_shard_bytes, tmp_path):
  kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
  files = hf.to_hf(_loaded(family), tmp_path, **kwargs)
  assert_same_tensors(tmp_path, FIXTURES / family)
  assert hf_config.config_from_hf(tmp_path) == hf_config.config_from_hf(FIXTURES / family)
  if max_shard_bytes:
    assert len(files) > 2 and all((tmp_path / f).stat().st_size <= max_shard_bytes + 10_000 for f in files)
    index = json.loads((tmp_path / safetensors_io.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(files) and set(index["weight_map"]) == set(_tensors(tmp_path))
    unrolled = _from_hf(tmp_path, dispatcher="dense", scan_layers=False)
    _assert_same_params(_params(unrolled), _params(_loaded(family, scan_layers=False)))
  else:
    assert files == ["model.safetensors"] and not (tmp_path / safetensors_io.INDEX_FILE).exists()


def test_a_router_bias_starts_at_zero_on_import_and_is_left_out_of_export(tmp_path, caplog):
  """Qwen3-MoE has no field for loss-free balancing's bias: imported, it is zero; exported, the same tensors as
  without it, and a warning says so."""
  path = FIXTURES / "qwen3_moe"
  model = hf.from_hf(path, mesh=trainer_mesh(), runtime=RuntimeConfig(dtype="float32", dispatcher="dense"),
                     router_bias_update_rate=0.01)
  biases = [v for k, v in hf_names.param_paths(nnx.to_pure_dict(nnx.state(model))).items() if k[-1] == "router_bias_E"]
  assert biases and not any(np.any(np.asarray(b)) for b in biases)
  _assert_same_params(_params(model), _params(_loaded("qwen3_moe")))
  hf.to_hf(model, tmp_path)
  assert_same_tensors(tmp_path, path)
  assert "router bias of auxiliary-loss-free balancing is not exported: qwen3_moe has no field" in caplog.text


def test_a_config_no_family_holds_is_refused(tmp_path):
  config = load_config("tiny", attention_bias=True)
  with pytest.raises(ValueError, match="no Hugging Face family holds"):
    hf_config.config_to_hf(config)


# --- Config ------------------------------------------------------------------------------------------------------


def test_config_from_hf_reads_both_families_and_applies_overrides():
  q3 = hf_config.config_from_hf(FIXTURES / "qwen3_moe", rms_norm_eps=1e-5, router_z_loss_coef=0.5)
  assert (q3.num_hidden_layers, q3.head_dim, q3.num_experts, q3.num_experts_per_tok) == (4, 8, 8, 2)
  assert q3.mlp_only_layers == (2,) and q3.qk_norm and not q3.attention_bias and q3.norm_topk_prob
  assert (q3.rms_norm_eps, q3.router_z_loss_coef, q3.rope_theta) == (1e-5, 0.5, 10000.0)
  with pytest.raises(ValueError, match="dispatcher"):  # how a model runs is not its config's
    hf_config.config_from_hf(FIXTURES / "qwen3_moe", dispatcher="ring_token")
  q2 = hf_config.config_from_hf(FIXTURES / "qwen2_moe")
  assert q2.attention_bias and not q2.qk_norm and q2.shared_expert_intermediate_size == 24
  assert q2.tie_word_embeddings and q2.decoder_sparse_step == 2 and q2.head_dim == 32 // 4
  assert not q2.norm_topk_prob


def test_config_from_hf_reads_transformers_4_names(tmp_path):
  config = json.loads((FIXTURES / "qwen2_moe" / "config.json").read_text())
  theta = config.pop("rope_parameters")["rope_theta"]
  (tmp_path / "config.json").write_text(json.dumps(dict(config, rope_theta=theta + 1, torch_dtype="bfloat16")))
  assert hf_config.config_from_hf(tmp_path).rope_theta == theta + 1
  config = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
  config["num_experts"] = config.pop("num_local_experts")  # transformers 5 writes num_local_experts
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert hf_config.config_from_hf(tmp_path).num_experts == 8


@pytest.mark.parametrize("change,message", [
    (dict(model_type="llama"), "model_type 'llama' is not supported"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1.0)), "RoPE scaling 'yarn'"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(hidden_size=None), r"missing key\(s\) \['hidden_size'\]"),
])
def test_unsupported_config_is_named(change, message, tmp_path):
  config = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(dict(config, **change)))
  with pytest.raises(ValueError, match=message):
    hf_config.config_from_hf(tmp_path)


def test_bad_override_is_named():
  with pytest.raises(ValueError, match="dispatchers"):
    hf_config.config_from_hf(FIXTURES / "qwen3_moe", dispatchers="dense")


# --- Bad checkpoints ---------------------------------------------------------------------------------------------

KEY = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.mark.parametrize("edit,message", [
    (lambda t: {k: v for k, v in t.items() if k != KEY}, f"tensor '{KEY}' is missing"),
    (lambda t: dict(t, **{"model.layers.9.mlp.gate.weight": t["model.norm.weight"]}),
     r"unexpected tensor 'model.layers.9.mlp.gate.weight' \(in model.safetensors\)"),
    (lambda t: dict(t, **{KEY: t[KEY][:, :-1]}), rf"tensor '{KEY}' \(in model.safetensors\) has shape \[16, 31\]; "
                                                 r"the config needs \[16, 32\]"),
    (lambda t: dict(t, **{KEY: t[KEY].astype(np.int32)}), rf"tensor '{KEY}' \(in model.safetensors\) has dtype I32; "
                                                           "weights are read from floating point tensors only"),
    (lambda t: dict(t, **{KEY: t[KEY] > 0}), rf"tensor '{KEY}' \(in model.safetensors\) has dtype BOOL"),
], ids=["missing", "unexpected", "shape", "integer", "bool"])
def test_bad_checkpoint_names_the_tensor(edit, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    _from_hf(_rewrite("qwen3_moe", tmp_path, edit))


def test_a_safetensors_file_cut_short_is_named(tmp_path):
  hf.to_hf(_loaded("qwen2_moe"), tmp_path)
  file = tmp_path / "model.safetensors"
  size = file.stat().st_size
  os.truncate(file, size - 100)
  with pytest.raises(UserError, match=f"^{file} is cut short: {size - 100} bytes, its header needs {size}$"):
    _from_hf(tmp_path)
  os.truncate(file, 100)
  with pytest.raises(UserError, match=f"^{file} is not a safetensors file \\(its header does not read\\)"):
    _from_hf(tmp_path)


def test_index_naming_an_absent_file_is_named(tmp_path):
  hf.to_hf(_loaded("qwen2_moe"), tmp_path, max_shard_bytes=100_000)
  (tmp_path / "model-00002-of-00003.safetensors").unlink()
  with pytest.raises(ValueError, match="model-00002-of-00003.safetensors"):
    _from_hf(tmp_path)


def test_a_second_export_into_the_same_directory_is_refused_or_replaces_exactly_the_first(tmp_path):
  (tmp_path / "tokenizer.json").write_text("{}")
  hf.to_hf(_loaded("qwen2_moe"), tmp_path, max_shard_bytes=100_000)  # shards and their index
  with pytest.raises(UserError, match=f"{tmp_path} holds an earlier export \\(config.json, "
                                      r"model-00001-of-00003.safetensors, model-00002-of-00003.safetensors and 2 more"):
    hf.to_hf(_loaded("qwen3_moe"), tmp_path)
  assert hf.to_hf(_loaded("qwen3_moe"), tmp_path, overwrite=True) == ["model.safetensors"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
  assert_same_tensors(tmp_path, FIXTURES / "qwen3_moe")


def test_an_index_beside_a_model_safetensors_it_does_not_name_is_refused(tmp_path):
  """What an export without the check above left: transformers would read model.safetensors, we the index."""
  hf.to_hf(_loaded("qwen2_moe"), tmp_path, max_shard_bytes=100_000)
  shutil.copy(FIXTURES / "qwen3_moe" / "model.safetensors", tmp_path)
  with pytest.raises(UserError, match=f"{tmp_path} holds model.safetensors.index.json and a model.safetensors that "
                                      "it does not name: two exports mixed"):
    _from_hf(tmp_path)


# --- Live against transformers (pytest -m hf) --------------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.parametrize("family", FAMILIES)
def test_live_against_transformers(family, tmp_path):
  """A fresh random transformers model: our import gives its logits, and transformers loads our export to the same
  logits."""
  torch = pytest.importorskip("torch", reason="needs torch (pip install '.[hf]')")
  transformers = pytest.importorskip("transformers", reason="needs transformers (pip install '.[hf]')")
  import importlib.util
  spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
  make_fixtures = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make_fixtures)
  config_cls, model_cls, kwargs = make_fixtures.FAMILIES[family]
  torch.manual_seed(7)
  model = model_cls(config_cls(**kwargs, attn_implementation="eager")).to(torch.float32).eval()
  make_fixtures.randomize(model, seed=7)
  model.save_pretrained(tmp_path / "theirs")
  tokens = np.random.default_rng(7).integers(0, kwargs["vocab_size"], (8, 10)).astype(np.int32)
  with torch.no_grad():
    expected = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = _from_hf(tmp_path / "theirs", dispatcher="ring_expert")
  assert np.abs(np.asarray(_logits(ours, tokens)) - expected).max() <= LOGITS_ATOL
  hf.to_hf(ours, tmp_path / "ours", max_shard_bytes=100_000)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager")
  with torch.no_grad():
    again = reloaded.eval()(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_array_equal(again, expected)
