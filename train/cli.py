"""`relaymoe-train`: train a Qwen3-style MoE with the RelayMoE ring (or any dispatcher) from a YAML run config;
`relaymoe-plan`: what fits on the devices (the activation planner, `train.plan.planner`).

    relaymoe-train [--config FILE] [--steps N] [--out DIR] [--resume | --overwrite] [--compile-only]
                   [--profile START:COUNT] [--eval-only] [--print-config] [key=value ...]
    relaymoe-plan [--config FILE] [--maximize seq|batch] [--variants ring,a2a_dropless,a2a_cf1] [key=value ...]

With no arguments: `configs/runs/gpu.yaml` on GPUs (all of them), otherwise `configs/runs/cpu.yaml`, a tiny model
on 8 emulated CPU devices. Multi-process: pass --coordinator/--num-processes/--process-id (or set
RELAYMOE_COORDINATOR, RELAYMOE_NUM_PROCESSES, RELAYMOE_PROCESS_ID); under SLURM they are detected.

Exit status: 0 done; 2 the run cannot start as asked (a bad config, a busy or used --out, no checkpoint to resume,
a step that does not fit the device),
printed as one line (`--debug` or RELAYMOE_DEBUG=1 for the traceback); 1 it failed while training (a non-finite
loss, data changed under the run) or a bug (its traceback and a line saying so); 143 / 130 stopped by SIGTERM /
Ctrl-C after saving a checkpoint, or before the first step with nothing to save (a second Ctrl-C aborts at once
without saving).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import jax
import yaml

from relaymoe_jax.errors import UserError
from train.plan import search as plan_search
from train.compile import memory_plan
from train.run import resolve_run
from train.sources import model_config_for
from models.config_reference import reference, render
from train.config import RunConfig, load_run_config
from train.errors import run_cli
from train.evaluate import evaluate_only
from train.loop import run
from train.profile.window import parse_window
from train.xla_cache import use_compilation_cache


def _keys_help():
  return ("run config keys (key=value, or in the YAML; the shipped configs in configs/runs/ set some), with their "
          "defaults:\n" + render(reference(RunConfig)) + "\n  model.KEY = (the model config's)\n      any "
          "architecture key (Hugging Face names: model.num_hidden_layers=4); --print-config shows them all\n\n"
          "docs/training.md has every option; docs/errors.md the exit statuses.")


def _add_start_options(parser):
  """What both commands take to start JAX (devices, several processes), --debug, and key=value overrides."""
  parser.add_argument("--cpu-devices", type=int, default=8, help="emulated CPU devices per process (no GPU)")
  parser.add_argument("--coordinator", default=os.environ.get("RELAYMOE_COORDINATOR"),
                      help="several processes: process 0's host:port (also RELAYMOE_COORDINATOR; docs/multi_node.md)")
  parser.add_argument("--num-processes", type=int, default=os.environ.get("RELAYMOE_NUM_PROCESSES"),
                      help="several processes: how many (also RELAYMOE_NUM_PROCESSES)")
  parser.add_argument("--process-id", type=int, default=os.environ.get("RELAYMOE_PROCESS_ID"),
                      help="several processes: this one's, 0 to N-1 (also RELAYMOE_PROCESS_ID)")
  parser.add_argument("--debug", action="store_true", default=bool(os.environ.get("RELAYMOE_DEBUG")),
                      help="show the traceback of an error (also RELAYMOE_DEBUG=1)")
  parser.add_argument("overrides", nargs="*", metavar="key=value")


def _parse(argv):
  parser = argparse.ArgumentParser(
      prog="relaymoe-train", formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Train a Qwen3-MoE, Qwen2-MoE or Qwen3.5-MoE model with the RelayMoE ring (or any dispatcher)\n"
      "from a run config and key=value overrides.", epilog=_keys_help())
  parser.add_argument("--config", help="run config: a YAML path or a name under configs/runs/ (default: gpu on "
                      "GPUs, else cpu)")
  parser.add_argument("--steps", type=int, help="as steps=N")
  parser.add_argument("--out", help="the run directory, as out_dir=DIR (default: the run config's out_dir, "
                      "runs/<config name> under the current directory for the shipped configs)")
  parser.add_argument("--print-config", action="store_true",
                      help="print the run config and the model config with every value, as resolved; train nothing")
  start = parser.add_mutually_exclusive_group()
  start.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
  start.add_argument("--overwrite", action="store_true",
                     help="start afresh in an --out that holds an earlier run, deleting its checkpoints and metrics")
  parser.add_argument("--compile-only", action="store_true",
                      help="compile the train step from shapes alone and report its memory per device; train nothing")
  parser.add_argument("--eval-only", action="store_true", help="the held-out loss of init_from's weights "
                      "(eval.path, eval.fraction or the synthetic language's held-out samples); train nothing")
  parser.add_argument("--profile", metavar="START:COUNT", help="trace steps START to START+COUNT-1 into "
                      "OUT/profile/ and print their device time by part of the model")
  _add_start_options(parser)
  return parser.parse_intermixed_args(argv)  # key=value overrides may come before and after options


# Of each GPU's memory, what JAX's allocator may take unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: JAX's
# own default, 0.75, left a quarter of an H200 unused (the planner's budget 104.3 GiB of 139.8), while steps at
# 99.5% of a 0.95 limit trained (docs/memory.md).
GPU_MEMORY_FRACTION = "0.95"


def _start_distributed(args):
  if args.coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
  elif int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    jax.distributed.initialize()  # JAX reads the SLURM environment


def main(argv=None):
  run_cli("relaymoe-train", _parse(sys.argv[1:] if argv is None else argv), _main)


def _start(args, overrides):
  """JAX started (emulated CPU devices, distributed), and the run config with `overrides` applied."""
  if args.cpu_devices < 1:  # XLA would abort the process
    raise UserError(f"--cpu-devices {args.cpu_devices}: must be ≥ 1")
  # Only the CPU platform reads this; on GPUs it changes nothing. XLA reads it when JAX's backends start (at the
  # first device query, not at import): nothing before this line may ask for a device.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
  # Emulated devices share one pool of max(cores, devices) threads; two programs with collectives in flight can
  # deadlock it (XLA aborts after 40 s; a checkpoint's checksums did on 2 cores). XLA sizes it from NPROC.
  os.environ.setdefault("NPROC", str(32 * args.cpu_devices))
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
  _start_distributed(args)

  if args.out:
    overrides.append(f"out_dir={json.dumps(args.out)}")  # quoted: YAML would read --out 2024 as a number
  config = load_run_config(args.config or ("gpu" if jax.default_backend() == "gpu" else "cpu"), overrides)
  if config.compilation_cache_dir:  # before anything compiles: JAX reads it once
    use_compilation_cache(os.path.expanduser(config.compilation_cache_dir))
  _log_memory_limit()
  return config


def _log_memory_limit():
  """One line on GPUs: the memory each device's allocator may take, and where that fraction came from."""
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
  if jax.default_backend() != "gpu" or jax.process_index() != 0 or not all(limits):
    return
  fraction = os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]
  print(f"device memory: {min(limits) / 2**30:.1f} GiB per GPU for JAX (XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}"
        f"{'' if fraction != GPU_MEMORY_FRACTION else ', the default'})", flush=True)


def _main(args):
  profile = parse_window(args.profile) if args.profile is not None else None  # before JAX starts
  overrides = list(args.overrides)
  if args.steps is not None:
    overrides.append(f"steps={args.steps}")
  config = _start(args, overrides)

  if args.print_config:
    print(_as_yaml(config, model_config_for(config)), end="")
    return
  if args.compile_only:
    resolved = resolve_run(config)
    _report_plan(memory_plan(config, resolved.compile()), config.out_dir, jax.process_index() == 0)
    return
  if args.eval_only:
    evaluate_only(resolve_run(config))
    return
  run(config, resume=args.resume, overwrite=args.overwrite, profile=profile)


def _as_yaml(run_config, model_config):
  """The run config, every value as resolved and the whole architecture as `model_overrides`: a run config file
  that trains the same run (`--config FILE`)."""
  run = dataclasses.asdict(run_config)
  run["runtime"]["dispatcher_options"] = dict(run_config.runtime.dispatcher_options)
  run["model_overrides"] = {k: list(v) if isinstance(v, tuple) else v
                            for k, v in dataclasses.asdict(model_config).items()}
  return ("# relaymoe-train --print-config: every key as resolved, model_overrides the whole architecture\n"
          + yaml.safe_dump(run, sort_keys=False))


def _report_plan(plan, out_dir, write):
  """Prints the memory plan and writes it to OUT/memory_plan.json."""
  if not write:
    return
  def size(key):
    n = plan[key]
    return "not reported" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

  print(f"train step, {plan['layers']} layers on {plan['devices']} devices {plan['mesh']}, compiled in "
        f"{plan['compile_s']:.1f} s; per device: training state {size('state_bytes')}, temporaries "
        f"{size('temp_bytes')}, total {size('total_bytes')}; device limit {size('device_limit_bytes')}")
  path = pathlib.Path(out_dir) / "memory_plan.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(plan, indent=1))


def _parse_plan(argv):
  parser = argparse.ArgumentParser(prog="relaymoe-plan", description=(
      "Per device: the memory of the train step and the cheapest remat plan that fits, for the run's ring and for "
      "all-to-all (dropless, capacity 1.0) side by side; with --maximize, the longest sequence at micro-batch 1 "
      "per token shard (seq) or the largest batch (batch) each one fits. Nothing is allocated."))
  parser.add_argument("--config", help="run config: a YAML path or a name under configs/runs/")
  parser.add_argument("--maximize", choices=("seq", "batch"))
  parser.add_argument("--variants", default="ring,a2a_dropless,a2a_cf1",
                      help="comma list of: ring (the run's ring dispatcher), a2a_dropless, a2a_cf1")
  parser.add_argument("--granule", type=int, help="search step: sequence positions (default 1024) or micro-batches "
                      "per token shard (default 1)")
  parser.add_argument("--no-upgrade", action="store_true", help="with --maximize: report the most frugal plan at "
                      "the limit without compiling the uniform policies that would upgrade layers")
  parser.add_argument("--topology", help="compile for a GPU host that is not this one, e.g. 1x1x8 (slices x hosts x "
                      "GPUs per host); needs the CUDA plugin, not the GPUs")
  parser.add_argument("--target-config", help="with --topology: a GpuTargetConfigProto text file (default: this "
                      "machine's GPU)")
  parser.add_argument("--out", help="write plan.json here (default: the run's out_dir)")
  _add_start_options(parser)
  return parser.parse_intermixed_args(argv)


def plan_main(argv=None):
  """`relaymoe-plan`: prints the side-by-side plan table and writes OUT/plan.json."""
  run_cli("relaymoe-plan", _parse_plan(sys.argv[1:] if argv is None else argv), _plan)


def _plan(args):
  config = _start(args, list(args.overrides))
  if config.runtime.remat not in ("none", "auto") and jax.process_index() == 0:
    print(f"runtime.remat={config.runtime.remat!r} is not used here: relaymoe-plan searches what each layer "
          "recomputes (relaymoe-train runs the remat given)", flush=True)

  devices = plan_search.topology_devices(args.topology, args.target_config) if args.topology else None
  quiet = jax.process_index() != 0
  path = pathlib.Path(config.out_dir) / "plan.json"
  if not quiet:
    try:  # before the search, which may take minutes
      path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
      raise UserError(f"--out {path.parent}: cannot write plan.json there ({err.strerror or err})") from None
  results = plan_search.search(resolve_run(config, devices), maximize=args.maximize, granule=args.granule,
                               variants=args.variants.split(","), devices=devices,
                               log=(lambda *_: None) if quiet else print, upgrade=not args.no_upgrade)
  if quiet:
    return
  table = plan_search.render(results, args.maximize)
  print(table)
  path.write_text(json.dumps(dict(
      config=args.config, overrides=args.overrides, maximize=args.maximize, topology=args.topology,
      devices=len(devices) if devices else jax.device_count(), backend=jax.default_backend(),
      device_kind=(devices or jax.devices())[0].device_kind, jax=jax.__version__,
      variants={k: dict(v, plan=v["plan"] and v["plan"].as_dict()) for k, v in results.items()}), indent=1))
  print(f"written to {path}")


if __name__ == "__main__":
  main()
