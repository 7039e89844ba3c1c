"""Faults the trainer meets at scale end cleanly: damaged checkpoints skipped (kept), a full disk during a save or a
failing log writer named in one line (no hang, no flood), a signal during the last save, and one-line errors for
inputs that cannot work, found before anything compiles."""

import dataclasses
import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import pytest
from flax import nnx
from orbax.checkpoint._src.path import atomicity
from tensorboardX import record_writer
from tensorboardX.proto import event_pb2

from conftest import requires_devices
from models.qwen3 import model as qwen3
from test_train import REPO, tiny_run
from train import convert, xla_cache
from train.rundir.checkpoints import Checkpoints, CheckpointSaveFailed
from train.cli import main
from train.step import abstract_train_state
from train.config import load_run_config
from train.errors import exit_status
from train.loop import dispatch_plan, run
from train.mesh import build_mesh, on_mesh
from train.metrics import LogWriteFailed, MetricsLog
from train.sources import model_config_for
from train.step import TrainState, make_optimizer


@pytest.fixture(autouse=True)
def _eight_devices():
  requires_devices(8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run directory as a run leaves it, with checkpoints 1 to 4 (saved here, not trained: no step compiles), to
  copy and damage."""
  config = tiny_run(tmp_path_factory.mktemp("trained"), steps=4, keep_checkpoints=4)
  out = pathlib.Path(config.out_dir)
  mesh = build_mesh(config.mesh)
  model_config = model_config_for(config)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(model_config, mesh, runtime=config.runtime)))
  optimizer, _ = make_optimizer(config.optim, config.steps)
  with Checkpoints(out / "checkpoints", config.keep_checkpoints) as checkpoints:
    for step in range(1, 5):
      state = on_mesh(TrainState(params, optimizer.init(params), jnp.full((), step, jnp.int32)), mesh)
      checkpoints.save(step, state, {"next_batch": step, "samples_seen": step * config.batch_size})
  (out / "run_config.json").write_text(json.dumps(dict(run=dataclasses.asdict(config),
                                                       model=dataclasses.asdict(model_config))))
  return config, out


def _truncate(checkpoint):
  for path in (checkpoint / "state" / "ocdbt.process_0" / "d").iterdir():
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def _flip_bits(checkpoint):
  for path in (checkpoint / "state" / "ocdbt.process_0" / "d").iterdir():
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _remove_array_data(checkpoint):
  shutil.rmtree(checkpoint / "state" / "ocdbt.process_0")


@pytest.mark.slow  # 13 s on 2 cores (the default run reached 10.5 min on CI); CI's second step runs it
def test_checkpoints_whose_arrays_are_damaged_are_skipped_for_resume_and_convert(trained, tmp_path, capfd):
  config, out = trained
  damaged = tmp_path / "resume"
  shutil.copytree(out, damaged)
  _truncate(damaged / "checkpoints" / "4")
  _flip_bits(damaged / "checkpoints" / "3")
  _remove_array_data(damaged / "checkpoints" / "2")
  mesh = build_mesh(config.mesh)
  optimizer, _ = make_optimizer(config.optim, config.steps)
  _, abstract = abstract_train_state(model_config_for(config), config.runtime, mesh, optimizer)
  capfd.readouterr()
  with Checkpoints(damaged / "checkpoints", 4) as checkpoints:
    state, meta = checkpoints.restore(abstract)  # what --resume does
  stderr = capfd.readouterr().err
  assert meta["next_batch"] == 1 and int(state.step) == 1
  assert "skipped checkpoint step 4 in " in stderr and "its arrays do not read (OUT_OF_RANGE" in stderr, stderr
  assert "skipped checkpoint step 3 in " in stderr and "do not match their checksums" in stderr, stderr
  assert "skipped checkpoint step 2 in " in stderr, stderr
  assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
  assert sorted(int(p.name) for p in (damaged / "checkpoints-unreadable").iterdir()) == [2, 3, 4]

  source = tmp_path / "convert"
  shutil.copytree(out, source)
  _truncate(source / "checkpoints" / "4")
  convert.main(["orbax-to-hf", str(source), str(tmp_path / "hf")])
  captured = capfd.readouterr()
  assert "skipped checkpoint step 4 in " in captured.err and "using step 3" in captured.err, captured.err
  assert (tmp_path / "hf" / "config.json").exists() and "Traceback" not in captured.err
  assert (source / "checkpoints" / "4").exists() and not (source / "checkpoints-unreadable").exists()  # a source


def _failing_finalize(monkeypatch, step, failure):
  """orbax's last act of a save (renaming it into place, in its background thread) runs `failure` for `step`."""
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def patched(self):
    if pathlib.Path(self._final_path).name == str(step):
      failure()
    return await finalize(self)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", patched)


def test_a_full_disk_during_a_save_is_one_line_naming_the_last_good_checkpoint(tmp_path, monkeypatch, capfd):
  def disk_full():
    raise OSError(errno.ENOSPC, "No space left on device")

  _failing_finalize(monkeypatch, 2, disk_full)
  state = {"a": jnp.arange(1000.0), "b": jnp.ones((8, 8), jnp.bfloat16)}
  directory = tmp_path / "checkpoints"
  with pytest.raises(CheckpointSaveFailed) as failed:
    with Checkpoints(directory, 2) as checkpoints:
      for step in (1, 2, 3):
        checkpoints.save(step, state, {"next_batch": step})
  message = str(failed.value)
  assert message.startswith(f"no space left on the device of {directory} to save checkpoint step 2: it needs up "
                            "to 4.0 KiB (4128 bytes) and "), message
  assert message.endswith(f"bytes are free; the last good checkpoint is step 1 in {directory}"), message
  assert exit_status(failed.value) == 1 and "\n" not in message
  captured = capfd.readouterr()
  assert "Traceback" not in captured.err and "No space left" not in captured.err, captured.err[-3000:]
  # Each save is logged when it starts and when it ends, with its size and time.
  assert f"saving checkpoint step 1 (4.0 KiB) to {directory}\n" in captured.out, captured.out
  assert any(line.startswith("saved checkpoint step 1 (4.0 KiB) in ") and line.endswith(" s")
             for line in captured.out.splitlines()), captured.out


SLOW_LAST_SAVE = """
import asyncio, pathlib, sys
from orbax.checkpoint._src.path import atomicity
finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def slow(self):  # the last save (step 3) takes a while, as 30 GB do
  if pathlib.Path(self._final_path).name == "3":
    pathlib.Path(sys.argv[1]).write_text("saving")
    await asyncio.sleep(4)
  return await finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = slow
from train.cli import main
main(sys.argv[2:])
"""


@pytest.mark.slow
def test_sigterm_during_the_last_save_lets_it_finish_and_exits(tmp_path):
  out, marker = tmp_path / "run", tmp_path / "saving"
  overrides = ["steps=3", "checkpoint_every=2", "batch_size=8", "seq_len=16", "tensorboard=false", f"out_dir={out}"]
  proc = subprocess.Popen(
      [sys.executable, "-c", SLOW_LAST_SAVE, str(marker), "--config", "cpu", *overrides,
       f"compilation_cache_dir={tmp_path / 'cache'}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=dict(os.environ, XLA_FLAGS="", PYTHONPATH=REPO))
  try:
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
      time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    signalled = time.time()
    stdout, stderr = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert time.time() - signalled < 30
  assert proc.returncode == 0, stderr[-3000:]
  assert "got SIGTERM; letting the last checkpoint's save finish (the run is complete)" in stderr, stderr[-3000:]
  assert "got SIGTERM after the last step: the run is complete, its last checkpoint (step 3) saved" in stdout
  assert "Traceback" not in stderr
  config = load_run_config("cpu", overrides)
  mesh = build_mesh(config.mesh)
  optimizer, _ = make_optimizer(config.optim, config.steps)
  _, abstract = abstract_train_state(model_config_for(config), config.runtime, mesh, optimizer)
  for step in (2, 3):
    with Checkpoints(out / "checkpoints", 2) as checkpoints:
      assert checkpoints.restore(abstract, step=step)[1]["next_batch"] == step


@pytest.mark.slow  # 13-29 s on 2 cores (the default run reached 11.5 min); CI's second step runs it
def test_a_failing_log_writer_neither_hangs_nor_loses_the_run(tmp_path, monkeypatch, capfd):
  """TensorBoard's file writer fails (as on a full disk): TensorBoard is turned off with a warning and the run goes
  on. Then metrics.jsonl fails: the run saves a checkpoint and stops with one line."""
  writes = []

  def failing_write(self, data):
    writes.append(data)
    if len(writes) > 20:  # during step 1's scalars
      raise OSError(errno.ENOSPC, "No space left on device")
    return original_write(self, data)

  original_write = record_writer.RecordWriter.write
  monkeypatch.setattr(record_writer.RecordWriter, "write", failing_write)
  original_open = pathlib.Path.open
  rows = []

  def open_metrics(self, mode="r", *args, **kwargs):
    if self.name == "metrics.jsonl" and mode == "a":
      rows.append(None)
      if len(rows) > 3:  # step 3's row
        raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return original_open(self, mode, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, "open", open_metrics)
  outcome = []

  def train():
    try:
      run(tiny_run(tmp_path, steps=6, checkpoint_every=100, tensorboard=True))
    except LogWriteFailed as err:  # anything else: the thread prints it, and outcome stays empty
      outcome.append(err)

  # A thread, so that a writer that blocks fails the test instead of hanging it.
  worker = threading.Thread(target=train, daemon=True)
  worker.start()
  worker.join(timeout=180)
  assert not worker.is_alive(), "the run hangs on its failed log writer"
  assert len(outcome) == 1 and isinstance(outcome[0], LogWriteFailed), outcome
  message = str(outcome[0])
  out = tmp_path / "run"
  assert message == (f"cannot write {out / 'metrics.jsonl'} (No space left on device); stopped after step 4, saved "
                     f"checkpoint step 5 in {out / 'checkpoints'}; continue with --resume"), message
  assert exit_status(outcome[0]) == 1
  stderr = capfd.readouterr().err
  assert stderr.count("warning: TensorBoard turned off") == 1 and "Traceback" not in stderr, stderr
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["5"]
  assert len((out / "metrics.jsonl").read_text().splitlines()) == 3  # steps 0 to 2; step 3's row did not write


def test_inputs_that_cannot_work_are_one_line_before_anything_compiles(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  bad_yaml = tmp_path / "bad.yaml"
  bad_yaml.write_text("model: tiny\nsteps: [3\n")
  a_file = tmp_path / "file"
  a_file.write_text("x")
  (tmp_path / "empty.bin").write_bytes(b"")
  (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
  (tmp_path / "short.bin").write_bytes(b"\0" * 8)
  (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 4)
  fresh = tmp_path / "fresh"
  leftover = tmp_path / "leftover" / "checkpoints" / "3.orbax-checkpoint-tmp-1234"
  leftover.mkdir(parents=True)
  earlier = tmp_path / "earlier"
  (earlier / "tensorboard").mkdir(parents=True)
  (earlier / "run_config.json").write_text("{}")
  common = ["--config", "cpu", "compilation_cache_dir=''", "batch_size=8", "seq_len=16", "tensorboard=false",
            "--out", str(tmp_path / "run")]
  cases = [
      (["--config", str(bad_yaml)], f"{bad_yaml} is not valid YAML: "),
      (["--out", "/proc/relaymoe/run"], "--out /proc/relaymoe/run: cannot use it as the run directory (No such file"),
      (["--out", str(a_file)], f"--out {a_file} is a file, not a directory"),
      (["--out", str(a_file / "run")], f"--out {a_file / 'run'}: cannot use it as the run directory (Not a dir"),
      ([f"data.path={tmp_path}", "data.kind=tokens"], f"data.path '{tmp_path}' is a directory; give a file"),
      ([f"data.path={tmp_path / 'empty.bin'}", "data.kind=tokens"], "data.path '" + str(tmp_path / "empty.bin")
       + "' is empty"),
      ([f"data.path={tmp_path / 'odd.bin'}", "data.kind=tokens"], "data.path '" + str(tmp_path / "odd.bin")
       + "' holds 7 bytes, not a whole number of uint16 tokens (2 bytes each)"),
      ([f"data.path={tmp_path / 'short.bin'}", "data.kind=tokens"], "data.path '" + str(tmp_path / "short.bin")
       + "' holds 4 tokens, too few for one window of seq_len+1=17"),
      ([f"data.path={tmp_path / 'binary.txt'}", "data.kind=text", "model.vocab_size=256"],
       "data.path '" + str(tmp_path / "binary.txt") + "' is not UTF-8 text (near byte 128)"),
      (["optim.learning_rate=-1"], "optim.learning_rate=-1.0 must be ≥ 0"),
      (["--out", str(fresh), "batch_size=6"], "batch_size=6 does not split"),
      (["--out", str(tmp_path / "leftover"), "--resume"], "--resume: no checkpoint in"),
      (["--out", str(earlier)], f"{earlier} holds an earlier run (tensorboard, run_config.json, no checkpoint); it "
       "has no checkpoint to --resume from; start over with --overwrite"),
  ]
  for argv, message in cases:
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
      main(common + argv)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, (argv, stderr)
    assert stderr.startswith(f"relaymoe-train: error: {message}") and stderr.count("\n") == 1, (argv, stderr)
    assert time.perf_counter() - start < 5, argv  # found before the step compiles
  assert not fresh.exists()  # a run that failed before writing anything leaves nothing
  assert not leftover.exists() and not (tmp_path / "leftover" / ".lock").exists()  # a killed save's files: cleaned

  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text('{"model_type": "qwen3_moe",')
  with pytest.raises(SystemExit) as exit_info:
    convert.main(["hf-to-orbax", str(hf_dir), str(tmp_path / "orbax")])
  stderr = capsys.readouterr().err
  assert exit_info.value.code == 2 and stderr.startswith(
      f"relaymoe-convert: error: {hf_dir / 'config.json'} is not valid JSON (") and stderr.count("\n") == 1, stderr


def test_a_ring_of_one_has_no_volume_plan(tmp_path):
  config = tiny_run(tmp_path)
  model_config = model_config_for(config)
  assert dispatch_plan(model_config, config, build_mesh(config.mesh)) is not None
  one = build_mesh(dataclasses.replace(config.mesh, data=8, expert=1))
  assert dispatch_plan(model_config, config, one) is None  # nothing moves: no "ring volume model prefers ..."


def test_a_resumed_run_replaces_the_tensorboard_events_of_the_steps_it_replays(tmp_path):
  log = MetricsLog(tmp_path, total_steps=10, start_step=3, tensorboard=True)
  log.write(dict(step=3, loss=1.0, tokens_per_s=1.0, tflops_per_device=1.0, peak_memory_bytes=0))
  log.close()
  events = []
  for path in (tmp_path / "tensorboard").iterdir():
    data = path.read_bytes()
    while data:  # TFRecord: length (8 bytes), its CRC (4), the event, its CRC (4)
      length = int.from_bytes(data[:8], "little")
      events.append(event_pb2.Event.FromString(data[12:12 + length]))
      data = data[16 + length:]
  starts = [e.step for e in events if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START]
  assert starts == [3]  # TensorBoard drops the earlier events of steps ≥ 3
  assert {v.tag for e in events for v in e.summary.value} == {"loss", "tokens_per_s", "tflops_per_device",
                                                               "peak_memory_bytes"}


def test_a_damaged_compilation_cache_entry_is_named_and_removed(tmp_path, capsys):
  """JAX warns without naming the file, compiles, and never replaces an entry it holds: the entry is removed so
  the compile that follows caches it anew, not compiled again on every run."""
  entry = tmp_path / "jit_step-abc-cache"
  entry.write_bytes(b"not zstd")
  (tmp_path / "jit_step-abc-atime").write_bytes(b"12345678")
  (tmp_path / "jit_other-def-cache").write_bytes(b"fine")

  def read(cache_key, compile_options, backend):  # as JAX's, on a damaged entry
    raise ValueError(f"Error -3 while decompressing {(tmp_path / f'{cache_key}-cache').read_bytes()!r}")

  with pytest.raises(ValueError, match="decompressing"):  # JAX warns and compiles
    xla_cache.dropping_damaged_entries(read, tmp_path)("jit_step-abc", None, None)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["jit_other-def-cache"]
  assert capsys.readouterr().err == (f"warning: removed the compilation cache entry {entry}, which does not read "
                                     "(ValueError: Error -3 while decompressing b'not zstd'): compiled again and "
                                     "cached anew\n")


# A jitted function run twice with its cache entries damaged in between, and a third time.
CACHED = """
import sys
import jax, jax.numpy as jnp
from train.xla_cache import use_compilation_cache
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
use_compilation_cache(sys.argv[1])
print(jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)))
"""


@pytest.mark.slow  # three Python processes that import JAX: 6-15 s on 2 cores
def test_a_damaged_compilation_cache_entry_is_compiled_once_more_not_forever(tmp_path):
  def cached_run():
    return subprocess.run([sys.executable, "-c", CACHED, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), check=True)

  cached_run()
  entries = {p: p.read_bytes() for p in tmp_path.glob("*-cache")}
  assert entries
  for path in entries:
    path.write_bytes(b"damaged")
  stderr = cached_run().stderr
  for path in entries:
    assert f"warning: removed the compilation cache entry {path}, which does not read (" in stderr, stderr
    assert path.read_bytes() not in (b"damaged", b"")  # cached anew
  assert "warning" not in cached_run().stderr.lower()
