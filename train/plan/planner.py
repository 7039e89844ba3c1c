"""The activation planner (RelayMoE §3.4, extended): per layer, what backward recomputes, chosen from the compiled
step's memory, and the longest sequence or largest micro-batch that fits. With gradient accumulation the step
holds one micro-batch at a time: tokens per device, recompute time and layer inputs are a micro-batch's.

Every number comes from XLA's buffer assignment of the real train step compiled from shapes alone
(`train.compile.memory_plan`: nothing is allocated), but one estimate: `offload` in every layer, taken as `layer`'s
step less the layer inputs it moves to the host, and compiled only where a plan relies on it. The plan compiles the
step once per uniform policy to learn what keeping more costs per layer, starts from the one that needs fewest bytes
in every layer (as a rule `offload` where the device has host memory to offload to, else `layer`; a policy that
needs more bytes than one recomputing less is dropped), then upgrades layers greedily
by recompute time saved per byte until the budget is spent, as the paper does; the chosen plan is compiled once more
to confirm it fits (and stepped back while it does not). Time saved is estimated from the model's FLOPs
(`train.step.layer_forward_flops`) at the device's peak and, for `offload`, the layer input's round trip over the
host link. Where the expert ring's backward can keep the forward's gate/up projections (`RingExpert.keep_gate_up`)
within the budget, it does: a quarter of the MoE backward's matmuls fewer. The uniform steps are compiled for their
memory only (on GPUs without XLA's autotuner: `train.compile.MEMORY_ONLY_OPTIONS`), at once; the plan's candidates
(keeping gate/up first) are compiled to run, one at a time, and the trainer runs the chosen one (unless the trainer
still chooses its loss chunk: then they too are compiled for memory only, each at once with that search's first
round for it, `alongside`, which compiles the step to run).
"""

import dataclasses
import functools

import jax

from models import families
from models.spans import Spans
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.moe import RINGS
from relaymoe_jax.ring.chunks import default_chunk_rows
from relaymoe_jax.errors import UserError
from train.compile import at_once, compile_step, concurrent_compiles, device_limit_bytes, memory_only_options
from train.compile import memory_plan
from train.config import RunConfig
from train.mesh import token_shards
from train.plan import greedy
from train.plan.record import Plan
from train.metrics import peak_tflops, size
from train.step import mean_layer_flops

HOST_LINK_BYTES_PER_S = 50e9  # PCIe 5 x16 per direction, in practice (H100/H200 hosts)
# A ring's largest chunk when memory is short. By default a hop runs its whole share of pairs (T·K/N rows) as one
# chunk, so the chunk's buffers (gathered rows, gate/up, float32 output rows, their gradients) grow with the
# sequence; capped (the dispatcher's `max_chunk_rows`) they do not. On one H200 the 4-layer Qwen3-30B-A3B shape's
# longest sequence went from 544768 to 999424 tokens (docs/memory.md).
FRUGAL_CHUNK_ROWS = 131072
# The layers' spans of the sequence when memory is short (`runtime.sequence_span_tokens`, by default 32768): the
# spanned parts' temporaries are a span's. Qwen3.5-35B-A3B's 40 layers over 8 H200s fit 4,194,304 tokens at 16384,
# not at 32768 (docs/memory.md).
FRUGAL_SPAN_TOKENS = 16384
# What a layer's choice costs in recompute time relative to `none`, cheapest memory first.
FRUGAL_FIRST = ("offload", "layer", "all_but_attention", "attention", "none")


def offload_supported(devices=None):
  """Offloading helps where the device has a host memory of its own to move activations to: GPUs (pinned host
  memory). On CPU devices `pinned_host` is the same RAM, so it saves nothing and `layer` is the frugal choice.
  `devices`: those the step is compiled for (default this process's)."""
  device = (devices or jax.local_devices())[0]
  if device.platform != "gpu":
    return False
  kinds = {m.kind for m in device.addressable_memories()}
  return not kinds or "pinned_host" in kinds  # a compile-only device lists none; the GPUs it stands for have it


def policies(devices=None):
  """The choices the planner considers for these devices (default this process's), cheapest memory first: `offload`
  where it saves device memory, `all_but_attention` on GPUs, whose attention is a kernel (cuDNN's) with outputs to
  keep; elsewhere XLA's attention would keep its score matrices, `none`'s memory for `layer`'s time."""
  gpu = (devices or jax.local_devices())[0].platform == "gpu"
  return tuple(p for p in FRUGAL_FIRST if (p != "offload" or offload_supported(devices))
               and (p != "all_but_attention" or gpu))


def with_remat(run_config, remat, max_chunk_rows=None, keep_gate_up=False, span_tokens=None):
  """The run with every layer's policy set (a name for all layers, or one per layer) and, if given, the ring's
  chunks capped, its gate/up projections kept for the backward and the layers' spans of the sequence set."""
  runtime = run_config.runtime
  ring = {**({"max_chunk_rows": max_chunk_rows} if max_chunk_rows else {}),
          **({"keep_gate_up": True} if keep_gate_up else {})}
  options = {**dict(runtime.dispatcher_options), **ring}
  spans = {"sequence_span_tokens": span_tokens} if span_tokens else {}
  return dataclasses.replace(run_config, runtime=dataclasses.replace(runtime, remat=remat,
                                                                     dispatcher_options=options, **spans))


def apply_plan(run_config, plan):
  """The run as `plan` says: its per-layer policies and, where it chose them, the ring's chunk cap, kept gate/up
  projections and shorter spans."""
  return with_remat(run_config, plan.remat, plan.max_chunk_rows, plan.keep_gate_up, plan.sequence_span_tokens)


def keeps_gate_up(run_config):
  """Whether the run's expert ring could keep its gate/up projections for the backward: a dispatcher that runs
  `RingExpert` (or may: `auto`) with the recomputing backward, and no choice of the user's about it."""
  runtime = run_config.runtime
  options = dict(runtime.dispatcher_options)
  return (runtime.dispatcher in ("ring_expert", "auto") and "keep_gate_up" not in options
          and options.get("recompute", True))


def caps_chunks(run_config, model_config, mesh):
  """Whether FRUGAL_CHUNK_ROWS would shrink this run's chunks (of `model_config` on `mesh`): a ring whose chunk
  sizes the user left to the dispatcher, with a hop's balanced share of pairs above the cap."""
  runtime = run_config.runtime
  if runtime.dispatcher not in RINGS or {"chunk_rows", "max_chunk_rows"} & set(dict(runtime.dispatcher_options)):
    return False
  tokens = run_config.micro_batch_size * run_config.seq_len // token_shards(mesh)
  top_k = model_config.num_experts_per_tok
  ladder = functools.partial(default_chunk_rows, tokens, top_k, mesh.shape[EXPERT])
  return ladder(FRUGAL_CHUNK_ROWS) != ladder()


def caps_spans(run_config, model_config, mesh):
  """Whether FRUGAL_SPAN_TOKENS would shorten this run's spans of the sequence: a model whose layers run in spans,
  rows (under context parallelism, chunks) whose spans are longer than it, and spans not turned off (0)."""
  runtime = run_config.runtime
  if not (families.of(model_config).spans and runtime.sequence_span_tokens):
    return False
  return Spans.of_run(run_config.seq_len, runtime, mesh).length > FRUGAL_SPAN_TOKENS


class Planner:
  """Compiles train steps of one run config (and variations of it: shapes, remat, ring options; never the model or
  the mesh) and remembers what each needed. `model_config`, `mesh`: the run's, resolved once (`train.run.Run`)."""

  def __init__(self, run_config: RunConfig, budget_bytes, *, model_config, mesh, log=print, devices=None,
               keep_steps=False, candidates_to_run=True, alongside=None):
    self.run_config = run_config
    self.model_config = model_config
    self.mesh = mesh
    self.layers = model_config.num_hidden_layers
    self.devices = devices
    self.budget_bytes = budget_bytes
    self.log = log
    self.keep_steps = keep_steps  # the steps compiled to run, for the trainer to run the chosen one
    # False: the plan's candidates too are compiled for memory only, where the step to run is not the plan's own
    # (the trainer's loss chunk is chosen after the plan, `train.plan.loss_chunk`) and compiling it would be wasted.
    self.candidates_to_run = candidates_to_run
    # (a candidate's run config) → compiles of it to run at once with the candidate's own (the loss chunk's search:
    # `train.plan.loss_chunk.ChunkSteps.ahead`).
    self.alongside = alongside
    self.compiles = []
    self._measured = {}
    self._steps = {}
    self.cap = False  # plans cap the ring's chunks and shorten spans (where that shrinks them: `caps_chunks`, ...)

  def measure(self, remat, keep_gate_up=False, to_run=False, **changes):
    """memory_plan of the run with `remat` (and the ring keeping gate/up, if asked) and the given RunConfig changes
    (batch_size, seq_len); each compiled once, for its memory only unless it is a candidate `to_run`
    (`train.compile.MEMORY_ONLY_OPTIONS`)."""
    key = self._key(remat, changes, keep_gate_up)
    if key in self._measured:
      return self._measured[key]
    cap, spans = self._chunk_cap(changes), self._span_cap(changes)
    config = self._config(remat, changes, keep_gate_up)
    step = compile_step(config, self.devices, memory_only=not to_run, model_config=self.model_config,
                        mesh=self.mesh)
    if self.keep_steps and (to_run or memory_only_options(self.devices) is None):
      self._steps[key] = step
    plan = self._measured[key] = memory_plan(config, step)
    what = dict(changes, remat=_compact((remat,) if isinstance(remat, str) else remat),
                **({"max_chunk_rows": cap} if cap else {}), **({"keep_gate_up": True} if keep_gate_up else {}),
                **({"sequence_span_tokens": spans} if spans else {}))
    self.compiles.append((what, plan["total_bytes"]))
    self.log(f"  compiled {what}: {size(plan['total_bytes'])} per device (budget "
             f"{size(self.budget_bytes)}) in {plan['compile_s']:.0f} s")
    return plan

  def _config(self, remat, changes, keep_gate_up=False):
    return with_remat(dataclasses.replace(self.run_config, **changes), remat, self._chunk_cap(changes), keep_gate_up,
                      self._span_cap(changes))

  def confirm(self, remat, keep_gate_up=False, **changes):
    """`measure` of a candidate plan: compiled to run (`candidates_to_run`), else for its memory, at once with
    `alongside`'s compiles of it."""
    if self.alongside and self._key(remat, changes, keep_gate_up) not in self._measured:
      at_once([functools.partial(self.measure, remat, keep_gate_up, self.candidates_to_run, **changes),
               *self.alongside(self._config(remat, changes, keep_gate_up))], concurrent_compiles(self.devices))
    return self.measure(remat, keep_gate_up, self.candidates_to_run, **changes)

  def compiled_step(self, remat, keep_gate_up=False, **changes):
    """The CompiledStep measured for `remat` (with keep_steps), else None."""
    return self._steps.get(self._key(remat, changes, keep_gate_up))

  def _key(self, remat, changes, keep_gate_up=False):
    remat = (remat,) if isinstance(remat, str) else tuple(remat)
    return str(sorted(dict(changes, remat=remat if len(set(remat)) > 1 else remat[:1],
                           max_chunk_rows=self._chunk_cap(changes), keep_gate_up=keep_gate_up,
                           sequence_span_tokens=self._span_cap(changes)).items()))

  def _chunk_cap(self, changes):
    run = dataclasses.replace(self.run_config, **changes)
    return FRUGAL_CHUNK_ROWS if self.cap and caps_chunks(run, self.model_config, self.mesh) else None

  def _span_cap(self, changes):
    run = dataclasses.replace(self.run_config, **changes)
    return FRUGAL_SPAN_TOKENS if self.cap and caps_spans(run, self.model_config, self.mesh) else None

  def cap_working_set(self, **changes):
    """From now on, plan with the ring's chunks capped and the spans shortened; False where that changes nothing for
    this run."""
    run = dataclasses.replace(self.run_config, **changes)
    what = ([f"capping the ring's chunks at {FRUGAL_CHUNK_ROWS} rows"] * caps_chunks(run, self.model_config, self.mesh)
            + [f"spans of {FRUGAL_SPAN_TOKENS} positions"] * caps_spans(run, self.model_config, self.mesh))
    if self.cap or not what:
      return False
    self.cap = True
    self.log(f"  the most frugal plan does not fit: {', '.join(what)}")
    return True

  def fits(self, plan):
    return plan["total_bytes"] <= self.budget_bytes

  def prefetch(self, remats, **changes):
    """Compiles the steps of `remats` not measured yet, for their memory, all at once where the host has the cores
    (`train.compile.at_once`). Elsewhere it does nothing and `measure` compiles each when asked."""
    todo = [r for r in remats if self._key(r, changes) not in self._measured]
    workers = concurrent_compiles(self.devices)
    if workers > 1:
      at_once([functools.partial(self.measure, r, **changes) for r in todo], workers)

  def plan(self, **changes):
    """The cheapest-recompute remat plan that fits, for the run with `changes` (or the most frugal one, marked not
    fitting, when even that does not fit)."""
    layers = self.layers
    choices = policies(self.devices)
    self.prefetch([p for p in ("none", *choices[:-1]) if p != "offload"], **changes)
    uniform = {"none": self.measure("none", **changes)}
    if self.fits(uniform["none"]):  # nothing to plan
      return self._first_fitting(("none",) * layers, uniform, changes, choices)
    for policy in sorted(choices[:-1], key=lambda p: p == "offload"):  # offload's estimate needs layer's step
      estimate = policy == "offload" and self._key(policy, changes) not in self._measured
      uniform[policy] = self._offloaded(uniform["layer"], changes) if estimate else self.measure(policy, **changes)
    seconds = self._recompute_seconds(changes)
    order = greedy.cheapest_first(uniform, seconds)
    while not self.fits(uniform[order[0]]) and uniform[order[0]].get("estimated"):
      uniform[order[0]] = self.measure(order[0], **changes)
      order = greedy.cheapest_first(uniform, seconds)
    if not self.fits(uniform[order[0]]):
      return self._not_fitting(order[0], uniform[order[0]], changes)
    remat = greedy.upgrades(uniform, seconds, layers, self.budget_bytes, order)
    return self._first_fitting(remat, uniform, changes, order)

  def _first_fitting(self, remat, uniform, changes, order):
    """From `remat` on, stepping back (along `order`, fewest bytes first) while nothing fits, the first candidate that
    fits. Candidates are compiled to run, one at a time (compiles at once would autotune on one GPU together), the
    faster first: the plan with the ring keeping gate/up (often no more memory: its backward's recompute goes), then
    without."""
    frugal = order[0]
    keep = keeps_gate_up(dataclasses.replace(self.run_config, **changes))
    while True:
      if keep:
        kept = self.confirm(remat, keep_gate_up=True, **changes)
        if self.fits(kept):
          return self._result(remat, kept, changes, keep_gate_up=True)
      known = uniform.get(remat[0], {}) if len(set(remat)) == 1 else {}
      plan = known if "estimated" not in known and known else self.confirm(remat, **changes)
      if self.fits(plan):
        return self._result(remat, plan, changes)
      if remat == (frugal,) * len(remat):  # only where the frugal step was estimated to fit and does not
        return self._not_fitting(frugal, plan, changes)
      remat = greedy.step_back(remat, order)

  def _not_fitting(self, frugal, measured, changes):
    """Where even `frugal` in every layer (its step `measured`) does not fit: the plan with the ring's chunks capped
    and the spans shortened, where that shrinks them, else that step marked not fitting."""
    if self.cap_working_set(**changes):
      return self.plan(**changes)
    return self._result((frugal,) * self.layers, measured, changes)

  def _offloaded(self, layer_plan, changes):
    """`offload` in every layer, estimated from `layer` in every layer without a compile of its own: the same step
    but for each layer's saved input, which moves to host memory. Marked `estimated`: a plan that relies on it is
    compiled before it is trusted."""
    moved = self.layers * self._layer_input_bytes(changes)
    self.log(f"  offload (estimated: layer's step less {size(moved)} of layer inputs, now in host memory): "
             f"{size(layer_plan['total_bytes'] - moved)} per device")
    return dict(layer_plan, remat="offload", total_bytes=layer_plan["total_bytes"] - moved,
                temp_bytes=layer_plan["temp_bytes"] - moved, estimated=True)

  def _layer_input_bytes(self, changes):
    """Bytes per device of one layer's input, [tokens per device, D] in the compute dtype."""
    run = dataclasses.replace(self.run_config, **changes)
    tokens = run.micro_batch_size * run.seq_len // token_shards(self.mesh)
    return tokens * self.model_config.hidden_size * jax.numpy.dtype(run.runtime.dtype).itemsize

  def _recompute_seconds(self, changes):
    """Estimated backward recompute time per layer of each policy on this run (the mean over layers)."""
    run = dataclasses.replace(self.run_config, **changes)
    c = self.model_config
    tokens = run.micro_batch_size * run.seq_len / token_shards(self.mesh)
    attention, mlp, scores = mean_layer_flops(c, run.seq_len)
    peak = 1e12 * (peak_tflops(run, self.devices) or 1.0)
    recompute_layer = tokens * (attention + mlp) / peak
    return {"none": 0.0, "attention": tokens * attention / peak, "layer": recompute_layer,
            "all_but_attention": recompute_layer - tokens * scores / peak,
            "offload": recompute_layer + 2 * self._layer_input_bytes(changes) / HOST_LINK_BYTES_PER_S}

  def _result(self, remat, plan, changes, keep_gate_up=False):
    run = dataclasses.replace(self.run_config, **changes)
    return Plan(remat=tuple(remat), batch_size=run.batch_size, micro_batches=run.micro_batches, seq_len=run.seq_len,
                state_bytes=plan["state_bytes"], temp_bytes=plan["temp_bytes"], total_bytes=plan["total_bytes"],
                budget_bytes=self.budget_bytes, fits=self.fits(plan), compiles=list(self.compiles),
                max_chunk_rows=self._chunk_cap(changes), keep_gate_up=keep_gate_up,
                sequence_span_tokens=self._span_cap(changes))

  def maximize(self, key, granule, upgrade=True):
    """The largest `key` (seq_len or batch_size, a multiple of `granule`) whose most frugal step fits, and its
    plan (without `upgrade`: every layer at the most frugal policy, which saves the compiles of the uniform
    policies; at the limit the slack is below one search step's bytes anyway). Secant steps on the (nearly linear)
    bytes-against-size curve until the bracket is one step wide: a granule, or 1/32 of the size when that is more.
    Returns (plan or None, the smallest size found not to fit)."""
    frugal = policies(self.devices)[0]
    self.cap = True  # the longest sequence needs the ring's most frugal chunks and spans too
    sizes = {}

    def fits_at(n):
      sizes[n] = self.measure(frugal, **{key: n})["total_bytes"]
      return sizes[n] <= self.budget_bytes

    lo, hi = 0, None
    n = max(granule, getattr(self.run_config, key) // granule * granule)
    while True:
      lo, hi = (n, hi) if fits_at(n) else (lo, n)
      step = max(granule, lo // 32 // granule * granule)
      if lo == 0 and hi == granule:
        return None, hi
      if hi is not None and hi - lo <= step:
        if upgrade:
          return self.plan(**{key: lo}), hi
        return self._result((frugal,) * self.layers, self.measure(frugal, **{key: lo}), {key: lo}), hi
      n = self._next_size(sizes, lo, hi, step, granule)

  def _next_size(self, sizes, lo, hi, step, granule):
    """Where the line through the two measured sizes nearest the bracket meets the budget, kept at least a step
    inside the bracket (and at most 8 × lo while nothing is known not to fit)."""
    top = hi - step if hi is not None else max(8 * lo, granule)
    bottom = lo + step if lo else granule
    guess = (lo + top) / 2 if hi is not None else 2 * lo
    near = sorted(sizes, key=lambda n: abs(n - (lo or hi)))[:2]
    if len(near) == 2 and sizes[near[0]] != sizes[near[1]]:
      (a, bytes_a), (b, bytes_b) = sorted((n, sizes[n]) for n in near)
      guess = a + (self.budget_bytes - bytes_a) * (b - a) / (bytes_b - bytes_a)
    return int(min(max(guess, bottom), top)) // granule * granule or granule


def _compact(remat):
  """The policies' short form: the name when every layer has the same, else e.g. "none×2,layer×1"."""
  if len(set(remat)) == 1:
    return remat[0]
  return ",".join(f"{p}×{n}" for p, n in {p: remat.count(p) for p in dict.fromkeys(remat)}.items())


def budget_bytes(run_config, limit):
  return int(limit * (1 - run_config.memory_headroom))


def make_planner(run_config, model_config, mesh, log=print, devices=None, keep_steps=False, candidates_to_run=True,
                 alongside=None):
  """The Planner of `run_config` (of `model_config` on `mesh`) with the device's budget."""
  limit = device_limit_bytes(run_config)
  if limit is None:
    raise UserError(f"{jax.default_backend()} devices report no memory limit: set device_memory_gib to plan "
                    "(e.g. device_memory_gib=132 for 95% of an H200)")
  return Planner(run_config, budget_bytes(run_config, limit), model_config=model_config, mesh=mesh, log=log,
                 devices=devices, keep_steps=keep_steps, candidates_to_run=candidates_to_run, alongside=alongside)
