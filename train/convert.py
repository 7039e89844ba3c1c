"""Weights in and out: the trainer's `init_from` sources and `relaymoe-convert`.

    relaymoe-convert hf-to-orbax HF_DIR OUT_DIR [model.KEY=VALUE ...] [mesh.AXIS=N ...]
    relaymoe-convert orbax-to-hf SOURCE HF_DIR [--step N] [--dtype bfloat16] [mesh.AXIS=N ...]

`hf-to-orbax` reads a Hugging Face Qwen3-MoE / Qwen2-MoE directory (`models.hf`, shard by shard into the sharded
layout) and writes OUT_DIR/model.yaml (the model config) and OUT_DIR/params (an orbax checkpoint of the parameters),
which the trainer starts from with `init_from=orbax:OUT_DIR` and which restores in parallel on every host.
`orbax-to-hf` writes a Hugging Face directory (per-expert layout, `config.json`) from such a directory or from a
training run (`--out` of `relaymoe-train`: its run_config.json and the newest checkpoint that reads, or `--step`).
The mesh (default: every device on `expert`, which must divide the experts) only decides where the parameters live
while they pass through.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import jax
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from models import qwen3
from models.config import from_mapping, override, parse_assignment
from train.cli import _run_cli
from train.config import MeshConfig, RunConfig
from train.step import make_optimizer

MODEL_YAML = "model.yaml"
PARAMS = "params"


def model_config_from(init_from, overrides):
  """The model config of an `init_from` source ("hf:DIR" or "orbax:DIR") with `overrides` on top."""
  kind, path = _source(init_from)
  if kind == "hf":
    return qwen3.config_from_hf(path, **overrides)
  return qwen3.load_config(str(path / MODEL_YAML), **overrides)


def initial_params(init_from, overrides, model_config, mesh):
  """The parameters (a pure dict, each array with the model's sharding) of an `init_from` source."""
  kind, path = _source(init_from)
  if kind == "hf":
    return nnx.to_pure_dict(nnx.split(qwen3.from_hf(path, mesh=mesh, **overrides))[1])
  return _restore_params(path / PARAMS, model_config, mesh)


def _source(init_from):
  kind, _, path = init_from.partition(":")
  path = pathlib.Path(path).expanduser()
  expected = "config.json" if kind == "hf" else MODEL_YAML
  if not (path / expected).exists():
    raise FileNotFoundError(f"init_from={init_from!r}: no {expected} in {path}")
  return kind, path


def _restore_params(path, model_config, mesh):
  abstract = nnx.to_pure_dict(qwen3.abstract(model_config, mesh)[1])
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path.absolute(), abstract)


def model_from_params(model_config, mesh, params):
  """The model with `params` (a pure dict) as its parameters."""
  graphdef, state = qwen3.abstract(model_config, mesh)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def write_model_yaml(model_config, path):
  data = dataclasses.asdict(model_config)
  data["dispatcher_options"] = dict(model_config.dispatcher_options)
  data = {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}
  path.write_text(yaml.safe_dump(data, sort_keys=False))


def hf_to_orbax(hf_dir, out_dir, overrides, mesh):
  """OUT_DIR/model.yaml and OUT_DIR/params from a Hugging Face directory."""
  _check_hf_dir(hf_dir)
  out_dir = pathlib.Path(out_dir).absolute()
  if (out_dir / PARAMS).exists():
    raise ValueError(f"{out_dir / PARAMS} exists; choose an empty OUT_DIR")
  init_from = f"hf:{hf_dir}"
  config = model_config_from(init_from, overrides)
  params = initial_params(init_from, overrides, config, mesh)
  out_dir.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(out_dir / PARAMS, params)
  if jax.process_index() == 0:
    write_model_yaml(config, out_dir / MODEL_YAML)
  return config


def _check_hf_dir(hf_dir):
  if not (pathlib.Path(hf_dir) / "config.json").exists():
    raise FileNotFoundError(f"{hf_dir} has no config.json: it is not a Hugging Face model directory")


def orbax_to_hf(source, hf_dir, mesh, step=None, dtype=None):
  """A Hugging Face directory from `hf-to-orbax`'s output or a training run's checkpoint."""
  source = pathlib.Path(source).absolute()
  if (source / MODEL_YAML).exists():
    if step is not None:
      raise ValueError(f"--step: {source} holds one set of parameters, not a run's checkpoints")
    config = qwen3.load_config(str(source / MODEL_YAML))
    params = _restore_params(source / PARAMS, config, mesh)
  elif (source / "run_config.json").exists():
    config, params = _run_params(source, mesh, step)
  else:
    raise FileNotFoundError(f"{source} is neither a relaymoe-convert output ({MODEL_YAML}) nor a training run "
                            "(run_config.json)")
  qwen3.to_hf(model_from_params(config, mesh, params), hf_dir, dtype=dtype)
  return config


def _run_params(run_dir, mesh, step):
  """(model config, parameters) of a training run's newest checkpoint that reads (or `step`)."""
  from train.loop import Checkpoints, abstract_train_state  # noqa: PLC0415

  stored = json.loads((run_dir / "run_config.json").read_text())
  run = from_mapping(RunConfig, stored["run"], f"{run_dir}/run_config.json")
  model = stored["model"]
  model["dispatcher_options"] = dict(model["dispatcher_options"])
  config = from_mapping(qwen3.Qwen3MoEConfig, model, f"{run_dir}/run_config.json model")
  optimizer, _ = make_optimizer(run.optim, run.steps)
  _, abstract = abstract_train_state(config, mesh, optimizer)
  with Checkpoints(run_dir / "checkpoints", run.keep_checkpoints) as checkpoints:
    state, _ = checkpoints.restore(abstract, step=step)
  return config, state.params


def _mesh(assignments, num_experts):
  from train.loop import build_mesh  # noqa: PLC0415

  mesh = build_mesh(override(MeshConfig(), [a[len("mesh."):] for a in assignments]))
  if num_experts % mesh.shape["expert"]:
    raise ValueError(f"{num_experts} experts do not split over mesh.expert={mesh.shape['expert']} "
                     f"({jax.device_count()} devices); pass mesh.expert=N with N dividing {num_experts}")
  return mesh


def _parse(argv):
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--debug", action="store_true", default=bool(os.environ.get("RELAYMOE_DEBUG")),
                      help="show the traceback of an error (also RELAYMOE_DEBUG=1)")
  parser = argparse.ArgumentParser(prog="relaymoe-convert", description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  to_orbax = commands.add_parser("hf-to-orbax", parents=[common],
                                 help="a Hugging Face directory to model.yaml + orbax params")
  to_orbax.add_argument("hf_dir")
  to_orbax.add_argument("out_dir")
  to_hf = commands.add_parser("orbax-to-hf", parents=[common],
                              help="hf-to-orbax's output or a training run to a Hugging Face directory")
  to_hf.add_argument("source", help="a relaymoe-convert output directory or a relaymoe-train --out directory")
  to_hf.add_argument("hf_dir")
  to_hf.add_argument("--step", type=int, help="the run's checkpoint step (default: the newest that reads)")
  to_hf.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                     help="of the written tensors (default: the parameters', float32 for a training run)")
  for command in (to_orbax, to_hf):
    command.add_argument("overrides", nargs="*", metavar="key=value", help="model.KEY=VALUE, mesh.AXIS=N")
  args, rest = parser.parse_known_args(argv)  # key=value may also follow the options
  unknown = [a for a in rest if a.startswith("-") or "=" not in a]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  args.overrides += rest
  return args


def main(argv=None):
  _run_cli("relaymoe-convert", _parse(sys.argv[1:] if argv is None else argv), _convert)


def _convert(args):
  unknown = [a for a in args.overrides if not a.startswith(("model.", "mesh."))]
  if unknown:
    raise ValueError(f"{unknown}: only model.KEY=VALUE and mesh.AXIS=N are taken here")
  model_overrides = dict(parse_assignment(a[len("model."):]) for a in args.overrides if a.startswith("model."))
  mesh_assignments = [a for a in args.overrides if a.startswith("mesh.")]
  if args.command == "hf-to-orbax":
    _check_hf_dir(args.hf_dir)
    experts = model_config_from(f"hf:{args.hf_dir}", model_overrides).num_experts
    config = hf_to_orbax(args.hf_dir, args.out_dir, model_overrides, _mesh(mesh_assignments, experts))
    print(f"wrote {args.out_dir}/{MODEL_YAML} and {args.out_dir}/{PARAMS} ({config.num_hidden_layers} layers); "
          f"train from it with init_from=orbax:{args.out_dir}")
    return
  if model_overrides:
    raise ValueError("orbax-to-hf takes the model config from its source; model.KEY=VALUE is not taken here")
  experts = _source_experts(pathlib.Path(args.source))
  orbax_to_hf(args.source, args.hf_dir, _mesh(mesh_assignments, experts), args.step, args.dtype)
  print(f"wrote {args.hf_dir} (config.json and safetensors, per-expert layout)")


def _source_experts(source):
  if (source / MODEL_YAML).exists():
    return yaml.safe_load((source / MODEL_YAML).read_text())["num_experts"]
  if (source / "run_config.json").exists():
    return json.loads((source / "run_config.json").read_text())["model"]["num_experts"]
  raise FileNotFoundError(f"{source} is neither a relaymoe-convert output ({MODEL_YAML}) nor a training run "
                          "(run_config.json)")


if __name__ == "__main__":
  main()
