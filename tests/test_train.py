"""The trainer: one golden step against an independent computation, the loss falling on the synthetic language,
exact resume, a non-finite loss stopping with the last good checkpoint kept, bad configs, data sources, and a
2-process start on CPU."""

import dataclasses
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import requires_devices
from models.qwen3 import model as qwen3
from train.config import DataConfig, MeshConfig, RunConfig, load_run_config
from train.data.batches import DataChanged, SyntheticLanguage, data_change, data_stamp, make_source
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from train.rundir.checkpoints import Checkpoints
from train.compile import memory_plan
from train.loop import run
from train.mesh import build_mesh, global_batch, on_mesh
from train.sources import model_config_for
from train.rundir import checkpoints as train_checkpoints
from train import metrics as train_metrics
from train import run as train_run
from train.data import batches as train_data
from train.cli import _parse, _start
from train.errors import exit_status
from train.step import BAD_IDS, TrainState, abstract_train_state, make_optimizer, make_train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = RuntimeConfig(dtype="float32")  # the tiny model computes in float32 in these tests, as `--config cpu` does


@pytest.fixture(autouse=True)
def _eight_devices():
  """These tests build the trainer's (2 data × 4 expert) mesh: on a GPU machine run them with JAX_PLATFORMS=cpu."""
  requires_devices(8)


def tiny_run(tmp_path, **changes):
  base = RunConfig(model="tiny", runtime=F32, mesh=MeshConfig(data=2, expert=4), batch_size=8, seq_len=16, steps=6,
                   log_every=1, checkpoint_every=3, out_dir=str(tmp_path / "run"), tensorboard=False)
  return dataclasses.replace(base, **changes)


@pytest.mark.slow  # ~21 s; the default run reached 9.6 min on 2 cores, over 10 on CI's; CI's second step runs it
def test_golden_first_step_is_adam_sign_step_on_oracle_gradient():
  """Step 0 of Adam (bias-corrected) moves each parameter by −lr·(g/(|g|+eps) + wd·p) (decay on matrices only),
  with g the gradient of the loss computed independently through the dense oracle."""
  run_config = RunConfig(model="tiny", runtime=F32, mesh=MeshConfig(data=2, expert=4), batch_size=8, seq_len=16,
                         steps=10)
  mesh = build_mesh(run_config.mesh)
  model_config = model_config_for(run_config)
  graphdef, params = nnx.split(qwen3.create_sharded(model_config, mesh, runtime=F32))
  params = nnx.to_pure_dict(params)
  optimizer, schedule = make_optimizer(run_config.optim, run_config.steps)
  batch = SyntheticLanguage(model_config.vocab_size, 4, 0).batch(0, 8, 16)
  tokens = global_batch({"tokens": batch}, mesh, RuntimeConfig())
  step = jax.jit(make_train_step(graphdef, optimizer, schedule, model_config))
  state = TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))
  new_state, metrics = step(state, tokens)
  assert int(metrics[BAD_IDS]) == 0
  # Ids outside the vocabulary (a data file changed under the run) are counted on the device, for the loop to stop.
  changed = batch.copy()
  changed[1, 5], changed[6, 16] = model_config.vocab_size, -1
  assert int(step(state, global_batch({"tokens": changed}, mesh, RuntimeConfig()))[1][BAD_IDS]) == 2

  dense_graphdef, _ = nnx.split(qwen3.create_sharded(model_config, mesh,
                                                     runtime=dataclasses.replace(F32, dispatcher="dense")))

  def oracle_loss(p):
    logits, aux = nnx.merge(dense_graphdef, nnx.State(p)).logits_and_aux(tokens["tokens"][:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens["tokens"][:, 1:]).mean()
    return ce + model_config.router_aux_loss_coef * aux["load_balancing_loss"], ce

  (loss, ce), grads = jax.jit(jax.value_and_grad(oracle_loss, has_aux=True))(params)
  assert abs(float(metrics["loss"]) - float(loss)) < 1e-5 * float(loss)
  assert abs(float(metrics["ce"]) - float(ce)) < 1e-5 * float(ce)
  assert abs(float(ce) - math.log(model_config.vocab_size)) < 0.1  # an untrained model is near uniform
  o = run_config.optim
  lr = float(schedule(0))
  assert lr > 0
  grad_norm = float(optax.tree.norm(grads))
  scale = min(1.0, o.grad_clip / grad_norm)
  for (path, p0), g, p1 in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(grads),
                               jax.tree.leaves(new_state.params)):
    g = np.asarray(g, np.float64) * scale
    decay = 0.0 if "norm" in jax.tree_util.keystr(path) else o.weight_decay  # tiny has no biases
    expected = np.asarray(p0) - lr * (g / (np.abs(g) + o.eps) + decay * np.asarray(p0))
    # Elements whose gradient is ~0 move by a ratio dominated by eps and rounding; compare the rest tightly.
    significant = np.abs(g) > 1e-5
    np.testing.assert_allclose(np.asarray(p1)[significant], expected[significant], rtol=1e-4, atol=lr * 1e-3,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # compiles a step of its own (~10-15 s on 2 cores); CI's second step runs it
def test_loss_falls_toward_the_entropy_floor(tmp_path):
  history = run(tiny_run(tmp_path, steps=50, log_every=10, checkpoint_every=50, batch_size=16, seq_len=32))
  first, last = history[0]["loss"], history[-1]["loss"]
  floor = math.log(DataConfig().branching)
  assert first > last + 1.0, (first, last)
  assert floor < last < 0.75 * math.log(128), (floor, last)
  for key in ("step", "loss", "tokens_per_s", "peak_memory_bytes"):
    assert key in history[-1]
  assert history[-1]["peak_memory_bytes"] > 0 and history[-1]["tokens_per_s"] > 0
  logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in logged] == [9, 19, 29, 39, 49]


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_throughput_is_timed_to_each_logged_steps_end(tmp_path, monkeypatch):
  """A step whose dispatch returns only as it finishes (as on GPU, where a step's data-dependent loops are driven
  from the host): each logged window is timed from the end of the last logged step to the end of its own, not
  shifted by a step (which read 3 and 1 step times here). A step's own compute rides on top of the sleep (it reached
  0.13 s per step on a loaded 2-core CI machine), so the sleep is long enough that only a shift can leave the band."""
  seconds = 1.0
  compile_step = train_run.compile_step

  class SlowDispatch:
    def __init__(self, compiled):
      self.compiled = compiled

    def __call__(self, *args):
      out = jax.block_until_ready(self.compiled(*args))
      time.sleep(seconds)
      return out

    def __getattr__(self, name):
      return getattr(self.compiled, name)

  def slow_dispatch(run_config, devices=None, **kwargs):
    step = compile_step(run_config, devices, **kwargs)
    return step._replace(compiled=SlowDispatch(step.compiled))

  monkeypatch.setattr(train_run, "compile_step", slow_dispatch)
  config = tiny_run(tmp_path, steps=4, log_every=2, checkpoint_every=0, batch_size=8, seq_len=16)
  for record in run(config):
    window_s = 2 * 8 * 16 / record["tokens_per_s"]
    assert 2 * seconds <= window_s < 3 * seconds, (record["step"], window_s)


@pytest.mark.slow  # 13-29 s on 2 cores (the default run reached 11.5 min); CI's second step runs it
def test_resume_continues_exactly(tmp_path):
  config = tiny_run(tmp_path)
  full = run(config)
  checkpoint_dir = tmp_path / "run" / "checkpoints"
  assert sorted(p.name for p in checkpoint_dir.iterdir() if p.name.isdigit()) == ["3", "6"]
  shutil.rmtree(checkpoint_dir / "6")  # as if the run had stopped after step 3
  resumed = run(config, resume=True)
  assert [r["step"] for r in resumed] == [3, 4, 5]
  logged = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert logged == [0, 1, 2, 3, 4, 5]  # the rows of the replayed steps replaced, not repeated
  for a, b in zip(full[3:], resumed):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0), (a, b)


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_resuming_with_another_layer_layout_is_refused_by_name(tmp_path):
  """Another layout is an error from the newest checkpoint's metadata, never a fall back to an older one."""
  unstacked = dataclasses.replace(F32, scan_layers=False)
  run(tiny_run(tmp_path, steps=2, checkpoint_every=1, runtime=unstacked))
  with pytest.raises(ValueError, match="checkpoint step 2 .* runtime.scan_layers.*this model lacks"):
    run(tiny_run(tmp_path, steps=3, checkpoint_every=1), resume=True)
  with pytest.raises(ValueError, match=r"checkpoint step 2 .*w_down_EFD is \(8, 64, 64\) in the checkpoint and "
                                       r"\(8, 32, 64\) in this model"):
    run(tiny_run(tmp_path, steps=3, runtime=unstacked, model_overrides={"moe_intermediate_size": 32}), resume=True)
  checkpoints = Checkpoints(tmp_path / "run" / "checkpoints", 2)
  assert checkpoints.manager.all_steps() == [1, 2] and not (tmp_path / "run" / "checkpoints-unreadable").exists()
  checkpoints.close()


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_a_token_file_rewritten_under_the_run_stops_it_and_a_resume_says_the_data_changed(tmp_path, monkeypatch,
                                                                                          capsys):
  path = tmp_path / "tokens.bin"
  (np.arange(4000) % 128).astype(np.uint16).tofile(path)
  config = tiny_run(tmp_path, steps=4, checkpoint_every=2, log_every=4,
                    data=DataConfig(kind="tokens", path=str(path), token_dtype="uint16"))
  read = train_data.TokenFile.windows

  def rewritten_at_step_3(self, starts, length, step):
    if step == 3:  # in place, as `cat other > tokens.bin` does: ids of another, larger vocabulary
      path.write_bytes((np.arange(4000) % 128 + 128).astype(np.uint16).tobytes())
    return read(self, starts, length, step)

  monkeypatch.setattr(train_data.TokenFile, "windows", rewritten_at_step_3)
  with pytest.raises(DataChanged, match=r"^step 3: 136 token ids of its batch are outside the vocabulary "
                                        r"\(vocab_size=128\): .* changed under the run; stopping. The last good "
                                        "checkpoint is step 2 in ") as stopped:
    run(config)
  assert exit_status(stopped.value) == 1  # failed while training: one line, exit status 1
  assert Checkpoints(tmp_path / "run" / "checkpoints", 2).latest_step() == 2  # the bad step was never saved
  monkeypatch.setattr(train_data.TokenFile, "windows", read)
  (np.arange(4000) % 128).astype(np.uint16).tofile(path)
  os.utime(path, ns=(10**18, 10**18))  # 2001-09-09
  assert [r["step"] for r in run(config, resume=True)] == [3]
  out = capsys.readouterr().out
  assert f"warning: the data changed since the run's checkpoints were written: {path} (8000 bytes, modified " in out
  assert f"), now {path} (8000 bytes, modified 2001-09-" in out and "the resumed run reads the new data" in out


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  run(tiny_run(tmp_path, steps=2, checkpoint_every=1))
  diverging = tiny_run(tmp_path, steps=4, checkpoint_every=1,
                       optim=dataclasses.replace(RunConfig().optim, learning_rate=float("inf")))
  with pytest.raises(FloatingPointError, match="step 2.*last good checkpoint is step 2"):
    run(diverging, resume=True)
  checkpoints = Checkpoints(tmp_path / "run" / "checkpoints", 2)
  assert checkpoints.latest_step() == 2
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  model_config = model_config_for(diverging)
  _, params = nnx.split(qwen3.create_sharded(model_config, mesh, runtime=F32))
  params = nnx.to_pure_dict(params)
  optimizer, _ = make_optimizer(diverging.optim, 4)
  state, meta = checkpoints.restore(TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32)))
  checkpoints.close()
  assert meta["next_batch"] == 2 and int(state.step) == 2
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(state.params))


@pytest.mark.parametrize("name", ["cpu", "gpu", "ep8"])
def test_shipped_run_configs_build_their_model(name):
  run_config = load_run_config(name)
  model_config = model_config_for(run_config)
  assert run_config.batch_size * run_config.seq_len > 0 and model_config.num_hidden_layers >= 1


def test_bad_run_configs_are_named(tmp_path):
  bad_yaml = tmp_path / "bad.yaml"
  bad_yaml.write_text("model: tiny\nbatch_sise: 4\n")
  with pytest.raises(ValueError, match="batch_sise"):
    load_run_config(str(bad_yaml))
  with pytest.raises(ValueError, match="mesh.experts"):
    load_run_config("cpu", ["mesh.experts=2"])
  with pytest.raises(ValueError, match="batch_size=0"):
    load_run_config("cpu", ["batch_size=0"])
  with pytest.raises(ValueError, match="data.kind='parquet'"):
    load_run_config("cpu", ["data.kind=parquet"])
  with pytest.raises(ValueError, match="no run config 'nonesuch'; known run configs: \\['cpu'"):
    load_run_config("nonesuch")
  with pytest.raises(ValueError, match=r"no run config 'tiny' \(a model config: use model=NAME\)"):
    load_run_config("tiny")
  with pytest.raises(ValueError, match="hidden_sise"):
    model_config_for(load_run_config("cpu", ["model.hidden_sise=8"]))
  with pytest.raises(ValueError, match="needs 6 devices"):
    build_mesh(MeshConfig(data=3, expert=2))
  run_config = load_run_config("cpu", ["model.num_hidden_layers=3", "runtime.dispatcher=all_to_all"])
  assert model_config_for(run_config) == load_config("tiny", num_hidden_layers=3)
  assert run_config.runtime == RuntimeConfig(dispatcher="all_to_all", dtype="float32")
  for moved, where in (("dispatcher=all_to_all", "dispatcher is now runtime.dispatcher"),
                       ("model.scan_layers=false", "model.scan_layers is now runtime.scan_layers")):
    with pytest.raises(ValueError, match=where):
      load_run_config("cpu", [moved])
  with pytest.raises(ValueError, match=r"\['remat'\] say how the model runs"):
    model_config_for(dataclasses.replace(load_run_config("cpu"), model_overrides={"remat": "layer"}))


def test_data_sources_are_deterministic_and_resumable(tmp_path):
  synthetic = SyntheticLanguage(64, 3, seed=5)
  batch = synthetic.batch(7, 4, 10)
  assert batch.shape == (4, 11)
  np.testing.assert_array_equal(batch, SyntheticLanguage(64, 3, seed=5).batch(7, 4, 10))
  for row in batch:
    for prev, nxt in zip(row[:-1], row[1:]):
      assert nxt in synthetic.successors[prev]
  assert synthetic.entropy_floor == pytest.approx(math.log(3))

  tokens = np.arange(1000, dtype=np.uint32) % 300
  (tmp_path / "t.bin").write_bytes(tokens.tobytes())
  source = make_source(DataConfig(kind="tokens", path=str(tmp_path / "t.bin"), token_dtype="uint32"), 300)
  b0, b1 = source.batch(0, 2, 8), source.batch(1, 2, 8)
  np.testing.assert_array_equal(b0[0], tokens[0:9])
  np.testing.assert_array_equal(b1[0], tokens[16:25])  # batch 1 starts where batch 0 ended
  with pytest.raises(ValueError, match="token id 299 is out of range"):
    make_source(DataConfig(kind="tokens", path=str(tmp_path / "t.bin"), token_dtype="uint32"), 256)
  # A file that shrinks under the run is an error naming the step (a memory map's read past its end was SIGBUS).
  before = data_stamp(DataConfig(kind="tokens", path=str(tmp_path / "t.bin")))
  os.truncate(tmp_path / "t.bin", 400)
  np.testing.assert_array_equal(source.batch(0, 2, 8), b0)  # what is still there reads
  with pytest.raises(DataChanged, match=rf"^step 9: data.path '{tmp_path / 't.bin'}' shrank under the run to 400 "
                                        r"bytes \(4000 when it started\); stopping$"):
    source.batch(9, 2, 8)
  now = data_stamp(DataConfig(kind="tokens", path=str(tmp_path / "t.bin")))
  assert before["bytes"] == 4000 and now["bytes"] == 400
  assert data_change(before, before) is None and "(4000 bytes, modified " in data_change(before, now)

  (tmp_path / "t.txt").write_text("héllo, relay " * 20, encoding="utf-8")
  text = make_source(DataConfig(kind="text", path=str(tmp_path / "t.txt")), 256)
  np.testing.assert_array_equal(text.batch(0, 1, 4)[0], list("héll".encode("utf-8")[:5]))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("extra", [pytest.param([], id="rows", marks=pytest.mark.slow), pytest.param(
    ["runtime.context_parallel=true", "mesh.data=1", "mesh.expert=8"], id="context-parallel",
    marks=pytest.mark.slow)])
def test_two_processes_on_cpu_match_one(tmp_path, extra):
  """Two local processes with 4 emulated devices each (gloo collectives) train exactly like one process with 8
  (under context parallelism over all 8, each sequence spans both processes)."""
  port = _free_port()
  common = ["--config", "cpu", "--steps", "3", "--cpu-devices", "4", "batch_size=8", "seq_len=16", "log_every=1",
            "tensorboard=false", f"out_dir={tmp_path / 'multi'}", *extra]
  env = dict(os.environ, XLA_FLAGS="", PYTHONPATH=REPO)
  procs = [subprocess.Popen([sys.executable, "-m", "train.cli", "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", "2", "--process-id", str(i), *common], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  for p in procs:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
  multi = [json.loads(line) for line in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
  single = run(load_run_config("cpu", ["steps=3", "batch_size=8", "seq_len=16", "log_every=1",
                                       "tensorboard=false", f"out_dir={tmp_path / 'single'}", *extra]))
  assert [r["step"] for r in multi] == [0, 1, 2]
  for a, b in zip(multi, single):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_cli_keeps_the_compiled_step_in_its_compilation_cache(tmp_path):
  cache = tmp_path / "xla-cache"
  cmd = [sys.executable, "-m", "train.cli", "--config", "cpu", "--steps", "1", "batch_size=8", "seq_len=16",
         "tensorboard=false", f"out_dir={tmp_path / 'run'}", f"compilation_cache_dir={cache}"]
  proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, XLA_FLAGS="", PYTHONPATH=REPO), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert any(p.name.startswith("jit_train_step") for p in cache.iterdir()), sorted(cache.iterdir())


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_a_save_that_crashed_midway_leaves_the_previous_checkpoint_latest(tmp_path):
  """orbax writes a step into a temporary folder and renames it when complete; a crash leaves only that folder."""
  config = tiny_run(tmp_path, steps=3)
  run(config)
  checkpoint_dir = tmp_path / "run" / "checkpoints"
  partial = checkpoint_dir / "9.orbax-checkpoint-tmp-1234567890"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "half_written").write_bytes(b"\0" * 100)
  checkpoints = Checkpoints(checkpoint_dir, 2)
  assert checkpoints.latest_step() == 3
  checkpoints.close()
  resumed = run(dataclasses.replace(config, steps=4), resume=True)
  assert [r["step"] for r in resumed] == [3]


@pytest.mark.slow  # compiles a step of its own (~10-15 s on 2 cores); CI's second step runs it
def test_memory_plan_sees_the_real_training_state_from_shapes_alone():
  """The abstract state has the real one's shapes, dtypes and shardings (FSDP, stacked layers, Adam moments); the
  plan's state bytes per device are the real state's bytes on one device."""
  runtime = dataclasses.replace(F32, fsdp=True)
  run_config = RunConfig(model="tiny", runtime=runtime, mesh=MeshConfig(data=2, expert=4), batch_size=8,
                         seq_len=16, steps=2)
  mesh = build_mesh(run_config.mesh)
  model_config = model_config_for(run_config)
  optimizer, _ = make_optimizer(run_config.optim, run_config.steps)
  _, abstract = abstract_train_state(model_config, runtime, mesh, optimizer)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(model_config, mesh, runtime=runtime)))
  real = on_mesh(TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32)), mesh)
  (paths, abstract_leaves), real_leaves = zip(*jax.tree_util.tree_leaves_with_path(abstract)), jax.tree.leaves(real)
  assert len(abstract_leaves) == len(real_leaves)
  for path, a, r in zip(paths, abstract_leaves, real_leaves):
    assert (a.shape, a.dtype) == (r.shape, r.dtype), jax.tree_util.keystr(path)
    assert a.sharding.is_equivalent_to(r.sharding, r.ndim), (jax.tree_util.keystr(path), a.sharding, r.sharding)
  plan = memory_plan(run_config)
  device = jax.devices()[0]
  assert plan["state_bytes"] == sum(s.data.nbytes for x in real_leaves for s in x.addressable_shards
                                    if s.device == device)
  assert plan["temp_bytes"] > 0 and plan["total_bytes"] >= plan["state_bytes"] + plan["temp_bytes"]
  assert plan["layers"] == 2 and plan["device_limit_bytes"] is None  # CPU devices report no limit


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_cli_compile_only_reports_the_plan_and_trains_nothing(tmp_path):
  cmd = [sys.executable, "-m", "train.cli", "--config", "cpu", "--compile-only", "model.num_hidden_layers=3",
         f"out_dir={tmp_path / 'run'}", "compilation_cache_dir=''"]
  proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, XLA_FLAGS="", PYTHONPATH=REPO), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "3 layers on 8 devices" in proc.stdout and "training state" in proc.stdout, proc.stdout
  plan = json.loads((tmp_path / "run" / "memory_plan.json").read_text())
  assert plan["layers"] == 3 and plan["state_bytes"] > 0
  assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["memory_plan.json"]


def test_cli_takes_overrides_before_and_after_options():
  args = _parse(["--config", "ep8", "model.num_hidden_layers=4", "--out", "d", "steps=2", "--compile-only"])
  assert args.overrides == ["model.num_hidden_layers=4", "steps=2"] and args.out == "d" and args.compile_only


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_a_checkpoint_with_the_shared_experts_old_parameter_names_resumes(tmp_path):
  """Checkpoints written before the shape letters were unified name the shared expert's weights `shared_*_DS` and
  `shared_down_SD`: they restore, value for value, under the new names, and a run resumes from them."""
  config = tiny_run(tmp_path, steps=2, model_overrides={"shared_expert_intermediate_size": 32})
  mesh = build_mesh(config.mesh)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(model_config_for(config), mesh, runtime=F32)))
  optimizer, _ = make_optimizer(config.optim, config.steps)
  state = on_mesh(TrainState(params, optimizer.init(params), jnp.ones((), jnp.int32)), mesh)
  old_names = {new: old for old, new in train_checkpoints.RENAMED.items()}
  with Checkpoints(tmp_path / "run" / "checkpoints", 2) as saver:
    saver.save(1, train_checkpoints._renamed(state, old_names), {"next_batch": 1, "samples_seen": 8})
  with Checkpoints(tmp_path / "run" / "checkpoints", 2) as reader:
    stored = str(reader.manager.item_metadata(1)["state"])
    restored, meta = reader.restore(state)
  assert "shared_gate_DS" in stored and "shared_gate_DF" not in stored
  assert meta["next_batch"] == 1
  flat, expected = jax.tree_util.tree_leaves_with_path(restored), jax.tree_util.tree_leaves_with_path(state)
  assert [p for p, _ in flat] == [p for p, _ in expected]
  assert any("shared_gate_DF" in jax.tree_util.keystr(p) for p, _ in flat)
  for (path, a), (_, b) in zip(flat, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  assert [r["step"] for r in run(config, resume=True)] == [1]


def test_the_trainer_gives_jax_95_percent_of_each_gpu_unless_told_otherwise(monkeypatch):
  """Set before JAX's backends start (on a GPU the allocator's limit; JAX's own default is 75%)."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # _start appends to it
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  _start(_parse(["--config", "cpu"]), [])
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  _start(_parse(["--config", "cpu"]), [])
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


def test_sizes_in_messages_read_in_mib_below_a_gib():
  sizes = (train_metrics.size(3 * 2**29), train_metrics.size(5 * 2**20), train_metrics.size(3072))
  assert sizes == ("1.50 GiB", "5.0 MiB", "3.0 KiB")
