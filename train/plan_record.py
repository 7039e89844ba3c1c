"""A remat plan (per layer, what backward recomputes, and the ring options the planner chose) with the bytes it
compiled to, and its records: in the run directory, and beside JAX's compilation cache (`cached_plan_path`), so
that a rerun, a `--resume` or a new run of the same configuration on the same devices and code reads it instead of
planning again."""

import dataclasses
import hashlib
import json
import os
import pathlib

import jax


@dataclasses.dataclass
class Plan:
  """A remat choice per layer for one run shape, with the compiled step's bytes per device."""

  remat: tuple[str, ...]
  batch_size: int  # the whole step's
  seq_len: int
  state_bytes: int
  temp_bytes: int
  total_bytes: int
  budget_bytes: int
  fits: bool
  compiles: list = dataclasses.field(default_factory=list)  # (what was compiled, total bytes) in order
  max_chunk_rows: int | None = None  # FRUGAL_CHUNK_ROWS where the plan caps the ring's chunks
  keep_gate_up: bool = False  # the expert ring keeps its gate/up projections for the backward
  micro_batches: int = 1  # gradient accumulation: batch_size / micro_batches sequences at a time

  def summary(self):
    counts = {p: self.remat.count(p) for p in dict.fromkeys(self.remat)}
    chunks = f", ring chunks ≤ {self.max_chunk_rows} rows" if self.max_chunk_rows else ""
    kept = ", ring keeps gate/up" if self.keep_gate_up else ""
    return ", ".join(f"{n} × {p}" for p, n in counts.items()) + chunks + kept

  def as_dict(self):
    return dict(dataclasses.asdict(self), summary=self.summary())


# A plan is kept in the run directory, keyed by everything that shapes the compiled step's memory, so that a rerun
# or `--resume` of the same configuration on the same devices and code trains without planning again.
PLAN_FILE = "remat_plan.json"
NOT_PLANNED = ("out_dir", "steps", "seed", "log_every", "checkpoint_every", "keep_checkpoints", "tensorboard",
               "compilation_cache_dir", "data", "optim", "peak_tflops_per_device", "model", "model_overrides")
SOURCES = pathlib.Path(__file__).resolve().parents[1]


def plan_key(run_config, model_config, budget):
  """What a plan depends on: the run's shapes, runtime and mesh, the architecture, the budget, the devices, JAX's
  version and this project's code."""
  code = hashlib.sha256()
  for path in sorted(p for package in ("relaymoe_jax", "models", "train") for p in (SOURCES / package).glob("*.py")):
    code.update(path.read_bytes())
  devices = jax.devices()
  what = dict(run={k: v for k, v in dataclasses.asdict(run_config).items() if k not in NOT_PLANNED},
              model=dataclasses.asdict(model_config), budget=budget, jax=jax.__version__,
              devices=[len(devices), devices[0].device_kind], code=code.hexdigest())
  return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


PLAN_CACHE = "relaymoe-plans"  # under the compilation cache dir (JAX's cache reads only its own "*-cache" files)


def cached_plan_path(run_config, key):
  """Where this machine keeps the plan of `key` for any run directory: under the run's compilation cache dir
  (None without one: nothing else is cached either)."""
  if not run_config.compilation_cache_dir:
    return None
  return pathlib.Path(os.path.expanduser(run_config.compilation_cache_dir)) / PLAN_CACHE / f"{key}.json"


def stored_plan(path, key):
  """The Plan stored at `path` under `key`, or None."""
  try:
    stored = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  if stored.get("key") != key:
    return None
  fields = {k: v for k, v in stored["plan"].items() if k != "summary"}
  return Plan(**dict(fields, remat=tuple(fields["remat"]), compiles=[tuple(c) for c in fields["compiles"]]))


def store_plan(path, key, plan):
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(dict(key=key, plan=plan.as_dict()), indent=1))
