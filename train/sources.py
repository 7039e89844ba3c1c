"""Where a run's model comes from: its architecture (the run's `model`, or an `init_from` source's) and, with
`init_from`, its starting parameters: "hf:DIR" (a Hugging Face directory) or "orbax:DIR" (`relaymoe-convert
hf-to-orbax`'s output, DIR/model.yaml and DIR/params, or a training run's directory, DIR/run_config.json and the
newest of DIR/checkpoints that reads). Also reads what earlier versions wrote: a `model.yaml` or a run's
`run_config.json` whose model config still held how the model ran."""

import dataclasses
import json
import pathlib
from typing import NamedTuple

import orbax.checkpoint as ocp
import yaml
from flax import nnx

from models import families
from models.hf import transfer as hf
from models.config import from_mapping, read_yaml
from models.runtime import RuntimeConfig, split_legacy
from relaymoe_jax.errors import MissingInput, UserError
from train.rundir.checkpoints import CheckpointUnreadable, Checkpoints, first_line, read_failure
from train.config import RunConfig
from train.step import abstract_train_state, make_optimizer

MODEL_YAML = "model.yaml"
RUN_CONFIG = "run_config.json"  # a training run's (`train.loop`)
PARAMS = "params"
# How `relaymoe-convert hf-to-orbax` lays out DIR/params: consecutive layers of one kind stacked (the default
# `runtime.scan_layers`). A model.yaml written before the runtime had its own config says its own.
CONVERTED_RUNTIME = RuntimeConfig()


def model_config_for(run: RunConfig):
  """The architecture a run trains: its `model` (a name or a YAML path) or, with `init_from`, the source's; the
  run's `model_overrides` on top. The one place a run's model config is made."""
  if run.init_from:
    return source_config(run.init_from, run.model_overrides)[0]
  return families.load_config(run.model, **run.model_overrides)


def source_config(init_from, overrides):
  """(architecture, the runtime its parameters were laid out with) of an `init_from` source, `overrides` on top."""
  kind, path = _source(init_from)
  if kind == "hf":
    return families.config_from_hf(path, **overrides), None
  source = orbax_source(path, overrides)
  return source.config, source.runtime


def read_model_yaml(path, overrides=None):
  """(architecture, runtime of its params) from a converter's model.yaml; one written before the split also held
  how the model ran, which is taken apart here."""
  architecture, runtime = split_legacy(read_yaml(str(path), "models"))
  config = families.config_from_mapping({**architecture, **(overrides or {})}, str(path))
  return config, from_mapping(RuntimeConfig, runtime, str(path)) if runtime else CONVERTED_RUNTIME


def initial_params(init_from, model_config, runtime, mesh):
  """(the parameters of an `init_from` source as a pure dict, each array with the model's sharding; where they were
  read from, for a person)."""
  kind, path = _source(init_from)
  if kind == "hf":
    return nnx.to_pure_dict(hf.load_params(model_config, mesh, path, runtime=runtime)[1]), str(path)
  return orbax_source(path)._replace(config=model_config).params(mesh, runtime=runtime)


def _source(init_from):
  kind, _, path = init_from.partition(":")
  path = pathlib.Path(path).expanduser()
  if kind == "hf" and not (path / "config.json").exists():
    raise MissingInput(f"init_from={init_from!r}: no config.json in {path} (not a Hugging Face directory)")
  if kind == "orbax" and not ((path / MODEL_YAML).exists() or (path / RUN_CONFIG).exists()):
    raise MissingInput(f"init_from={init_from!r}: {path} is neither a relaymoe-convert output ({MODEL_YAML}) nor a "
                       f"training run ({RUN_CONFIG})")
  return kind, path


class OrbaxSource(NamedTuple):
  """An orbax source, its model config read once: its architecture, the runtime its parameters are laid out with,
  and where they are (`hf-to-orbax`'s output, or a training run and the run config it stored)."""

  path: pathlib.Path
  config: object
  runtime: RuntimeConfig
  run: RunConfig | None  # a training run's

  def params(self, mesh, step=None, runtime=None):
    """(the parameters on `mesh`, laid out as `runtime` asks (default: as stored), where they came from): the
    converter's, or the run's newest checkpoint that reads (or `step`)."""
    runtime = runtime or self.runtime
    if self.run is None:
      if step is not None:
        raise UserError(f"--step: {self.path} holds one set of parameters, not a run's checkpoints")
      return restore_params(self.path / PARAMS, self.config, runtime, mesh, self.runtime), str(self.path)
    _check_layout(self.path, self.runtime, runtime)
    optimizer, _ = make_optimizer(self.run.optim, self.run.steps)
    _, abstract = abstract_train_state(self.config, runtime, mesh, optimizer)
    with Checkpoints(self.path / "checkpoints", self.run.keep_checkpoints) as checkpoints:
      state, meta = checkpoints.restore(abstract, step=step, set_aside=False)
    return state.params, f"checkpoint step {meta['next_batch']} of {self.path}"


def orbax_source(source, overrides=None):
  """The OrbaxSource at `source`, its model config read once (`overrides` on top)."""
  source = pathlib.Path(source).absolute()
  if (source / MODEL_YAML).exists():
    return OrbaxSource(source, *read_model_yaml(source / MODEL_YAML, overrides), None)
  if (source / RUN_CONFIG).exists():
    run, config = stored_run(source, overrides)
    return OrbaxSource(source, config, run.runtime, run)
  raise MissingInput(f"{source} is neither a relaymoe-convert output ({MODEL_YAML}) nor a training run "
                     f"({RUN_CONFIG})")


def _check_layout(path, stored, runtime):
  if stored.scan_layers != runtime.scan_layers:
    raise UserError(f"{path} holds parameters laid out with runtime.scan_layers={stored.scan_layers}; run with "
                    f"runtime.scan_layers={str(stored.scan_layers).lower()} to start from them")


def restore_params(path, model_config, runtime, mesh, stored=CONVERTED_RUNTIME):
  """Parameters saved by `relaymoe-convert` (laid out as `stored` says) into the layout `runtime` asks for."""
  _check_layout(path, stored, runtime)
  abstract = nnx.to_pure_dict(families.abstract(model_config, mesh, runtime=runtime)[1])
  with ocp.StandardCheckpointer() as checkpointer:
    try:
      return checkpointer.restore(pathlib.Path(path).absolute(), abstract)
    except Exception as err:
      if not read_failure(err):
        raise
      raise CheckpointUnreadable(f"{path} does not read ({first_line(err)})") from err


def model_from_params(model_config, runtime, mesh, params):
  """The model with `params` (a pure dict) as its parameters."""
  graphdef, state = families.abstract(model_config, mesh, runtime=runtime)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def write_model_yaml(model_config, path):
  data = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(model_config).items()}
  pathlib.Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def stored_run(run_dir, overrides=None):
  """(RunConfig, architecture with `overrides` on top) a training run stored in its run_config.json, in either
  layout: with the run's `runtime`, or from before it, when `dispatcher` and `remat` were the run's and the rest the
  model config's."""
  where = f"{run_dir}/{RUN_CONFIG}"
  stored = json.loads((pathlib.Path(run_dir) / RUN_CONFIG).read_text())
  run, (architecture, runtime) = dict(stored["run"]), split_legacy(stored["model"])
  if "runtime" not in run:  # written before the split: the model's runtime fields are what ran
    run = {k: v for k, v in run.items() if k not in ("dispatcher", "remat")}
    run["runtime"] = runtime
  return (from_mapping(RunConfig, run, where),
          families.config_from_mapping({**architecture, **(overrides or {})}, f"{where} model"))
