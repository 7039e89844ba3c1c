"""The trainer loses nothing and does nothing silently: values checked by type, the run directory locked and never
trained over, SIGTERM saving a checkpoint, unreadable checkpoints skipped (kept), one-line CLI errors."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import requires_devices
from test_train import REPO, tiny_run
from train.rundir.checkpoints import CheckpointUnreadable
from train.cli import main
from train.config import RunConfig, load_run_config
from train.errors import exit_status
from train.loop import run
from train.mesh import run_mesh
from train.sources import model_config_for
from train import compile as train_compile
from train.plan import planner as planning
from train.rundir import preempt
from train.rundir.preempt import StopRequest, Stopped
from train.rundir.directory import RunDirectory, RunDirectoryError


@pytest.fixture(autouse=True)
def _eight_devices():
  requires_devices(8)


def earlier_run(out):
  """What an earlier run leaves, as far as a new run looks: checkpoint step 2 and metrics of steps 0 and 1."""
  (out / "checkpoints" / "2").mkdir(parents=True)
  (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')


def steps_in(path):
  return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit())


def logged_steps(out):
  return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("overrides,field,expected", [
    (["optim.learning_rate=1e-3"], "optim.learning_rate", 1e-3),  # YAML reads 1e-3 as a string
    (["steps=1e3"], "steps", 1000),
    (["mesh.data=2.0"], "mesh.data", 2),
    (["tensorboard=false"], "tensorboard", False),
    (["out_dir='123'"], "out_dir", "123"),
    (["compilation_cache_dir="], "compilation_cache_dir", ""),  # what the shell leaves of compilation_cache_dir=''
    (["runtime.remat=[layer, none]"], "runtime.remat", ("layer", "none")),
    (["runtime.remat=offload"], "runtime.remat", "offload"),
    (["model.rms_norm_eps=1e-5"], "model.rms_norm_eps", 1e-5),
])
def test_config_values_are_coerced_by_field_type(overrides, field, expected):
  config = load_run_config("cpu", overrides)
  section, key = field.split(".") if "." in field else (None, field)
  holder = model_config_for(config) if section == "model" else getattr(config, section) if section else config
  value = getattr(holder, key)
  assert value == expected and type(value) is type(expected), (value, expected)


@pytest.mark.parametrize("overrides,message", [
    (["steps=abc"], "steps='abc' is not an int"),
    (["steps=2.5"], "steps=2.5 is not an int"),
    (["tensorboard=maybe"], "tensorboard='maybe' is not true or false"),
    (["tensorboard=1"], "tensorboard=1 is not true or false"),
    (["optim.learning_rate=abc"], "optim.learning_rate='abc' is not a float"),
    (["optim.b1=true"], "optim.b1=True is not a float"),
    (["out_dir=123"], "out_dir=123 is not a string"),
    (["mesh=3"], "mesh must be a mapping"),
    (["model.num_hidden_layers=two"], "num_hidden_layers='two' is not an int"),
    (["runtime.remat=[1, 2]"], r"remat=\[1, 2\] is not a string \(quote it\), or a list of str"),
    (["runtime.remat=maybe"], r"remat \['maybe'\] unknown; each layer's is one of"),
    (["model.mlp_only_layers=[0, x]"], r"mlp_only_layers=\[0, 'x'\] is not a list of int"),
])
def test_config_values_of_the_wrong_type_are_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    model_config_for(load_run_config("cpu", overrides))


def test_yaml_values_are_checked_too(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text("model: tiny\noptim: {learning_rate: 1e-3}\nsteps: 3\n")
  assert load_run_config(str(path)).optim.learning_rate == 1e-3
  path.write_text("model: tiny\nseq_len: long\n")
  with pytest.raises(ValueError, match="seq_len='long' is not an int"):
    load_run_config(str(path))


def test_a_batch_that_does_not_split_over_the_token_shards_is_named(tmp_path):
  with pytest.raises(ValueError, match=r"batch_size=6 does not split over the mesh's 8 shards of rows \(data=2 × "
                                       r"expert=4\): use a multiple of 8"):
    run_mesh(tiny_run(tmp_path, batch_size=6))
  with pytest.raises(ValueError, match=r"^micro_batches=4: a micro-batch of 4 sequences \(batch_size=16 / "
                                       r"micro_batches\) does not split over the mesh's 8 shards of rows \(data=2 × "
                                       r"expert=4\); micro_batches may be 1, 2 with this batch_size, or batch_size a "
                                       r"multiple of 32$"):
    run_mesh(tiny_run(tmp_path, batch_size=16, micro_batches=4))


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_a_fresh_run_into_an_earlier_run_is_refused_unless_overwritten(tmp_path):
  config = tiny_run(tmp_path, steps=1, checkpoint_every=1)
  out = tmp_path / "run"
  earlier_run(out)
  (out / "notes.txt").write_text("mine")
  start = time.perf_counter()
  with pytest.raises(RunDirectoryError, match=r"run holds an earlier run \(checkpoint step 2\); continue it with "
                                              r"--resume, or start over with --overwrite"):
    run(config)
  assert time.perf_counter() - start < 5  # refused before anything is built or compiled
  with pytest.raises(ValueError, match="pass one"):
    run(config, resume=True, overwrite=True)
  assert steps_in(out / "checkpoints") == [2] and logged_steps(out) == [0, 1]
  history = run(config, overwrite=True)
  assert [r["step"] for r in history] == [0]
  assert steps_in(out / "checkpoints") == [1] and logged_steps(out) == [0]  # the old run's outputs are gone
  assert (out / "notes.txt").read_text() == "mine"  # and nothing else


def test_one_run_at_a_time_holds_the_directory(tmp_path):
  config = tiny_run(tmp_path)
  with RunDirectory(config.out_dir):
    with pytest.raises(RunDirectoryError, match=rf"run is in use by another run \(pid {os.getpid()} on "):
      run(config)
  # A holder killed with SIGKILL leaves no stale lock: the OS drops a flock with its process.
  holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                             "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
                             str(tmp_path / "run" / ".lock")], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirectoryError, match="in use by another run"):
      RunDirectory(config.out_dir).__enter__()
  finally:
    holder.kill()
    holder.wait()
  with RunDirectory(config.out_dir):
    pass


def test_a_repeated_signal_does_not_change_the_plan():
  previous = signal.getsignal(signal.SIGINT)
  with StopRequest() as stop:
    assert stop.requested() is None
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested() == signal.SIGINT  # the first asks the loop to save and stop
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested() == signal.SIGINT  # a repeated signal does not change the plan
  assert signal.getsignal(signal.SIGINT) is previous


# A process whose main thread is in a compile: it runs no signal handler until the compile returns (SIGINT blocked
# there stands in for it). A handler's KeyboardInterrupt raised inside jaxlib's compile ended in a segmentation fault
# or `pure virtual method called` a minute later, once Python had shut down under the compile still running.
IN_A_COMPILE = """
import signal, time
from train import compile as train_compile
from train.plan import planner as planning
from train.rundir import preempt
from train.rundir.preempt import StopRequest, Stopped
with StopRequest():
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  print("compiling", flush=True)
  time.sleep(60)
"""


def test_a_second_ctrl_c_ends_the_process_from_a_thread_of_its_own(monkeypatch, capfd):
  """Not from a handler in the main thread, which runs only between bytecodes (not inside a compile), and whose
  exception could land in any callback."""
  exits = []
  monkeypatch.setattr(preempt.os, "_exit", exits.append)
  with StopRequest():
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.time() + 10
    while not exits and time.time() < deadline:
      time.sleep(0.01)
  assert exits == [130]
  assert capfd.readouterr().err == ("\nrelaymoe-train: got SIGTERM; saving a checkpoint after this step, then stopping "
                                    "(Ctrl-C again to abort without saving)\nrelaymoe-train: interrupted again: "
                                    "aborted without saving\n")


@pytest.mark.slow  # a Python process of its own that imports JAX: 2-6 s on 2 cores
def test_a_second_ctrl_c_ends_the_process_at_once_even_inside_a_compile():
  proc = subprocess.Popen([sys.executable, "-c", IN_A_COMPILE], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=REPO))
  try:
    assert proc.stdout.readline() == "compiling\n"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=20)
  finally:
    proc.kill()
  assert proc.returncode == 130, stderr
  assert stderr == ("\nrelaymoe-train: got SIGINT; saving a checkpoint after this step, then stopping (Ctrl-C again to "
                    "abort without saving)\nrelaymoe-train: interrupted again: aborted without saving\n"), stderr


@pytest.mark.parametrize("workers", [1, 2], ids=["one-compile-at-a-time", "compiles-at-once"])
def test_sigterm_while_planning_stops_before_the_next_compile(tmp_path, monkeypatch, workers):
  """runtime.remat=auto compiles several steps before the first one runs (minutes on a GPU): a SIGTERM among them
  stops the run before the next compile, with nothing to save, instead of after every remaining compile."""
  traced = []

  def trace_and_get_terminated(run_config, devices=None, **resolved):  # stands in for the trace; then the compile
    traced.append(run_config.runtime.remat)
    if len(traced) == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.time() + 10
    while not preempt._AT_ONCE.signum and time.time() < deadline:  # the main thread's handler has run
      time.sleep(0.01)
    return (None,) * 5

  monkeypatch.setattr(train_compile, "trace_step", trace_and_get_terminated)
  monkeypatch.setattr(planning, "concurrent_compiles", lambda devices=None: workers)
  config = tiny_run(tmp_path, runtime=dataclasses.replace(tiny_run(tmp_path).runtime, remat="auto"),
                    device_memory_gib=0.001)
  with pytest.raises(Stopped) as stopped:
    run(config)
  assert str(stopped.value) == ("stopped by SIGTERM before the first step, while planning or compiling it: nothing "
                                "to save") and exit_status(stopped.value) == 143
  assert 1 <= len(traced) <= workers, traced  # of the three uniform steps, only those already started
  assert not (tmp_path / "run").exists()  # nothing of its own left behind


@pytest.mark.slow  # an end-to-end run; CI's second step runs it
def test_sigterm_saves_a_checkpoint_and_resume_continues_from_it(tmp_path):
  """A subprocess gets SIGTERM mid-run: it saves the step it reached, exits 143 with one line, and --resume
  continues from there with no step logged twice."""
  out = tmp_path / "run"
  overrides = ["batch_size=8", "seq_len=16", "log_every=1", "checkpoint_every=1000", "tensorboard=false",
               f"out_dir={out}"]
  proc = subprocess.Popen([sys.executable, "-m", "train.cli", "--config", "cpu", "--steps", "1000", *overrides,
                           f"compilation_cache_dir={tmp_path / 'cache'}"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ, XLA_FLAGS="", PYTHONPATH=REPO))
  try:
    deadline = time.time() + 240
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()) and time.time() < deadline:
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 143, stderr[-3000:]
  saved = steps_in(out / "checkpoints")
  assert len(saved) == 1 and 0 < saved[0] < 1000, saved
  assert f"relaymoe-train: stopped by SIGTERM: saved checkpoint step {saved[0]} in " in stderr
  assert "Traceback" not in stderr
  assert logged_steps(out) == list(range(saved[0]))
  history = run(load_run_config("cpu", [*overrides, f"steps={saved[0] + 2}"]), resume=True)
  assert [r["step"] for r in history] == [saved[0], saved[0] + 1]
  assert logged_steps(out) == list(range(saved[0] + 2))


def _corrupt(checkpoint):
  """Cuts every array file of a checkpoint short, as a full disk or a half-copied run directory would."""
  for path in checkpoint.rglob("d/*"):
    path.write_bytes(path.read_bytes()[:10])


@pytest.mark.slow  # trains a step of its own (compiles ~10-30 s on 2 cores); CI's second step runs it
def test_resume_skips_unreadable_checkpoints_and_keeps_them(tmp_path, capfd):
  config = tiny_run(tmp_path, steps=4, checkpoint_every=2)
  out = tmp_path / "run"
  run(config)
  _corrupt(out / "checkpoints" / "4")
  capfd.readouterr()
  history = run(dataclasses.replace(config, steps=5), resume=True)
  captured = capfd.readouterr()
  stderr = captured.err
  assert "resuming from step 2 (checkpoint " in captured.out
  assert [r["step"] for r in history] == [2, 3, 4]  # from the checkpoint before the unreadable one
  assert "skipped checkpoint step 4 in " in stderr and ": its metadata does not read" in stderr, stderr
  assert "Event loop is closed" not in stderr
  assert steps_in(out / "checkpoints-unreadable") == [4]  # set aside, not deleted
  assert steps_in(out / "checkpoints") == [4, 5]  # and this run saved its step 4 anew
  assert logged_steps(out) == [0, 1, 2, 3, 4]
  for step in (4, 5):
    _corrupt(out / "checkpoints" / str(step))
  with pytest.raises(CheckpointUnreadable, match="no checkpoint in .* restores: step 5: .*; step 4: "):
    run(config, resume=True)
  assert steps_in(out / "checkpoints") == [4, 5]


def test_the_cli_run_in_process_leaves_the_tests_without_a_persistent_compilation_cache(tmp_path, capsys,
                                                                                          monkeypatch):
  """The CLI turns JAX's persistent cache on before failing here; what compiles after it must not be stored (XLA:CPU
  programs read back from that cache aborted the suite: conftest keeps it off in the test process)."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  cache = tmp_path / "cache"
  min_compile_s = jax.config.jax_persistent_cache_min_compile_time_secs
  try:
    with pytest.raises(SystemExit):
      main(["--config", "cpu", f"compilation_cache_dir={cache}", "--out", str(tmp_path / "run"), "--resume"])
    assert "--resume: no checkpoint in" in capsys.readouterr().err
    assert jax.config.jax_compilation_cache_dir == str(cache)  # what the CLI does: the cache would be on
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # store whatever compiles
    jax.jit(lambda x: x * 3.25 + 1.0)(np.ones(7, np.float32)).block_until_ready()
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    jax.config.update("jax_compilation_cache_dir", None)
  assert not cache.exists() or not any(cache.iterdir()), sorted(cache.iterdir())


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  earlier_run(tmp_path / "run")
  common = ["--config", "cpu", "compilation_cache_dir=''", "batch_size=8", "seq_len=16"]
  cases = [(["steps=abc"], 2, "error: override: steps='abc' is not an int"),
           (["batch_size=6"], 2, "error: batch_size=6 does not split"),
           (["micro_batches=4", "--out", str(tmp_path / "micro")], 2, "error: micro_batches=4: a micro-batch of 2 "
            "sequences (batch_size=8 / micro_batches) does not split over the mesh's 8 shards of rows (data=2 × "
            "expert=4); micro_batches may be 1 with this batch_size, or batch_size a multiple of 32"),
           (["runtime.context_parallel=true", "seq_len=20"], 2, "error: context parallelism over expert=4 cuts each "
            "sequence into 8 chunks: seq_len=20 is not a multiple of 8"),
           (["runtime.context_parallel=true", "batch_size=3"], 2, "error: batch_size=3 does not split over the "
            "mesh's 2 shards of rows (data=2)"),
           (["--out", str(tmp_path / "run")], 2, "error: " + str(tmp_path / "run") + " holds an earlier run"),
           (["--out", str(tmp_path / "none"), "--resume"], 2, "error: --resume: no checkpoint in")]
  for argv, status, message in cases:
    with pytest.raises(SystemExit) as exit_info:
      main(common + argv)
    stdout, stderr = capsys.readouterr()
    assert exit_info.value.code == status, (argv, stderr)
    assert stderr.startswith(f"relaymoe-train: {message}") and stderr.count("\n") == 1, (argv, stderr)
    assert "compiling" not in stdout, (argv, stdout)  # refused before anything compiles
  try:  # a ValueError from below the project (a bug, not a bad input) keeps its traceback
    np.ones(3).reshape(2)
  except ValueError as err:
    assert exit_status(err) is None
  with pytest.raises(ValueError, match="steps='abc'"):
    main([*common, "steps=abc", "--debug"])


@pytest.mark.slow  # compiles a step of its own (~10-15 s on 2 cores); CI's second step runs it
def test_a_non_finite_loss_before_any_checkpoint_says_there_is_none(tmp_path):
  diverging = tiny_run(tmp_path, steps=1, checkpoint_every=1,
                       optim=dataclasses.replace(RunConfig().optim, learning_rate=float("inf")))
  with pytest.raises(FloatingPointError, match="step 0.*There is no checkpoint yet in"):
    run(diverging)
