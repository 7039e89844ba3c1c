"""`relaymoe-convert`: weights in and out (the trainer's own `init_from` reads them: `train.sources`).

    relaymoe-convert hf-to-orbax HF_DIR OUT_DIR [model.KEY=VALUE ...] [mesh.AXIS=N ...]
    relaymoe-convert orbax-to-hf SOURCE HF_DIR [--step N] [--dtype bfloat16] [--overwrite] [mesh.AXIS=N ...]

`hf-to-orbax` reads a Hugging Face Qwen3-MoE / Qwen2-MoE directory (`models.hf.transfer`, shard by shard into the sharded
layout) and writes OUT_DIR/model.yaml (the architecture) and OUT_DIR/params (an orbax checkpoint of the parameters),
which the trainer starts from with `init_from=orbax:OUT_DIR` and which restores in parallel on every host.
`orbax-to-hf` writes a Hugging Face directory (per-expert layout, `config.json`) from such a directory or from a
training run (`--out` of `relaymoe-train`: its run_config.json and the newest checkpoint that reads, or `--step`).
The mesh (default: every device on `expert`, which must divide the experts) only decides where the parameters live
while they pass through.
"""

import argparse
import os
import pathlib
import sys

import jax

from models.config import override, parse_assignment
from models.hf.transfer import check_export_target, to_hf
from relaymoe_jax.errors import MissingInput, UserError
from train.rundir.checkpoints import save_params
from train.config import MeshConfig
from train.errors import run_cli
from train.mesh import build_mesh
from train.sources import (CONVERTED_RUNTIME, MODEL_YAML, PARAMS, initial_params, model_from_params,
                           orbax_source, source_config, write_model_yaml)


def hf_to_orbax(hf_dir, out_dir, config, mesh):
  """OUT_DIR/model.yaml and OUT_DIR/params from a Hugging Face directory whose architecture (read once, with the
  overrides: `source_config`) is `config`."""
  out_dir = pathlib.Path(out_dir).absolute()
  if (out_dir / PARAMS).exists():
    raise UserError(f"{out_dir / PARAMS} exists; choose an empty OUT_DIR")
  params, _ = initial_params(f"hf:{hf_dir}", config, CONVERTED_RUNTIME, mesh)
  out_dir.mkdir(parents=True, exist_ok=True)
  save_params(out_dir / PARAMS, params)
  if jax.process_index() == 0:
    write_model_yaml(config, out_dir / MODEL_YAML)
  return config


def _check_hf_dir(hf_dir):
  if not (pathlib.Path(hf_dir) / "config.json").exists():
    raise MissingInput(f"{hf_dir} has no config.json: it is not a Hugging Face model directory")


def orbax_to_hf(source, hf_dir, mesh, step=None, dtype=None, overwrite=False):
  """A Hugging Face directory from an OrbaxSource (`hf-to-orbax`'s output or a training run's checkpoint); an
  earlier export in `hf_dir` is refused before any parameter is read, or with `overwrite` replaced."""
  check_export_target(hf_dir, overwrite)
  params, _ = source.params(mesh, step)
  to_hf(model_from_params(source.config, source.runtime, mesh, params), hf_dir, dtype=dtype, overwrite=overwrite)
  return source.config


def _mesh(assignments, num_experts):
  mesh = build_mesh(override(MeshConfig(), [a[len("mesh."):] for a in assignments]))
  if num_experts % mesh.shape["expert"]:
    raise UserError(f"{num_experts} experts do not split over mesh.expert={mesh.shape['expert']} "
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
  to_hf.add_argument("--overwrite", action="store_true",
                     help="replace an earlier export in HF_DIR (its config.json and safetensors files; others stay)")
  for command in (to_orbax, to_hf):
    command.add_argument("overrides", nargs="*", metavar="key=value", help="model.KEY=VALUE, mesh.AXIS=N")
  args, rest = parser.parse_known_args(argv)  # key=value may also follow the options
  unknown = [a for a in rest if a.startswith("-") or "=" not in a]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  args.overrides += rest
  return args


def main(argv=None):
  run_cli("relaymoe-convert", _parse(sys.argv[1:] if argv is None else argv), _convert)


def _convert(args):
  unknown = [a for a in args.overrides if not a.startswith(("model.", "mesh."))]
  if unknown:
    raise UserError(f"{unknown}: only model.KEY=VALUE and mesh.AXIS=N are taken here")
  model_overrides = dict(parse_assignment(a[len("model."):]) for a in args.overrides if a.startswith("model."))
  mesh_assignments = [a for a in args.overrides if a.startswith("mesh.")]
  if args.command == "hf-to-orbax":
    _check_hf_dir(args.hf_dir)
    config = source_config(f"hf:{args.hf_dir}", model_overrides)[0]  # the architecture, read once
    hf_to_orbax(args.hf_dir, args.out_dir, config, _mesh(mesh_assignments, config.num_experts))
    print(f"wrote {args.out_dir}/{MODEL_YAML} and {args.out_dir}/{PARAMS} ({config.num_hidden_layers} layers); "
          f"train from it with init_from=orbax:{args.out_dir}")
    return
  if model_overrides:
    raise UserError("orbax-to-hf takes the model config from its source; model.KEY=VALUE is not taken here")
  source = orbax_source(args.source)  # the architecture, read once
  orbax_to_hf(source, args.hf_dir, _mesh(mesh_assignments, source.config.num_experts), args.step, args.dtype,
              args.overwrite)
  print(f"wrote {args.hf_dir} (config.json and safetensors, per-expert layout)")


if __name__ == "__main__":
  main()
