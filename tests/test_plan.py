"""The activation planner (`train.plan.planner`), the trainer's `remat: auto` and fit guard, and `relaymoe-plan`, on the tiny
model over 8 emulated CPU devices.

CPU devices report no memory limit, so each test sets a budget (`device_memory_gib`) between the compiled bytes of
the uniform policies it measured. Every step is compiled from shapes alone; compiles are shared across the tests of
this module (a step is the same whatever the budget, run directory or logging).
"""

import dataclasses
import hashlib
import json
import os
import re
import threading
import types

import jax
import pytest

from relaymoe_jax.kernels import mosaic_gpu
from relaymoe_jax.errors import UserError
from train import cli, loop
from train.plan import greedy, loss_chunk, planner as planning, search as plan_search, remat_auto
from train import compile as train_compile
from train.compile import StepDoesNotFit, memory_plan
from train.config import load_run_config
from train.metrics import size
from train.plan.record import Plan, cached_plan_path, plan_from_dict, plan_key, store_plan
from train.mesh import build_mesh
from train import run as train_run
from train.sources import model_config_for

OVERRIDES = ["seq_len=128", "batch_size=8", "steps=2", "log_every=1", "checkpoint_every=0", "tensorboard=false",
             "compilation_cache_dir=''"]
BASE = load_run_config("cpu", OVERRIDES)
GIB = 2**30
# RunConfig fields that do not change the compiled step.
NOT_COMPILED = ("out_dir", "device_memory_gib", "memory_headroom", "tensorboard", "log_every", "checkpoint_every",
                "keep_checkpoints", "compilation_cache_dir")


loop_compile_step = train_compile.compile_step


@pytest.fixture(scope="module", autouse=True)
def shared_compiles():
  """compile_step memoized by everything that shapes the step, for the planner and the trainer alike."""
  compiled = {}
  original = train_compile.compile_step

  def compile_once(run_config, devices=None, memory_only=False, **resolved):  # on CPU memory-only is the same step
    key = repr(dataclasses.replace(run_config, **{f: getattr(BASE, f) for f in NOT_COMPILED}))
    if key not in compiled:
      compiled[key] = original(run_config, devices, memory_only=memory_only, **resolved)
    return compiled[key]

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train_run, "compile_step", compile_once)
    patch.setattr(planning, "compile_step", compile_once)
    yield


@pytest.fixture(scope="module")
def uniform():
  """Total bytes per device of the step with one policy in every layer."""
  planner = new_planner(BASE, 1 << 50)
  return {policy: planner.measure(policy)["total_bytes"] for policy in ("none", "attention", "layer")}


def with_runtime(run_config, **changes):
  """The run with its runtime changed (dispatcher, remat, dispatcher_options, ...)."""
  return dataclasses.replace(run_config, runtime=dataclasses.replace(run_config.runtime, **changes))


def new_planner(run_config, budget, **kwargs):
  """A Planner of `run_config` (its model config and mesh resolved here), logging nothing."""
  return planning.Planner(run_config, budget, model_config=model_config_for(run_config),
                          mesh=build_mesh(run_config.mesh), log=lambda *_: None, **kwargs)


def planner_with(budget, run_config=BASE):
  return new_planner(run_config, int(budget))


def resolve_remat(run_config, resume=False):
  """`remat_auto.resolve_remat` of `run_config` with its model config and mesh resolved as `train.run` does."""
  resolved = train_run.resolve_run(run_config)
  return remat_auto.resolve_remat(run_config, resolved.model_config, resolved.mesh, resume)


def caps_chunks(run_config):
  return planning.caps_chunks(run_config, model_config_for(run_config), build_mesh(run_config.mesh))


def between(uniform, fraction):
  """A budget `fraction` of the way from every layer recomputed to none."""
  return uniform["layer"] + fraction * (uniform["none"] - uniform["layer"])


def memory_gib(budget):
  """device_memory_gib whose planning budget (less the headroom) is `budget` bytes."""
  return budget / (1 - BASE.memory_headroom) / GIB


@pytest.mark.slow  # the uniform steps' compiles (~22 s on 2 cores; the default run reached 10.3 min on CI)
def test_recomputing_more_needs_less(uniform):
  assert uniform["layer"] <= uniform["attention"] < uniform["none"], uniform


@pytest.mark.slow  # compiles at 2048 tokens per device (~40 s on 2 cores); CI's second step runs it
def test_with_a_loss_chunk_to_search_the_plan_is_compiled_for_memory_only(tmp_path, monkeypatch):
  """The plan's step does not run where `loss_chunk_tokens: auto` may change it: the planner compiles its candidates
  for memory only, the search starts from the plan's bytes, and the trainer compiles the chosen step once."""
  config = dataclasses.replace(with_runtime(BASE, remat="auto"), seq_len=2048, batch_size=8, device_memory_gib=16,
                               out_dir=str(tmp_path))
  assert loss_chunk.searches(config) and not loss_chunk.searches(with_runtime(config, loss_chunk_tokens=1024))
  memory_only, measured = [], planning.compile_step
  monkeypatch.setattr(planning, "compile_step", lambda *a, memory_only=False, **k: memory_only_calls(a, memory_only, k))

  def memory_only_calls(args, flag, resolved):
    memory_only.append(flag)
    return measured(*args, memory_only=flag, **resolved)

  run_config, plan, _ = resolve_remat(config)
  assert memory_only and all(memory_only), memory_only
  assert run_config.runtime.loss_chunk_tokens == plan.loss_chunk_tokens in (1024, 2048), plan


@pytest.mark.slow  # compiles a mixed plan of its own (~17 s on 2 cores); CI's second step runs it
def test_a_budget_between_the_policies_gets_a_mixed_plan_that_fits(uniform):
  budget = between(uniform, 0.6)
  plan = planner_with(budget).plan()
  assert plan.fits and plan.total_bytes <= budget, plan
  assert plan.remat != ("none", "none"), "keeping everything does not fit this budget"
  assert plan.remat != ("layer", "layer"), "the slack above the frugal plan should buy an upgrade"
  assert plan.remat == tuple(sorted(plan.remat, key=planning.FRUGAL_FIRST.index))
  # The plan's bytes are those of the step it names; the slack left after the remat upgrades let the ring keep its
  # gate/up projections for the backward (a little more memory than recomputing them: the tiny model's 0.4 MB).
  assert plan.keep_gate_up and plan.summary().endswith(", ring keeps gate/up"), plan
  assert memory_plan(planning.apply_plan(BASE, plan))["total_bytes"] == plan.total_bytes
  assert memory_plan(planning.with_remat(BASE, plan.remat))["total_bytes"] < plan.total_bytes


def test_the_ring_keeps_gate_up_only_where_it_can_and_the_user_left_it_open():
  assert planning.keeps_gate_up(BASE) and planning.keeps_gate_up(with_runtime(BASE, dispatcher="auto"))
  assert not planning.keeps_gate_up(with_runtime(BASE, dispatcher="ring_token"))
  assert not planning.keeps_gate_up(with_runtime(BASE, dispatcher="all_to_all"))
  assert not planning.keeps_gate_up(with_runtime(BASE, dispatcher_options=dict(keep_gate_up=False)))
  assert not planning.keeps_gate_up(with_runtime(BASE, dispatcher_options=dict(recompute=False)))


@pytest.mark.slow  # 8-10 s on 2 cores; CI's second step runs it
def test_nothing_to_plan_when_everything_fits(uniform):
  """Keeping everything fits exactly; the ring keeping gate/up as well would not."""
  plan = planner_with(uniform["none"]).plan()
  assert plan.fits and plan.remat == ("none", "none") and not plan.keep_gate_up
  assert [what for what, _ in plan.compiles] == [{"remat": "none"}, {"remat": "none", "keep_gate_up": True}]


def test_the_plan_starts_from_the_policy_whose_step_needs_fewest_bytes(monkeypatch):
  """Recomputing more can need more bytes (XLA's schedule; Qwen3.5's 4-layer slice at 16 × 4096 on an H100: 73.8 GiB
  with `attention` in every layer, 76.0 with `layer`): the plan starts from the fewest bytes measured, not `layer` by
  rule, and caps nothing while a policy fits. The steps' bytes are stand-ins."""
  bytes_of = {"layer": 80, "attention": 60, "none": 120}

  def step_bytes(run_config, step=None):
    remat = run_config.runtime.remat
    remat = (remat,) if isinstance(remat, str) else remat
    total = sum(bytes_of[p] for p in remat) // len(remat)
    return dict(total_bytes=total, temp_bytes=total, state_bytes=0, compile_s=0.0)

  monkeypatch.setattr(planning, "compile_step", lambda run_config, *args, **kwargs: run_config)
  monkeypatch.setattr(planning, "memory_plan", step_bytes)
  plan = new_planner(BASE, 70).plan()
  assert plan.fits and set(plan.remat) == {"attention"} and plan.max_chunk_rows is None, plan


@pytest.mark.slow  # the default run reached 10.3 min on CI's 2 cores; CI's second step runs it
def test_a_budget_below_the_frugal_plan_is_reported_not_fitting(uniform):
  plan = planner_with(uniform["layer"] - 1).plan()
  assert not plan.fits and plan.remat == ("layer", "layer") and plan.total_bytes == uniform["layer"]


@pytest.mark.slow  # 13-29 s on 2 cores (the default run reached 11.5 min); CI's second step runs it
def test_remat_auto_trains_with_the_plan_and_stores_it(uniform, tmp_path, capsys):
  budget = between(uniform, 0.6)
  expected = planner_with(budget).plan()
  config = dataclasses.replace(with_runtime(BASE, remat="auto"), device_memory_gib=memory_gib(budget),
                               out_dir=str(tmp_path))
  history = loop.run(config)
  assert [r["step"] for r in history] == [0, 1]
  stored = json.loads((tmp_path / "run_config.json").read_text())
  assert tuple(stored["remat_plan"]["remat"]) == expected.remat and stored["remat_plan"]["fits"]
  assert tuple(stored["run"]["runtime"]["remat"]) == expected.remat and expected.keep_gate_up
  assert dict(stored["run"]["runtime"]["dispatcher_options"])["keep_gate_up"] is True
  # `loss_chunk_tokens: auto` was searched with the new plan's step, and its choice recorded with the plan.
  chunk = stored["remat_plan"]["loss_chunk_tokens"]
  assert isinstance(chunk, int) and stored["run"]["runtime"]["loss_chunk_tokens"] == chunk
  assert f"remat auto: {expected.summary()}" in capsys.readouterr().out

  # A rerun of the same configuration reads the plan (loss chunk included) from the run directory and compiles
  # only the step it runs.
  def no_planning(*args, **kwargs):
    raise AssertionError("planned again")

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(planning.Planner, "plan", no_planning)
    patch.setattr(loss_chunk, "widest", no_planning)
    assert [r["step"] for r in loop.run(config, overwrite=True)] == [0, 1]
  out = capsys.readouterr().out
  assert "planned before for this configuration" in out and f"loss chunk auto: {chunk} tokens" in out
  rerun = json.loads((tmp_path / "run_config.json").read_text())
  assert rerun["remat_plan"] == stored["remat_plan"] and rerun["run"]["runtime"] == stored["run"]["runtime"]
  # Another shape is planned anew.
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(planning.Planner, "plan", no_planning)
    with pytest.raises(AssertionError, match="planned again"):
      loop.run(dataclasses.replace(config, seq_len=64), overwrite=True)
  # A resume under another budget (a new plan key, as a new JAX or package version gives) keeps the checkpoints'
  # plan: planning anew could stack the layers otherwise, and the checkpoint would not restore.
  saving = dataclasses.replace(config, checkpoint_every=1)
  loop.run(saving, overwrite=True)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(planning.Planner, "plan", no_planning)
    roomier = dataclasses.replace(saving, steps=3, device_memory_gib=memory_gib(between(uniform, 0.9)))
    assert [r["step"] for r in loop.run(roomier, resume=True)] == [2]
  assert "the plan this run's checkpoints were written with" in capsys.readouterr().out
  assert json.loads((tmp_path / "run_config.json").read_text())["remat_plan"] == stored["remat_plan"]


@pytest.mark.slow  # the default run reached 10.9 min on 2 cores; CI's second step runs it
def test_offload_is_estimated_from_layer_and_compiled_only_where_a_plan_relies_on_it(uniform, monkeypatch):
  """Where the devices can offload, `offload` in every layer is `layer`'s step less each layer's input (no compile
  of its own). Below `layer`'s step only offloading can fit: the plan's bytes are then a compile's, never the
  estimate's. (On CPU with JAX 0.10 offloading saves nothing, so the estimate is optimistic and the uniform offload
  step is compiled and reported not fitting; with JAX 0.11 a mixed plan with an offloaded layer fits.)"""
  monkeypatch.setattr(planning, "offload_supported", lambda devices=None: True)
  roomy = planner_with(between(uniform, 0.6)).plan()
  assert roomy.fits and "offload" not in roomy.remat
  assert {"remat": "offload"} not in [what for what, _ in roomy.compiles]
  assert {"remat": "layer"} in [what for what, _ in roomy.compiles]
  budget = uniform["layer"] - 1
  tight = planner_with(budget).plan()
  assert "offload" in tight.remat and tight.fits == (tight.total_bytes <= budget), tight
  assert tight.total_bytes in [total for _, total in tight.compiles], "the plan's bytes are a compile's"


@pytest.mark.parametrize("seq_len, bought", [(128, "attention"), (1 << 20, "all_but_attention")])
def test_on_gpus_the_attention_kernels_outputs_are_kept_where_its_scores_dominate_the_recompute(monkeypatch, seq_len,
                                                                                             bought):
  """On GPUs the planner may keep what cuDNN's attention made and recompute the rest of the layer
  (`all_but_attention`): a few GiB a layer that save the attention kernel's rerun, the most of a long sequence's
  recompute. Given the uniform steps' bytes of the 30B shape at 1 × 393216 on one H200 (XLA's buffer assignment,
  keeping gate/up), at a budget where `attention` fits in every layer, the tiny model's greedy plan buys it at a
  short sequence and `all_but_attention` at a long one. Elsewhere it is not offered."""
  assert "all_but_attention" not in planning.policies()
  monkeypatch.setattr(planning, "policies", lambda devices=None: planning.FRUGAL_FIRST[1:])
  planner = planner_with(151 * GIB, dataclasses.replace(BASE, seq_len=seq_len))
  layers = model_config_for(BASE).num_hidden_layers
  uniform = {p: {"total_bytes": gib * GIB} for p, gib in
             dict(layer=118.3, all_but_attention=127.2, attention=150.2, none=230.8).items()}
  seconds = planner._recompute_seconds({})
  order = greedy.cheapest_first(uniform, seconds)
  # At a long sequence `attention` recomputes more than `all_but_attention` (the scores) for more bytes: dropped.
  assert order == tuple(p for p in planning.FRUGAL_FIRST[1:] if p != "attention" or bought == "attention")
  assert greedy.upgrades(uniform, seconds, layers, planner.budget_bytes, order) == (bought,) * layers
  assert seconds["none"] < seconds["attention"] < seconds["layer"]
  assert 0 < seconds["all_but_attention"] < seconds["layer"]


@pytest.mark.slow  # the default run reached 10.9 min on 2 cores; CI's second step runs it
def test_uniform_steps_are_compiled_for_memory_only_and_the_plans_candidates_to_run(uniform, monkeypatch):
  """On GPUs the uniform steps are compiled without XLA's autotuner (their buffers do not depend on it) and not
  kept; the plan's candidate is compiled to run, and the trainer runs that step. On CPU the two are the same."""
  gpu = types.SimpleNamespace(platform="gpu")
  assert train_compile.memory_only_options([gpu]) == {"xla_gpu_autotune_level": 0}
  assert train_compile.memory_only_options() is None
  planner = new_planner(BASE, 1 << 50, keep_steps=True)
  planner.measure("layer")
  assert planner.compiled_step("layer") is not None
  asked, memo = [], planning.compile_step
  monkeypatch.setattr(planning, "compile_step", lambda config, devices=None, **k: asked.append(
      (config.runtime.remat, k["memory_only"])) or memo(config, devices, **k))
  monkeypatch.setattr(planning, "memory_only_options", lambda devices=None: {"xla_gpu_autotune_level": 0})
  monkeypatch.setattr(planning, "keeps_gate_up", lambda run_config: False)
  planner = new_planner(BASE, int(between(uniform, 0.8)), keep_steps=True)
  plan = planner.plan()
  assert len(set(plan.remat)) == 2, plan
  assert sorted(map(repr, asked)) == sorted(map(repr, [("none", True), ("attention", True), ("layer", True),
                                                       (plan.remat, False)]))
  assert planner.compiled_step("layer") is None and planner.compiled_step(plan.remat) is not None


@pytest.mark.slow  # the default run reached 10.3 min on CI's 2 cores; CI's second step runs it
def test_a_plan_is_kept_for_new_run_directories_beside_the_compilation_cache(uniform, tmp_path, capsys):
  """A new run directory with the same configuration reads the machine's cached plan (and records it) instead of
  planning; a cache that cannot be written costs a warning, not the run."""
  budget = between(uniform, 0.6)
  config = dataclasses.replace(with_runtime(BASE, remat="auto"), device_memory_gib=memory_gib(budget),
                               compilation_cache_dir=str(tmp_path / "xla"), out_dir=str(tmp_path / "a"))
  first, plan, _ = resolve_remat(config)
  (cached,) = (tmp_path / "xla" / "relaymoe-plans").iterdir()

  def no_planning(*args, **kwargs):
    raise AssertionError("planned again")

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(planning.Planner, "plan", no_planning)
    again, replan, step = resolve_remat(dataclasses.replace(config, out_dir=str(tmp_path / "b")))
  assert (again.runtime, replan, step) == (first.runtime, plan, None)
  assert f"planned before for this configuration ({cached})" in capsys.readouterr().out
  assert json.loads((tmp_path / "b" / "remat_plan.json").read_text()) == json.loads(cached.read_text())

  (tmp_path / "blocked").write_text("a file where the cache's directory would be")
  config = dataclasses.replace(config, compilation_cache_dir=str(tmp_path / "blocked"), out_dir=str(tmp_path / "c"))
  assert resolve_remat(config)[1] == plan
  assert "warning: the plan was not cached for other run directories" in capsys.readouterr().out
  assert (tmp_path / "c" / "remat_plan.json").exists()


# A stored plan of the tiny model's two layers, as remat_plan.json holds it.
STORED = dict(remat=["layer", "none"], batch_size=8, seq_len=128, state_bytes=1, temp_bytes=2, total_bytes=3,
              budget_bytes=4, fits=True, compiles=[[{"remat": "layer"}, 3]], max_chunk_rows=None, keep_gate_up=False,
              summary="1 × layer, 1 × none")


class FakePlanner:
  """The planner without compiles: a fixed plan, counting how often it is asked."""
  budget_bytes = 1 << 30

  def __init__(self):
    fields = {k: v for k, v in STORED.items() if k != "summary"}
    self.planned, self.calls = Plan(**dict(fields, remat=("attention", "attention"), compiles=[])), 0

  def plan(self):
    self.calls += 1
    return self.planned

  def compiled_step(self, remat, keep_gate_up):
    return "the fresh plan's step"


@pytest.fixture
def fake_planner(monkeypatch):
  planner = FakePlanner()
  monkeypatch.setattr(remat_auto, "make_planner", lambda *args, **kwargs: planner)
  return planner


def _auto(tmp_path):
  return dataclasses.replace(with_runtime(BASE, remat="auto"), out_dir=str(tmp_path / "run"),
                             compilation_cache_dir=str(tmp_path / "xla"))


def _key(config):
  return plan_key(config, model_config_for(config), FakePlanner.budget_bytes)



def test_the_plan_key_changes_with_document_masking_and_not_with_the_data_path(tmp_path):
  """Masking adds the attention's document bias and the batch's segment ids to the step: a plan made without it
  must not be read back for a run with it. Which file the tokens come from changes nothing compiled."""
  tokens = dataclasses.replace(BASE.data, kind="tokens", path=str(tmp_path / "a.bin"), eos_token=0)
  masked = dataclasses.replace(BASE, data=tokens)
  unmasked = dataclasses.replace(BASE, data=dataclasses.replace(tokens, document_masking=False))
  elsewhere = dataclasses.replace(BASE, data=dataclasses.replace(tokens, path=str(tmp_path / "b.bin")))
  assert _key(masked) != _key(unmasked)
  assert _key(masked) == _key(elsewhere)
  assert _key(unmasked) == _key(BASE)

DAMAGED = {
    "not JSON": lambda key: "{\"key\": ",
    "not an object": lambda key: json.dumps([key, STORED]),
    "no plan": lambda key: json.dumps({"key": key}),
    "a field missing": lambda key: json.dumps({"key": key, "plan": {k: v for k, v in STORED.items() if k != "fits"}}),
    "an unknown field": lambda key: json.dumps({"key": key, "plan": dict(STORED, colour="red")}),
    "remat too short": lambda key: json.dumps({"key": key, "plan": dict(STORED, remat=["layer"])}),
    "an unknown policy": lambda key: json.dumps({"key": key, "plan": dict(STORED, remat=["layer", "sometimes"])}),
    "bytes a string": lambda key: json.dumps({"key": key, "plan": dict(STORED, total_bytes="3")}),
    "a negative loss chunk": lambda key: json.dumps({"key": key, "plan": dict(STORED, loss_chunk_tokens=-1)}),
}


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_plan_in_the_run_directory_is_named_and_the_cached_one_used(damage, fake_planner, tmp_path,
                                                                              capsys):
  config = _auto(tmp_path)
  record, cached = tmp_path / "run" / "remat_plan.json", cached_plan_path(config, _key(config))
  record.parent.mkdir()
  record.write_text(DAMAGED[damage](_key(config)))
  store_plan(cached, _key(config), plan_from_dict(STORED, 2))
  _, plan, step = resolve_remat(config)
  assert plan.remat == ("layer", "none") and step is None and fake_planner.calls == 0
  assert f"warning: ignored the remat plan {record}: " in capsys.readouterr().out
  assert json.loads(record.read_text()) == json.loads(cached.read_text())  # the good plan recorded over it


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_cached_plan_is_named_never_copied_and_replaced_by_a_new_plan(damage, fake_planner, tmp_path,
                                                                                capsys):
  config = _auto(tmp_path)
  cached = cached_plan_path(config, _key(config))
  cached.parent.mkdir(parents=True)
  cached.write_text(DAMAGED[damage](_key(config)))
  _, plan, step = resolve_remat(config)
  assert (plan, step, fake_planner.calls) == (fake_planner.planned, "the fresh plan's step", 1)
  assert f"warning: ignored the remat plan {cached}: " in capsys.readouterr().out
  for where in (cached, tmp_path / "run" / "remat_plan.json"):
    assert plan_from_dict(json.loads(where.read_text())["plan"], 2) == plan


def test_a_new_plan_compiles_its_loss_chunk_search_ahead_once(tmp_path, monkeypatch):
  """The loss chunk's candidates compiled at once with the plan's candidate (`loss_chunk.ChunkSteps`) are of the
  very run the search is then given: it compiles nothing again and the trainer gets the step compiled ahead."""
  monkeypatch.setattr(planning, "compile_step", lambda config, *args, **kwargs: config)
  monkeypatch.setattr(planning, "memory_plan", lambda config, step: dict(total_bytes=1, temp_bytes=1, state_bytes=0,
                                                                        compile_s=0.0))
  chunk_compiles = []

  def compile_step(config, devices=None, memory_only=False, **resolved):
    chunk_compiles.append(config.runtime.loss_chunk_tokens)
    return config

  monkeypatch.setattr(loss_chunk, "compile_step", compile_step)
  monkeypatch.setattr(loss_chunk, "memory_plan", lambda config, step: {"total_bytes": 1})
  config = dataclasses.replace(_auto(tmp_path), batch_size=16, seq_len=1024, device_memory_gib=1)  # 2048 a device
  resolved, plan, step = resolve_remat(config)
  assert chunk_compiles == [2048] and plan.loss_chunk_tokens == 2048 and plan.keep_gate_up
  assert step == resolved and resolved.runtime.loss_chunk_tokens == 2048 and resolved.runtime.remat == plan.remat


def test_a_plan_read_from_the_cache_is_not_written_back_to_it(fake_planner, tmp_path, capsys, monkeypatch):
  """So a read-only cache that holds the plan gives no warning that the plan was not cached."""
  config = _auto(tmp_path)
  cached = cached_plan_path(config, _key(config))
  store_plan(cached, _key(config), plan_from_dict(STORED, 2))
  written = []
  monkeypatch.setattr(remat_auto, "store_plan", lambda path, key, plan: written.append(path))
  assert resolve_remat(config)[1].remat == ("layer", "none")
  assert written == [tmp_path / "run" / "remat_plan.json"] and "warning" not in capsys.readouterr().out


def test_a_stored_plans_loss_chunk_is_run_where_the_run_leaves_it_to_auto(fake_planner, tmp_path, capsys):
  config = _auto(tmp_path)
  assert config.runtime.loss_chunk_tokens == "auto"
  chosen = plan_from_dict(dict(STORED, loss_chunk_tokens=4096), 2)
  store_plan(tmp_path / "run" / "remat_plan.json", _key(config), chosen)
  run_config, plan, step = resolve_remat(config)
  assert run_config.runtime.loss_chunk_tokens == 4096 and plan.loss_chunk_tokens == 4096 and step is None
  assert "loss chunk auto: 4096 tokens per device, chosen with the plan" in capsys.readouterr().out
  # A plan stored before the choice was recorded leaves auto to the trainer's search.
  store_plan(tmp_path / "run" / "remat_plan.json", _key(config), plan_from_dict(STORED, 2))
  assert resolve_remat(config)[0].runtime.loss_chunk_tokens == "auto"


def test_a_run_directory_plan_record_that_is_a_directory_is_one_line(fake_planner, tmp_path, capsys):
  config = _auto(tmp_path)
  (tmp_path / "run" / "remat_plan.json").mkdir(parents=True)
  with pytest.raises(UserError, match=f"cannot record the remat plan in {tmp_path / 'run' / 'remat_plan.json'} "
                                      r"\(Is a directory\)"):
    resolve_remat(config)
  assert "warning: ignored the remat plan" in capsys.readouterr().out


def test_a_resume_keeps_the_plan_its_checkpoints_were_written_with(fake_planner, tmp_path, capsys):
  """Whatever would be planned now (here: another configuration's record, a new plan), a resumed run keeps its
  checkpoints' plan, and rewrites no record before its checkpoint restores."""
  config = _auto(tmp_path)
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "run_config.json").write_text(json.dumps({"remat_plan": dict(STORED, remat=["layer", "attention"])}))
  record = json.dumps({"key": "another configuration's", "plan": STORED})
  (run_dir / "remat_plan.json").write_text(record)
  resumed, plan, step = resolve_remat(config, resume=True)
  assert resumed.runtime.remat == plan.remat == ("layer", "attention") and step is None
  assert "the plan this run's checkpoints were written with" in capsys.readouterr().out
  (run_dir / "run_config.json").unlink()  # a run stopped before it wrote one: its record, of any configuration
  assert resolve_remat(config, resume=True)[1].remat == ("layer", "none")
  assert fake_planner.calls == 0 and (run_dir / "remat_plan.json").read_text() == record
  (run_dir / "remat_plan.json").unlink()  # nothing of its own: planned, recorded once the checkpoint restores
  assert resolve_remat(config, resume=True)[1] == fake_planner.planned
  assert fake_planner.calls == 1 and not (run_dir / "remat_plan.json").exists()
  assert resolve_remat(config)[1] == fake_planner.planned  # not resumed: recorded at once
  assert (run_dir / "remat_plan.json").exists()


def test_a_candidate_plan_compiles_at_once_with_its_loss_chunk_search(monkeypatch):
  """While the trainer still chooses its loss chunk, a candidate plan's own compile (for memory only) runs at once
  with the compiles `alongside` gives for that candidate's run config, each once."""
  compiled = []

  def compile_step(config, devices=None, memory_only=False, **resolved):
    compiled.append((config.runtime.remat, memory_only, threading.current_thread().name))
    return config

  monkeypatch.setattr(planning, "compile_step", compile_step)
  monkeypatch.setattr(planning, "memory_plan", lambda config, step: {"total_bytes": 1, "compile_s": 0.0})
  monkeypatch.setattr(planning, "concurrent_compiles", lambda devices=None: 3)
  ahead = []

  def alongside(config):
    return [lambda: ahead.append((config.runtime.remat, dict(config.runtime.dispatcher_options),
                                  threading.current_thread().name))] * 2

  planner = new_planner(BASE, 1 << 50, candidates_to_run=False, alongside=alongside)
  remat = ("layer", "none")
  for _ in range(2):  # the second time: measured already
    assert planner.confirm(remat, keep_gate_up=True)["total_bytes"] == 1
  assert [c[:2] for c in compiled] == [(remat, True)] and len(ahead) == 2
  assert all(a[:2] == (remat, {"keep_gate_up": True}) for a in ahead), ahead
  assert threading.current_thread().name not in {compiled[0][2], *(a[2] for a in ahead)}


@pytest.mark.slow  # three compiles afresh
def test_the_uniform_policies_compile_at_once_where_the_host_has_cores(uniform, monkeypatch):
  """With cores to spare the first compiles run in threads: the same plan and bytes as compiled one by one."""
  budget = between(uniform, 0.6)
  expected = planner_with(budget).plan()
  monkeypatch.setattr(planning, "concurrent_compiles", lambda devices=None: 3)
  with pytest.MonkeyPatch.context() as patch:  # compile afresh (the module's memo would answer at once)
    patch.setattr(planning, "compile_step", loop_compile_step)
    planner = planner_with(budget)
    threads = []
    measure = planner.measure
    planner.measure = lambda *a, **k: threads.append(threading.current_thread().name) or measure(*a, **k)
    plan = planner.plan()
  assert (plan.remat, plan.total_bytes, plan.keep_gate_up) == (expected.remat, expected.total_bytes,
                                                               expected.keep_gate_up)
  assert len({t for t in threads if t != threading.current_thread().name}) >= 2, threads


def test_remat_auto_refuses_a_budget_nothing_fits(uniform, tmp_path):
  config = dataclasses.replace(with_runtime(BASE, remat="auto"), device_memory_gib=memory_gib(uniform["layer"] * 0.9),
                               out_dir=str(tmp_path))
  with pytest.raises(StepDoesNotFit, match="runtime.remat=auto: even layer in every layer needs .* .iB per device, "
                                           "over the budget of .* .iB. `relaymoe-plan"):
    loop.run(config)
  assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
  assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("fraction,suggestion", [
    pytest.param(0.6, "With runtime.remat=auto it fits: ", marks=pytest.mark.slow),  # plans: 9 s on 2 cores
    pytest.param(-0.5, "Even layer in every layer needs ", marks=pytest.mark.slow),  # compiles: 23 s on 2 cores
])
def test_the_fit_guard_stops_before_allocating_with_the_numbers_and_a_suggestion(uniform, tmp_path, fraction,
                                                                                  suggestion):
  limit = between(uniform, fraction)  # the step as configured (remat none) needs uniform["none"]
  config = dataclasses.replace(BASE, device_memory_gib=limit / GIB, out_dir=str(tmp_path))
  needs = size(uniform["none"])
  with pytest.raises(StepDoesNotFit, match=f"the train step needs {needs} per device .* and the device allows "
                                           f".* .iB: batch_size=8 seq_len=128 remat=none does not fit. {suggestion}"):
    loop.run(config)
  assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "run_config.json").exists()


@pytest.mark.slow  # the default run reached 10.9 min on 2 cores; CI's second step runs it
def test_the_fit_guard_is_one_line_and_exit_status_2_from_the_cli(uniform, tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--config", "cpu", "--out", str(tmp_path), *OVERRIDES,
              f"device_memory_gib={between(uniform, 0.6) / GIB}"])
  stderr = capsys.readouterr().err
  assert exit_info.value.code == 2
  assert stderr.startswith("relaymoe-train: error: the train step needs ") and stderr.count("\n") == 1, stderr
  assert "With runtime.remat=auto it fits" in stderr


def test_relaymoe_plan_refuses_a_bad_variant_or_out_before_any_compile(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  monkeypatch.setattr(plan_search, "make_planner", lambda *args, **kwargs: pytest.fail("planned"))

  def no_cuda_plugin(platform, **kwargs):  # as JAX without its CUDA plugin, also where it is installed
    raise NotImplementedError(f"topology not implemented for {platform}")

  monkeypatch.setattr(plan_search.topologies, "get_topology_desc", no_cuda_plugin)
  (tmp_path / "file").write_text("")
  for argv, message in ((["--variants", "ring,bogus"], "unknown variant 'bogus'; known: "),
                        (["--out", str(tmp_path / "file" / "sub")], f"--out {tmp_path / 'file' / 'sub'}: cannot "
                                                                    "write plan.json there ("),
                        (["--topology", "1x1x8", "--target-config", str(tmp_path / "h100.txtpb")],
                         f"--target-config {tmp_path / 'h100.txtpb'}: cannot read it (No such file"),
                        (["--topology", "1x1x8"], "--topology 1x1x8 compiles for GPUs with JAX's CUDA plugin, which "
                                                  'is not installed: pip install "jax[cuda12]==')):
    with pytest.raises(SystemExit) as exit_info:
      cli.plan_main(["--config", "cpu", "--out", str(tmp_path / "out"), *OVERRIDES, *argv])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and stderr.startswith(f"relaymoe-plan: error: {message}"), stderr
    assert stderr.count("\n") == 1


def test_relaymoe_plan_says_a_given_remat_is_not_what_it_plans(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  monkeypatch.setattr(plan_search, "search", lambda *args, **kwargs: {})
  for remat, said in (("layer", True), ("auto", False)):
    cli.plan_main(["--config", "cpu", "--out", str(tmp_path / "out"), *OVERRIDES, f"runtime.remat={remat}"])
    out = capsys.readouterr().out
    assert ("runtime.remat='layer' is not used here: relaymoe-plan searches what each layer recomputes" in out) == said


def test_the_fit_guard_warns_near_the_limit_when_the_allocator_grows_on_demand(uniform, monkeypatch, capsys):
  step = train_run.compile_step(BASE)  # remat none: uniform["none"] bytes
  monkeypatch.setattr(train_compile, "allocator_grows_on_demand", lambda: True)
  for fraction, warned in ((0.95, True), (0.8, False)):
    config = dataclasses.replace(BASE, device_memory_gib=uniform["none"] / fraction / GIB)
    assert train_compile.check_fits(config, step)["total_bytes"] == uniform["none"]
    out = capsys.readouterr().out
    assert ("XLA_PYTHON_CLIENT_PREALLOCATE=false the allocator grows region by region" in out) == warned, out
  monkeypatch.setattr(train_compile, "allocator_grows_on_demand", lambda: False)
  train_compile.check_fits(dataclasses.replace(BASE, device_memory_gib=uniform["none"] / 0.95 / GIB), step)
  assert "warning" not in capsys.readouterr().out


@pytest.mark.slow  # an end-to-end run; CI's second step runs it
def test_the_rings_chunks_are_capped_when_even_the_frugal_plan_does_not_fit(tmp_path, monkeypatch, capsys):
  """A run whose MoE chunks dominate (top-8 of 8 experts, 512 positions: a hop's share is 1024 rows): the frugal
  plan does not fit, the same plan with chunks capped (at 128 rows here) does, and `remat: auto` trains with it."""
  monkeypatch.setattr(planning, "FRUGAL_CHUNK_ROWS", 128)
  moe_heavy = load_run_config("cpu", [*OVERRIDES, "seq_len=512", "model.num_experts_per_tok=8",
                                      "model.moe_intermediate_size=512"])
  probe = new_planner(moe_heavy, 1 << 50)
  uncapped = probe.measure("layer")["total_bytes"]
  probe.cap = True
  capped = probe.measure("layer")["total_bytes"]
  assert capped < uncapped, (capped, uncapped)
  budget = (capped + uncapped) / 2
  plan = planner_with(budget, moe_heavy).plan()
  assert plan.fits and plan.total_bytes <= budget and plan.max_chunk_rows == 128, plan
  assert "ring chunks ≤ 128 rows" in plan.summary()
  config = dataclasses.replace(with_runtime(moe_heavy, remat="auto"), device_memory_gib=memory_gib(budget),
                               out_dir=str(tmp_path))
  assert [r["step"] for r in loop.run(config)] == [0, 1]
  stored = json.loads((tmp_path / "run_config.json").read_text())
  assert dict(stored["run"]["runtime"]["dispatcher_options"])["max_chunk_rows"] == 128
  assert "capping the ring's chunks at 128 rows" in capsys.readouterr().out
  # Nothing to cap: chunk sizes chosen by the user, an all-to-all, or a hop's share already under the cap.
  assert caps_chunks(moe_heavy)
  assert not caps_chunks(with_runtime(moe_heavy, dispatcher_options=dict(chunk_rows=256)))
  assert not caps_chunks(with_runtime(moe_heavy, dispatcher_options=dict(max_chunk_rows=256)))
  assert not caps_chunks(with_runtime(moe_heavy, dispatcher="all_to_all"))
  assert not caps_chunks(dataclasses.replace(moe_heavy, seq_len=64))


@pytest.mark.slow  # 6-12 s on 2 cores; CI's second step runs it
def test_relaymoe_plan_puts_the_ring_and_all_to_all_side_by_side(uniform, tmp_path, capsys, monkeypatch):
  """A budget both steps fit whole (no remat to plan; the ring keeps its gate/up projections too)."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  budget = 2 * uniform["none"]
  cli.plan_main(["--config", "cpu", "--out", str(tmp_path), "--variants", "ring,a2a_cf1", *OVERRIDES,
                 f"device_memory_gib={memory_gib(budget)}"])
  written = json.loads((tmp_path / "plan.json").read_text())
  assert list(written["variants"]) == ["ring", "a2a_cf1"] and written["devices"] == 8
  ring, cf1 = written["variants"]["ring"], written["variants"]["a2a_cf1"]
  assert ring["dispatcher"] == "ring_expert" and ring["plan"]["remat"] == ["none", "none"]
  assert ring["plan"]["keep_gate_up"] and ring["plan"]["total_bytes"] > uniform["none"] and ring["plan"]["fits"]
  assert cf1["dispatcher"] == "all_to_all" and cf1["options"] == {"capacity_factor": 1.0}
  assert cf1["plan"]["total_bytes"] != uniform["none"]  # its own step, not the ring's
  assert cf1["plan"]["fits"] and cf1["plan"]["remat"] == ["none", "none"] and not cf1["plan"]["keep_gate_up"]
  table = capsys.readouterr().out
  assert "| ring | ring_expert | 8 | 128 | 2 × none, ring keeps gate/up |" in table and "| a2a_cf1 | all_to_all | 8 | 128 |" in table


class _JaxWithSMs(types.ModuleType):
  """`jax` as the Mosaic weight-gradient kernel sees it: devices that report an H200's SMs (CPU devices report none)."""

  def __getattr__(self, name):
    return getattr(jax, name)

  def devices(self, *args, **kwargs):
    return [mosaic_gpu._WithCores(d, 132) for d in jax.devices(*args, **kwargs)]


def lowered_for_gpus(run_config):
  """The train step as `compile_step` lowers it, but for CUDA (Mosaic GPU kernels included), without locations."""
  return train_compile.trace_step(run_config)[0].lower(lowering_platforms=("cuda",)).as_text(debug_info=False)


def mosaic_kernels(lowered):
  return re.findall(r'kernel_hash = "(.*?)", module', lowered)


@pytest.mark.slow
def test_the_step_lowers_for_gpus_alike_after_other_policies_and_afresh(monkeypatch):
  """The persistent compilation cache's key leaves out the program's locations, but not those its Mosaic GPU
  kernels embed. The planner compiles the chosen step after other policies, whose traces JAX keeps; a rerun
  compiles it afresh (reading the stored plan): unless both lower alike, the rerun compiles again on GPUs."""
  monkeypatch.setattr(mosaic_gpu.transposed_ragged_dot_mgpu, "jax", _JaxWithSMs("jax"))
  gpu = load_run_config("cpu", [*OVERRIDES, "runtime.dtype=bfloat16",
                                "runtime.dispatcher_options={backend: mosaic_gpu}"])
  jax.clear_caches()
  lowered_for_gpus(planning.with_remat(gpu, "none"))
  after_none = lowered_for_gpus(planning.with_remat(gpu, "layer"))
  jax.clear_caches()  # as in a new process
  afresh = lowered_for_gpus(planning.with_remat(gpu, "layer"))
  assert mosaic_kernels(after_none) and mosaic_kernels(afresh) == mosaic_kernels(after_none)
  assert hashlib.sha256(afresh.encode()).digest() == hashlib.sha256(after_none.encode()).digest()


def test_plan_needs_a_memory_limit_on_cpu():
  with pytest.raises(ValueError, match="cpu devices report no memory limit: set device_memory_gib"):
    resolve_remat(with_runtime(BASE, remat="auto"))


@pytest.mark.slow
def test_maximize_finds_the_longest_sequence_that_fits(uniform):
  budget = between(uniform, 0.5)  # every layer recomputed: somewhat more than seq_len 128 fits
  planner = planner_with(budget)
  plan, above = planner.maximize("seq_len", 16, upgrade=False)
  assert plan.fits and plan.remat == ("layer", "layer") and plan.seq_len % 16 == 0 and plan.seq_len >= 128
  assert planner.measure("layer", seq_len=above)["total_bytes"] > budget
  assert above - plan.seq_len <= max(16, plan.seq_len // 32 // 16 * 16), (plan.seq_len, above)


@pytest.mark.slow
def test_maximize_under_context_parallelism_spreads_one_sequence_over_expert(uniform, tmp_path, monkeypatch):
  """One sequence per 'data' shard, its length a multiple of 2 × expert, and longer than the longest without
  context parallelism at the same budget (each of the 4 expert shards holds a quarter of it)."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  budget = between(uniform, 0.5)
  cli.plan_main(["--config", "cpu", "--out", str(tmp_path), "--variants", "ring", "--maximize", "seq",
                 "--granule", "16", "--no-upgrade", *OVERRIDES, "runtime.context_parallel=true",
                 f"device_memory_gib={memory_gib(budget)}"])
  plan = json.loads((tmp_path / "plan.json").read_text())["variants"]["ring"]["plan"]
  assert plan["batch_size"] == BASE.mesh.data and plan["seq_len"] % (2 * BASE.mesh.expert) == 0
  without = planner_with(budget).maximize("seq_len", 16, upgrade=False)[0]
  assert plan["fits"] and plan["seq_len"] > without.seq_len


def test_the_plan_table_reads_at_any_size_and_says_what_to_try_where_nothing_fits():
  """`relaymoe-plan`'s table: bytes in the unit that reads (a CPU run's MiB read 0.00 in a GiB column), and below
  it, per variant that fits nothing, the option that searches further (`--granule` for --maximize seq)."""
  small = Plan(remat=("none",) * 2, batch_size=8, seq_len=64, state_bytes=3 << 20, temp_bytes=5 << 10,
               total_bytes=(3 << 20) + (5 << 10), budget_bytes=80 << 30, fits=True)
  results = dict(ring=dict(dispatcher="ring_expert", plan=small, not_fitting=None),
                 a2a_dropless=dict(dispatcher="all_to_all", plan=None, not_fitting=1024))
  lines = plan_search.render(results, "seq").splitlines()
  assert lines[2] == "| ring | ring_expert | 8 | 64 | 2 × none | 3.0 MiB | 5.0 KiB | 3.0 MiB | 80.00 GiB | yes | — |"
  assert lines[-1].startswith("a2a_dropless: not even seq_len=1024 fits; --granule N searches in steps of N")
  over = dict(ring=dict(dispatcher="ring_expert", plan=dataclasses.replace(small, fits=False), not_fitting=None))
  assert plan_search.render(over).splitlines()[-1].startswith("ring: the run's shape does not fit under any remat "
                                                              "plan; lower batch_size (or raise micro_batches)")


def test_a_frugal_plan_shortens_the_spans_of_layers_that_have_them(monkeypatch):
  """Qwen3.5's layers run long rows in spans (`runtime.sequence_span_tokens`): where even the most frugal plan does
  not fit, the planner shortens them (FRUGAL_SPAN_TOKENS) as it caps the ring's chunks, and the plan says so. The
  step's bytes here are a stand-in that only spans of 16 bring under the budget."""
  monkeypatch.setattr(planning, "FRUGAL_SPAN_TOKENS", 16)
  qwen35 = load_run_config("cpu", [*OVERRIDES, "model=qwen3.5-tiny", "seq_len=64", "runtime.sequence_span_tokens=32"])
  caps = lambda run: planning.caps_spans(run, model_config_for(run), build_mesh(run.mesh))
  assert caps(qwen35)
  assert not caps(with_runtime(qwen35, sequence_span_tokens=0))  # whole rows, as asked
  assert not caps(with_runtime(qwen35, sequence_span_tokens=16))  # already as short
  assert not caps(dataclasses.replace(qwen35, seq_len=16))  # one span anyway
  assert not caps(dataclasses.replace(BASE, seq_len=64))  # Qwen3's layers have no spans

  bytes_of = {"layer": 50, "attention": 60, "none": 70}
  compiled = []

  def step_bytes(run_config, step=None):
    remat = run_config.runtime.remat
    total = sum(bytes_of[p] for p in ((remat,) if isinstance(remat, str) else remat)) // (
        1 if isinstance(remat, str) else len(remat))
    total += 100 * (run_config.runtime.sequence_span_tokens != 16)
    compiled.append(run_config.runtime.sequence_span_tokens)
    return dict(total_bytes=total, temp_bytes=total, state_bytes=0, compile_s=0.0)

  monkeypatch.setattr(planning, "compile_step", lambda run_config, *args, **kwargs: run_config)
  monkeypatch.setattr(planning, "memory_plan", step_bytes)
  plan = new_planner(qwen35, 100).plan()
  assert plan.fits and plan.sequence_span_tokens == 16 and "spans of 16" in plan.summary(), plan
  assert compiled[0] == 32 and 16 in compiled
  assert planning.apply_plan(qwen35, plan).runtime.sequence_span_tokens == 16
  assert plan_from_dict(json.loads(json.dumps(plan.as_dict())), len(plan.remat)).sequence_span_tokens == 16
