"""`relaymoe-convert` and the trainer's `init_from`: Hugging Face ↔ orbax ↔ training runs, every tensor bit-exact."""

import dataclasses
import errno
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
import yaml
from flax import nnx
from orbax.checkpoint._src.path import atomicity

from models.qwen3 import model as qwen3
from models.hf.transfer import to_hf
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from train import convert
from train.cli import main
from train.config import MeshConfig, load_run_config
from train.loop import run
from train.mesh import build_mesh
from train.rundir.checkpoints import Checkpoints
from train.step import TrainState, make_optimizer
from train.sources import initial_params, model_config_for
from test_hf import assert_same_tensors

# A run that changes nothing: learning rate 0, so its checkpoint holds the parameters it started from.
FROZEN = ["batch_size=8", "seq_len=16", "steps=1", "checkpoint_every=1", "log_every=1", "tensorboard=false",
          "compilation_cache_dir=''", "optim.learning_rate=0.0"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """The tiny model with random weights, written as a Hugging Face directory."""
  path = tmp_path_factory.mktemp("hf")
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  to_hf(qwen3.create_sharded(load_config("tiny"), mesh, seed=3), path)
  return path


# What earlier versions wrote into a model.yaml and a run's config beside the architecture: how the model ran.
LEGACY_RUNTIME = dict(dataclasses.asdict(RuntimeConfig(dtype="float32")), dispatcher_options={})


def test_hf_to_orbax_and_back_is_bit_exact(hf_dir, tmp_path, capsys):
  convert.main(["hf-to-orbax", str(hf_dir), str(tmp_path / "orbax")])
  assert "init_from=orbax:" in capsys.readouterr().out
  assert (tmp_path / "orbax" / "model.yaml").exists() and (tmp_path / "orbax" / "params").is_dir()
  convert.main(["orbax-to-hf", str(tmp_path / "orbax"), str(tmp_path / "back"), "mesh.data=2", "mesh.expert=4"])
  assert_same_tensors(hf_dir, tmp_path / "back")
  model_yaml = tmp_path / "orbax" / "model.yaml"
  assert not set(yaml.safe_load(model_yaml.read_text())) & set(LEGACY_RUNTIME)  # architecture only
  # A converter output of before the split (its model.yaml also says how the model ran) converts the same, into
  # the same directory only with --overwrite, which keeps what no export writes.
  model_yaml.write_text(yaml.safe_dump({**yaml.safe_load(model_yaml.read_text()), **LEGACY_RUNTIME}))
  (tmp_path / "back" / "tokenizer.json").write_text("{}")
  with pytest.raises(SystemExit) as exit_info:
    convert.main(["orbax-to-hf", str(tmp_path / "orbax"), str(tmp_path / "back")])
  assert exit_info.value.code == 2 and capsys.readouterr().err == (
      f"relaymoe-convert: error: {tmp_path / 'back'} holds an earlier export (config.json, model.safetensors): "
      "choose another directory or overwrite it (relaymoe-convert orbax-to-hf --overwrite; to_hf(overwrite=True))\n")
  convert.main(["orbax-to-hf", str(tmp_path / "orbax"), str(tmp_path / "back"), "--overwrite"])
  assert_same_tensors(hf_dir, tmp_path / "back")
  assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["config.json", "model.safetensors",
                                                                    "tokenizer.json"]


@pytest.mark.slow  # 6-12 s on 2 cores; CI's second step runs it
@pytest.mark.parametrize("source", ["hf", "orbax"])
def test_training_starts_from_the_source_and_its_checkpoint_converts_back(hf_dir, tmp_path, source, capsys):
  if source == "orbax":
    convert.main(["hf-to-orbax", str(hf_dir), str(tmp_path / "orbax"), "mesh.data=2", "mesh.expert=4"])
  origin = hf_dir if source == "hf" else tmp_path / "orbax"
  config = load_run_config("cpu", [*FROZEN, f"init_from={source}:{origin}", f"out_dir={tmp_path / 'run'}"])
  history = run(config)
  assert np.isfinite(history[-1]["loss"])
  said = str(origin) if source == "hf" else str(origin.absolute())
  assert f"init_from: starting from the parameters of {said} (the optimizer starts afresh)" in capsys.readouterr().out
  convert.main(["orbax-to-hf", str(tmp_path / "run"), str(tmp_path / "back")])
  assert_same_tensors(hf_dir, tmp_path / "back")
  # A run of before the split: its run_config.json held dispatcher and remat in `run`, the rest in `model`.
  path = tmp_path / "run" / "run_config.json"
  stored = json.loads(path.read_text())
  runtime = stored["run"].pop("runtime")
  stored["run"].update(dispatcher="", remat="")
  stored["model"].update(runtime)
  path.write_text(json.dumps(stored))
  convert.main(["orbax-to-hf", str(tmp_path / "run"), str(tmp_path / "legacy")])
  assert_same_tensors(hf_dir, tmp_path / "legacy")
  with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 7 in .*; there are \[1\]"):
    convert.main(["orbax-to-hf", str(tmp_path / "run"), str(tmp_path / "other"), "--step", "7", "--debug"])


def _run_directory(out, steps=(1, 3), seed=5):
  """A relaymoe-train run directory as the loop writes one, without training: its run_config.json and a checkpoint
  per step holding the seeded parameters times the step. Returns (run config, mesh, model config, the seeded
  parameters)."""
  config = load_run_config("cpu", [*FROZEN, f"out_dir={out}", f"seed={seed}"])
  mesh, model_config = build_mesh(config.mesh), model_config_for(config)
  seeded = nnx.to_pure_dict(nnx.split(qwen3.create_sharded(model_config, mesh, seed=seed,
                                                           runtime=config.runtime))[1])
  optimizer, _ = make_optimizer(config.optim, config.steps)
  out.mkdir()
  (out / "run_config.json").write_text(json.dumps(dict(
      run=dataclasses.asdict(config), model=dataclasses.asdict(model_config)), default=str))
  with Checkpoints(out / "checkpoints", len(steps)) as checkpoints:
    for step in steps:
      scaled = jax.tree.map(lambda x, s=step: x * s, seeded)
      checkpoints.save(step, TrainState(scaled, optimizer.init(scaled), np.int32(step)), {"next_batch": step})
  return config, mesh, model_config, seeded


def test_a_training_runs_directory_is_an_init_from_source_for_training_and_eval_only(tmp_path, capsys, monkeypatch):
  """`init_from=orbax:RUN_DIR`: the newest checkpoint of a relaymoe-train run directory (written here as the loop
  writes one, without training: random parameters, which the source must give back bit for bit; the slow test above
  starts from a trained one), said on the console; `--eval-only` of it names the checkpoint it evaluated."""
  config, mesh, model_config, seeded = _run_directory(tmp_path / "run")  # the newest of steps 1 and 3 is taken
  capsys.readouterr()
  params, origin = initial_params(f"orbax:{tmp_path / 'run'}", model_config, config.runtime, mesh)
  assert jax.tree.structure(params) == jax.tree.structure(seeded)
  assert all(np.array_equal(a, 3 * b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(seeded)))
  assert origin == f"checkpoint step 3 of {tmp_path / 'run'}"
  assert model_config_for(load_run_config("cpu", [f"init_from=orbax:{tmp_path / 'run'}", "model.rms_norm_eps=1e-5"])
                          ).rms_norm_eps == 1e-5
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  main(["--eval-only", *FROZEN, "eval.batches=1", f"init_from=orbax:{tmp_path / 'run'}", "--out",
        str(tmp_path / "eval")])
  assert capsys.readouterr().out.startswith(f"eval of checkpoint step 3 of {tmp_path / 'run'}: loss ")


def test_a_source_runs_unreadable_checkpoint_is_skipped_and_left_in_place(tmp_path, capfd):
  """`init_from=orbax:RUN_DIR` whose newest checkpoint does not read starts from the one before, says so, and leaves
  the source run as it was (its own `--resume` sets such a checkpoint aside; a run reading it must not)."""
  config, mesh, model_config, _ = _run_directory(tmp_path / "run")
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "3" / "state" / "ocdbt.process_0")  # its arrays are gone
  capfd.readouterr()
  _, origin = initial_params(f"orbax:{tmp_path / 'run'}", model_config, config.runtime, mesh)
  assert origin == f"checkpoint step 1 of {tmp_path / 'run'}"
  assert "skipped checkpoint step 3 in " in capfd.readouterr().err
  assert (tmp_path / "run" / "checkpoints" / "3").exists() and not (tmp_path / "run" / "checkpoints-unreadable").exists()


def test_init_from_takes_the_model_config_from_the_source_with_overrides(hf_dir):
  tiny = load_config("tiny")
  config = load_run_config("cpu", [f"init_from=hf:{hf_dir}", "model.rms_norm_eps=1e-5", "runtime.remat=layer"])
  built = model_config_for(config)
  assert built.rms_norm_eps == 1e-5 and config.runtime.remat == "layer"
  for field in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size",
                "moe_intermediate_size", "head_dim", "num_key_value_heads"):
    assert getattr(built, field) == getattr(tiny, field), field


def test_bad_sources_are_named(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  with pytest.raises(ValueError, match="init_from='gs://bucket' must start with one of"):
    load_run_config("cpu", ["init_from=gs://bucket"])
  cases = [
      (main, ["--config", "cpu", "--out", str(tmp_path / "run"), f"init_from=hf:{tmp_path}"],
       f"relaymoe-train: error: init_from='hf:{tmp_path}': no config.json in {tmp_path}"),
      (main, ["--config", "cpu", "--out", str(tmp_path / "run"), f"init_from=orbax:{tmp_path}"],
       f"relaymoe-train: error: init_from='orbax:{tmp_path}': {tmp_path} is neither a relaymoe-convert output "
       "(model.yaml) nor a training run (run_config.json)\n"),
      (convert.main, ["orbax-to-hf", str(tmp_path), str(tmp_path / "out")],
       f"relaymoe-convert: error: {tmp_path} is neither a relaymoe-convert output"),
      (convert.main, ["hf-to-orbax", str(tmp_path), str(tmp_path / "out"), "steps=3"],
       "relaymoe-convert: error: ['steps=3']: only model.KEY=VALUE and mesh.AXIS=N"),
      (convert.main, ["orbax-to-hf", str(tmp_path / "stopped"), str(tmp_path / "out")],  # not "--resume: ..."
       f"relaymoe-convert: error: no checkpoint in {tmp_path / 'stopped' / 'checkpoints'}\n"),
  ]
  run_config = load_run_config("cpu", FROZEN)
  (tmp_path / "stopped").mkdir()  # a run that stopped before its first checkpoint
  (tmp_path / "stopped" / "run_config.json").write_text(json.dumps(dict(
      run=dataclasses.asdict(run_config), model=dataclasses.asdict(model_config_for(run_config)))))
  for entry, argv, message in cases:
    with pytest.raises(SystemExit) as exit_info:
      entry(argv)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and stderr.startswith(message) and stderr.count("\n") == 1, stderr


@pytest.mark.slow  # an end-to-end run; CI's second step runs it
def test_fine_tuning_a_transformers_checkpoint_lowers_its_loss(tmp_path):
  """A few steps from the Qwen3-MoE checkpoint that transformers wrote (a dense layer among MoE ones), bf16 compute,
  on one batch of tokens seen again every step: its loss falls from where the imported weights start."""
  fixture = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen3_moe"
  np.random.default_rng(0).integers(0, 96, 8 * 16 + 1).astype(np.uint16).tofile(tmp_path / "batch.bin")
  config = load_run_config("cpu", ["batch_size=8", "seq_len=16", "steps=6", "log_every=1", "checkpoint_every=0",
                                   "tensorboard=false", "compilation_cache_dir=''", "optim.learning_rate=1e-2",
                                   "optim.warmup_steps=1", "data.kind=tokens", f"data.path={tmp_path / 'batch.bin'}",
                                   "runtime.dtype=bfloat16", f"init_from=hf:{fixture}", f"out_dir={tmp_path / 'run'}"])
  losses = [r["loss"] for r in run(config)]
  assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


def test_a_full_disk_during_hf_to_orbax_is_one_line(hf_dir, tmp_path, monkeypatch, capfd):
  def disk_full(self):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)  # orbax's last act of a save
  monkeypatch.setattr(convert, "initial_params", lambda *_: ({"embed_VD": np.ones((8, 4), np.float32)}, ""))  # fast
  with pytest.raises(SystemExit) as exit_info:
    convert.main(["hf-to-orbax", str(hf_dir), str(tmp_path / "orbax")])
  stderr = capfd.readouterr().err
  assert exit_info.value.code == 1 and stderr.count("\n") == 1, stderr[-3000:]
  assert stderr.startswith(f"relaymoe-convert: error: no space left on the device of {tmp_path / 'orbax' / 'params'} "
                           "to write the parameters: it needs up to 0.1 KiB (128 bytes) and "), stderr
  assert not (tmp_path / "orbax" / "model.yaml").exists()
