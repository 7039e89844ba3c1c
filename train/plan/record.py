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

from models.runtime import REMAT_POLICIES


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
  loss_chunk_tokens: int | None = None  # `loss_chunk_tokens: auto`'s choice (`train.plan.loss_chunk`), once searched
  sequence_span_tokens: int | None = None  # FRUGAL_SPAN_TOKENS where the plan shortens the layers' spans

  def summary(self):
    counts = {p: self.remat.count(p) for p in dict.fromkeys(self.remat)}
    chunks = f", ring chunks ≤ {self.max_chunk_rows} rows" if self.max_chunk_rows else ""
    kept = ", ring keeps gate/up" if self.keep_gate_up else ""
    spans = f", spans of {self.sequence_span_tokens}" if self.sequence_span_tokens else ""
    return ", ".join(f"{n} × {p}" for p, n in counts.items()) + chunks + kept + spans

  def as_dict(self):
    return dict(dataclasses.asdict(self), summary=self.summary())


# A plan is kept in the run directory, keyed by everything that shapes the compiled step's memory, so that a rerun
# or `--resume` of the same configuration on the same devices and code trains without planning again.
PLAN_FILE = "remat_plan.json"
NOT_PLANNED = ("out_dir", "steps", "seed", "log_every", "checkpoint_every", "keep_checkpoints", "tensorboard",
               "compilation_cache_dir", "data", "optim", "peak_tflops_per_device", "model", "model_overrides")
SOURCES = pathlib.Path(__file__).resolve().parents[2]


def plan_key(run_config, model_config, budget):
  """What a plan depends on: the run's shapes, runtime and mesh, the architecture, the budget, the devices, JAX's
  version and this project's code."""
  code = hashlib.sha256()
  for path in sorted(p for package in ("relaymoe_jax", "models", "train") for p in (SOURCES / package).rglob("*.py")):
    code.update(path.read_bytes())
  devices = jax.devices()
  what = dict(run={k: v for k, v in dataclasses.asdict(run_config).items() if k not in NOT_PLANNED},
              masks_documents=run_config.data.masks_documents(),  # the step's attention bias and its inputs
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


def stored_plan(path, key, num_layers, warn):
  """The Plan stored at `path` under `key` (None: any key) for a model of `num_layers` layers, or None: where there
  is none, another configuration's, or one that is not a whole plan (then after `warn`ing, naming the file)."""
  try:
    stored = json.loads(pathlib.Path(path).read_text())
    if not isinstance(stored, dict) or sorted(stored) != ["key", "plan"]:
      raise ValueError("not an object of a key and a plan")
    return plan_from_dict(stored["plan"], num_layers) if key in (None, stored["key"]) else None
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as err:  # a directory, unreadable, not JSON, not a plan
    warn(f"warning: ignored the remat plan {path}: {getattr(err, 'strerror', None) or err}")
    return None


REQUIRED = [f.name for f in dataclasses.fields(Plan)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
COUNTS = ("batch_size", "seq_len", "state_bytes", "temp_bytes", "total_bytes", "budget_bytes")


def plan_from_dict(fields, num_layers):
  """The Plan of a stored mapping, checked whole (every field of its type; for each of `num_layers` layers a known
  policy) so that a damaged plan is never used nor copied."""
  if not isinstance(fields, dict):
    raise ValueError(f"the plan is a JSON {type(fields).__name__}, not an object")
  fields = {k: v for k, v in fields.items() if k != "summary"}
  known = [f.name for f in dataclasses.fields(Plan)]
  missing, unknown = [k for k in REQUIRED if k not in fields], sorted(set(fields) - set(known))
  if missing or unknown:
    raise ValueError(f"the plan lacks {missing} or has unknown {unknown}")
  remat = fields["remat"]
  if not (isinstance(remat, list) and len(remat) == num_layers and all(p in REMAT_POLICIES for p in remat)):
    raise ValueError(f"remat={remat!r} is not one of {list(REMAT_POLICIES)} for each of the {num_layers} layers")
  compiles = fields.get("compiles", [])
  wrong = [k for k in COUNTS if not _is_count(fields[k])]
  wrong += [k for k in ("fits", "keep_gate_up") if not isinstance(fields.get(k, False), bool)]
  wrong += [k for k in ("max_chunk_rows", "loss_chunk_tokens", "sequence_span_tokens")
            if fields.get(k) is not None and not _is_count(fields[k])]
  wrong += [] if isinstance(compiles, list) and all(
      isinstance(c, list) and len(c) == 2 and isinstance(c[0], dict) and (c[1] is None or _is_count(c[1]))
      for c in compiles) else ["compiles"]
  if wrong:
    raise ValueError(f"the plan's {wrong} are not of their types")
  return Plan(**dict(fields, remat=tuple(remat), compiles=[tuple(c) for c in compiles]))


def _is_count(value):
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def store_plan(path, key, plan):
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(dict(key=key, plan=plan.as_dict()), indent=1))
