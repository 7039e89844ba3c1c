"""`moe_ffn`: the public MoE block over global sharded arrays, and the dispatcher registry.

Every dispatcher computes y_TD = Σ_k w[t,k] · expert_{idx[t,k]}(x[t]) (an expert's activation: `activations`);
they differ only in where the pairs are computed and what is held (see each dispatcher's module for what moves
between devices). Shape letters: see relaymoe_jax.
"""

import contextlib
import contextvars
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, PartitionSpec as P

from relaymoe_jax import activations, placement
from relaymoe_jax.all_to_all import AllToAll
from relaymoe_jax.ring.auto import Auto
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.dense import Dense, dense_moe
from relaymoe_jax.errors import UserError, check_ids_in_range
from relaymoe_jax.kernels.grouped_matmul import matmul_precision, resolve_backend
from relaymoe_jax.layout import ExpertLayout, block_mesh, shard_map_over_free_axes
from relaymoe_jax.ring.expert import RingExpert
from relaymoe_jax.ring.token import RingToken
from relaymoe_jax.tokens import fold, pad_rows, padding_for, refuse_vmap, unfold

DISPATCHERS = {
    "ring_expert": RingExpert,
    "ring_token": RingToken,
    "auto": Auto,
    "all_to_all": AllToAll,
    "dense": Dense,
}
RINGS = ("ring_expert", "ring_token", "auto")  # the dispatchers that run the ring (`auto` picks one of the two)


# (dispatcher or None, calls): set by `every_call_dispatched_by` while a whole block is checked against the oracle.
_FORCED = contextvars.ContextVar("relaymoe_forced_dispatcher", default=None)


@contextlib.contextmanager
def every_call_dispatched_by(dispatcher):
  """Within it every `moe_ffn` traced or called runs `dispatcher` (its options dropped), whatever the caller gave
  (None: each its own); yields a list with one entry per such call. `relaymoe_jax.testing` runs a whole block of
  yours against the oracle this way, and the count tells it the block's calls were traced, not a cached trace."""
  calls = []
  token = _FORCED.set((dispatcher, calls))
  try:
    yield calls
  finally:
    _FORCED.reset(token)


def make_dispatcher(name, **options):
  """A dispatcher instance from its registry name and its own options, each rejected by name if unknown."""
  if name not in DISPATCHERS:
    raise UserError(f"unknown dispatcher {name!r}; known: {sorted(DISPATCHERS)}")
  cls = DISPATCHERS[name]
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(options) - known)
  if unknown:
    raise UserError(f"unknown option(s) {unknown} for dispatcher {name!r}; it takes {sorted(known)}")
  return cls(**options)


def _check_up_matrix(w_up_EDF, activation):
  if activations.is_gated(activation) and w_up_EDF is None:
    raise UserError(f"activation {activation!r} is gated: it needs w_up_EDF (None is for the plain two-matrix "
                    f"activations {list(activations.PLAIN)})")
  if not activations.is_gated(activation) and w_up_EDF is not None:
    raise UserError(f"activation {activation!r} is a plain two-matrix expert, down(act(x·w_gate_EDF)): pass "
                    f"w_up_EDF=None, not an array of shape {tuple(w_up_EDF.shape)}")


def _check_inputs(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout):
  shapes = {name: a.shape for name, a in dict(x_TD=x_TD, idx_TK=idx_TK, w_TK=w_TK, w_gate_EDF=w_gate_EDF,
                                              w_up_EDF=w_up_EDF, w_down_EFD=w_down_EFD).items() if a is not None}
  if x_TD.ndim != 2 or idx_TK.ndim != 2 or w_gate_EDF.ndim != 3:
    raise UserError(f"expected x_TD [T, D], idx_TK [T, K], w_gate_EDF [E, D, F]; got {shapes}")
  (t, d), (e, _, f), k = x_TD.shape, w_gate_EDF.shape, idx_TK.shape[1]
  num_experts = layout.num_experts(w_gate_EDF)  # e, or inside a shard_map over the expert axis the ring's
  expected = dict(x_TD=(t, d), idx_TK=(t, k), w_TK=(t, k), w_gate_EDF=(e, d, f), w_up_EDF=(e, d, f),
                  w_down_EFD=(e, f, d))
  wrong = {name: shapes[name] for name in shapes if tuple(shapes[name]) != expected[name]}
  if wrong:
    raise UserError(f"shape mismatch: {wrong}; expected {expected} from x_TD {x_TD.shape} and "
                    f"w_gate_EDF {w_gate_EDF.shape}")
  if d < 1 or f < 1:
    raise UserError(f"x_TD's width D={d} and the experts' width F={f} (w_gate_EDF {tuple(w_gate_EDF.shape)}) must "
                    "be ≥ 1")
  if not 1 <= k <= num_experts:
    raise UserError(f"top_k={k} (idx_TK.shape[1]) must be between 1 and the number of experts E={num_experts}")
  if not jnp.issubdtype(idx_TK.dtype, jnp.integer):
    raise UserError(f"idx_TK must hold integer expert ids; got dtype {idx_TK.dtype}")
  if not jnp.issubdtype(x_TD.dtype, jnp.floating):
    raise UserError(f"x_TD must be floating point; got dtype {x_TD.dtype}")
  dtypes = {name: a.dtype for name, a in dict(w_TK=w_TK, w_gate_EDF=w_gate_EDF, w_up_EDF=w_up_EDF,
                                              w_down_EFD=w_down_EFD).items() if a is not None}
  wrong_dtypes = {name: str(dt) for name, dt in dtypes.items() if dt != x_TD.dtype}
  if wrong_dtypes:
    raise UserError(f"dtype mismatch: {wrong_dtypes} differ from x_TD's {x_TD.dtype}")
  layout.check_sizes(num_experts, f)
  _check_expert_ids(idx_TK, num_experts)


def _check_expert_ids(idx_TK, num_experts):
  """Traced ids cannot be checked: the pair plan makes such a pair contribute nothing."""
  check_ids_in_range(idx_TK, num_experts, "idx_TK", "an expert id")


class DispatchStats(NamedTuple):
  """What a `moe_ffn` call did beyond its output (`return_stats=True`).

  Attributes:
    dropped_pairs: int32, token–expert pairs the dispatcher dropped over the whole mesh: those over an
      all-to-all `capacity_factor`'s slots; 0 for every dropless dispatcher. A dropped pair contributes nothing.
  """

  dropped_pairs: jax.Array


def moe_ffn(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, mesh=None, dispatcher="ring_expert",
            expert_axis=EXPERT, token_axes=None, tensor_axis=None, shared=None, shared_gate_D1=None,
            return_stats=False, activation="swiglu", out_sharding=None, **options):
  """The MoE block: y_TD = Σ_k w_TK[t,k] · expert_{idx_TK[t,k]}(x_TD[t]), an expert down(act(x·gate) · (x·up))
  (SwiGLU by default) or, for a plain activation, down(act(x·gate)) with w_up_EDF None.

  Works on global `jax.Array`s, inside or outside `jax.jit`, under `jax.grad`; differentiable with respect to
  x_TD, w_TK and the expert weights. Inputs with another sharding are resharded. Any number of tokens: T not
  divisible by the token shards is padded inside with rows that route nowhere (they cost nothing in the rings).
  Zero tokens give an empty y_TD (and zero expert-weight gradients) with every dispatcher, which is not run. Not
  under `jax.vmap` (a ValueError says why): pass the batch as leading dims of x instead.

  Inside your own `jax.shard_map` (leave out `mesh`): over every axis of the block, the arrays are this device's
  (its tokens, its L = E/N experts) and the ring runs on your axes directly; over some of them (the data axes), the
  block runs its own `shard_map` over the others. Tokens must vary over the token axes, expert weights over the
  expert axis and not over the data axes; `tensor_axis` and `out_sharding` are refused there.

  Expert ids outside [0, E) raise a ValueError where idx_TK's values are known (an eager call, or a constant under
  `jit`); traced under `jit`, such a (token, expert) pair contributes nothing, with every dispatcher: no output,
  a zero gradient for its router weight, and no effect on any other pair.

  Args:
    x_TD: tokens [..., D] (e.g. [T, D] or [B, S, D]; leading dims are folded into T), float32 or bfloat16.
    idx_TK: int expert ids [..., K] in [0, E) (from `route`), x's leading dims.
    w_TK: router weights [..., K], x's dtype.
    w_gate_EDF, w_up_EDF, w_down_EFD: expert weights, x's dtype; w_up_EDF None for a plain `activation` (then
      w_gate_EDF is the input matrix W_in).
    mesh: a `jax.sharding.Mesh` (Explicit axes from `jax.make_mesh`, or Auto); None: the `jax.set_mesh` context's.
    dispatcher: a name in `DISPATCHERS` ("ring_expert", "all_to_all", "dense") or a dispatcher instance.
    expert_axis: mesh axis the experts are split over; the ring runs along it.
    token_axes: mesh axes the tokens are split over (default: all axes of the mesh but tensor_axis).
    tensor_axis: mesh axis that splits F of every expert (expert tensor parallelism), or None.
    shared: optional Qwen2-MoE shared expert (w_gate_DF, w_up_DF, w_down_FD), computed locally outside the ring
      and added to the output; scaled by sigmoid(x · shared_gate_D1) when that is given.
    return_stats: also return a `DispatchStats` (the pairs a capacity factor dropped).
    activation: the experts' activation (`activations.ACTIVATIONS`): "swiglu" (default), "geglu" (Gemma:
      gelu(x·gate) · (x·up), gelu's tanh form), or the plain two-matrix "gelu" (tanh form) and "relu" (Switch,
      GShard). SwiGLU alone runs in the Hopper gate/up kernel's epilogue; the others fall back from it (logged).
    out_sharding: y's sharding, a PartitionSpec on `mesh` (or a NamedSharding); None: as x_TD came (below).
    **options: the named dispatcher's own options, e.g. `chunk_rows=` (ring_expert), `capacity_factor=`
      (all_to_all), `backend=`.

  Returns:
    y_TD, x's shape and dtype (with `return_stats`, `(y_TD, DispatchStats)`), sharded as `out_sharding` says or
    else as x_TD came: on an Explicit mesh by its type (so a residual `x + y` type-checks), on an Auto mesh through
    XLA's propagation (`shard_alike`, whose group ids JAX counts process-wide: a program lowered after others
    differs from the same one lowered first, so the persistent compilation cache misses it; give `out_sharding`
    where that matters).

  Raises:
    ValueError: naming the bad value: shapes, dtypes, top-k, axes the mesh lacks, unknown dispatcher, option or
      activation, w_up_EDF given to a plain activation or missing for a gated one,
      (where known) expert ids out of range, no mesh, and a call under `jax.vmap`.
  """
  arrays = (x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
  if _FORCED.get() is not None:
    forced, calls = _FORCED.get()
    calls.append(dispatcher)
    dispatcher, options = (dispatcher, options) if forced is None else (forced, {})
  mesh = block_mesh(mesh)
  for name, w in dict(w_gate_EDF=w_gate_EDF, w_up_EDF=w_up_EDF, w_down_EFD=w_down_EFD).items():
    if w is not None:
      placement.check_experts_split(name, w, expert_axis=expert_axis, tensor_axis=tensor_axis, mesh=mesh)
  static = dict(mesh=mesh, dispatcher=dispatcher, expert_axis=expert_axis,
                token_axes=tuple(token_axes or ()), tensor_axis=tensor_axis, return_stats=return_stats,
                activation=activation, out_sharding=out_sharding, options=tuple(sorted(options.items())))
  if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((arrays, shared, shared_gate_D1))) or \
      not _hashable(static):
    return _block(*arrays, shared=shared, shared_gate_D1=shared_gate_D1, **static)
  # Eager: compiled once per static arguments and shapes, not traced op by op on every call (seconds each).
  out = _compiled_block(*arrays, shared=shared, shared_gate_D1=shared_gate_D1, **static)
  _check_expert_ids(idx_TK, w_gate_EDF.shape[0])  # after every other check (the trace's): it sees the ids traced
  return out


def _hashable(static):
  try:
    hash(tuple(static.values()))
  except TypeError:
    return False
  return True


def _block(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, shared, shared_gate_D1, mesh, dispatcher,
           expert_axis, token_axes, tensor_axis, return_stats, activation, out_sharding, options):
  """`moe_ffn` with its mesh resolved and its dispatcher options as sorted (name, value) pairs."""
  layout = ExpertLayout(mesh=mesh, expert_axis=expert_axis, token_axes=token_axes, tensor_axis=tensor_axis)
  dispatcher = _dispatcher_for(layout, dispatcher, dict(options))
  _check_ranks(x_TD, idx_TK, w_TK)
  if layout.manual_axes:
    _check_in_callers_shard_map(layout, dict(x_TD=x_TD, w_gate_EDF=w_gate_EDF, w_up_EDF=w_up_EDF,
                                             w_down_EFD=w_down_EFD))
  _check_up_matrix(w_up_EDF, activation)
  x_sharding, x_in = layout.caller_sharding(x_TD), x_TD
  x_TD, idx_TK, w_TK = (fold(layout, a) for a in (x_TD, idx_TK, w_TK))
  _check_inputs(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout)
  if shared is not None:
    _check_shared(x_TD, shared, shared_gate_D1)
  x_TD, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD = refuse_vmap((x_TD, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD))
  y_TD, dropped = _sharded_block(layout, dispatcher, x_TD, idx_TK.astype(jnp.int32), w_TK, w_gate_EDF, w_up_EDF,
                                 w_down_EFD, count_drops=return_stats, activation=activation)
  if shared is not None:
    y_TD = y_TD + _shared_where_y_is(layout, x_TD, shared, shared_gate_D1)
  y = layout.restore(unfold(layout, y_TD, x_in), x_sharding, x_in, out_sharding)
  return (y, DispatchStats(dropped_pairs=dropped)) if return_stats else y


_compiled_block = jax.jit(_block, static_argnames=("mesh", "dispatcher", "expert_axis", "token_axes", "tensor_axis",
                                                   "return_stats", "activation", "out_sharding", "options"))


def _sharded_block(layout, dispatcher, x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, count_drops,
                   activation):
  """(y_TD, dropped pairs): padding, placement and the dispatcher. y_TD is over the token axes, or replicated on an
  Explicit mesh where T was padded (T rows do not split evenly over them)."""
  t, num_experts, tok = x_TD.shape[0], layout.num_experts(w_gate_EDF), layout.token_spec
  if t == 0:
    # Every device sees the same global T, so all skip together. There is nothing to send, and XLA rejected the
    # token ring's backward shard_map over empty shards (JAX 0.10.2: no GlobalToLocalShape for its operand).
    return layout.place(jnp.zeros_like(x_TD), tok), jnp.zeros((), jnp.int32)
  pad = padding_for(layout, t)
  x_TD, idx_TK, w_TK = (layout.place(a, P()) if pad and layout.explicit else a for a in (x_TD, idx_TK, w_TK))
  x_TD, idx_TK, w_TK = (layout.place(pad_rows(a, pad, v), tok)
                        for a, v in ((x_TD, 0), (idx_TK, num_experts), (w_TK, 0)))
  w_gate_EDF, w_up_EDF, w_down_EFD = (None if w is None else layout.place(w, spec) for w, spec in
                                      zip((w_gate_EDF, w_up_EDF, w_down_EFD), layout.expert_specs))
  weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
  if layout.manual_axes and not layout.per_device:
    # In a caller's shard_map over some of the block's axes: one more over the others, and then per device.
    per_device = functools.partial(_dispatch_per_device, dispatcher, layout, activation)
    y_TD = shard_map_over_free_axes(layout, per_device, (x_TD, w_TK, *weights), (idx_TK,),
                                    (tok, tok, *layout.expert_specs, tok), tok)
  elif isinstance(dispatcher, Dense) and not layout.per_device:
    # The oracle's global-array math needs a mesh context under an Explicit mesh inside a caller's jit; in a
    # shard_map over replicated inputs it runs on every device without one.
    oracle = functools.partial(dense_moe, activation=activation)
    y_TD = layout.place(layout.shard_map(oracle, in_specs=(P(),) * 6, out_specs=P())(
        *(None if a is None else layout.place(a, P()) for a in (x_TD, idx_TK, w_TK, *weights))), tok)
  else:
    y_TD = _dispatch(dispatcher, layout, activation, x_TD, idx_TK, w_TK, *weights)
  count = getattr(dispatcher, "dropped_pairs", None) if count_drops else None
  dropped = count(idx_TK, num_experts, layout=layout) if count else jnp.zeros((), jnp.int32)
  return (layout.place(y_TD, P())[:t] if pad else y_TD), dropped


def _dispatch(dispatcher, layout, activation, *arrays):
  # A dispatcher of the caller's own written before activations takes no `activation`: SwiGLU is its default.
  by_name = {} if activation == "swiglu" else dict(activation=activation)
  return dispatcher(*arrays, layout=layout, **by_name)


def _dispatch_per_device(dispatcher, layout, activation, x_TD, w_TK, w_gate, w_up, w_down, idx_TK):
  """The dispatcher inside the block's own shard_map over the axes a caller's left free: every axis is Manual."""
  return _dispatch(dispatcher, dataclasses.replace(layout, mesh=jax.sharding.get_abstract_mesh()), activation,
                   x_TD, idx_TK, w_TK, w_gate, w_up, w_down)


def _check_in_callers_shard_map(layout, arrays):
  if layout.tensor_axis is not None:
    raise UserError(f"tensor_axis={layout.tensor_axis!r} is not supported inside a shard_map (axes "
                    f"{layout.manual_axes} Manual): call the block outside it for expert tensor parallelism")
  placement.check_per_device(layout, arrays)


def _shared_where_y_is(layout, x_TD, shared, gate_D1):
  """The shared expert on x placed as the block's output is: over the token axes, or replicated where T needed
  padding."""
  spec = P() if padding_for(layout, x_TD.shape[0]) else layout.token_spec
  x_TD = layout.place(x_TD, spec)
  if not layout.explicit or layout.manual_axes:  # (inside a caller's shard_map, the context's mesh is set)
    return shared_expert(x_TD, *shared, gate_D1)
  # Per device in a shard_map: as global math on an Explicit mesh outside `jax.set_mesh`, the weight gradients
  # (contractions over the sharded tokens) are refused as ambiguously sharded.
  weights = tuple(layout.place(w, P()) for w in (*shared, *([] if gate_D1 is None else [gate_D1])))
  return layout.shard_map(shared_expert, in_specs=(spec,) + (P(),) * len(weights), out_specs=spec)(x_TD, *weights)


def _dispatcher_for(layout, dispatcher, options):
  if isinstance(dispatcher, str):
    dispatcher = make_dispatcher(dispatcher, **options)
  elif options:
    raise UserError(f"options {sorted(options)} are given with a dispatcher instance; set them on the instance")
  if isinstance(layout.mesh, AbstractMesh) and getattr(dispatcher, "backend", None) == "auto":
    # Inside jit the context gives only an abstract mesh, which names no device to choose a backend by.
    dispatcher = dataclasses.replace(dispatcher, backend=resolve_backend("auto"))
  return dispatcher


def _check_ranks(x, idx, w):
  if x.ndim < 2 or idx.ndim != x.ndim or w.ndim != x.ndim or idx.shape[:-1] != x.shape[:-1] or \
      w.shape[:-1] != x.shape[:-1]:
    raise UserError(f"expected x_TD [..., D], idx_TK and w_TK [..., K] with x_TD's leading dims; got x_TD "
                    f"{x.shape}, idx_TK {idx.shape}, w_TK {w.shape}")


def dense_swiglu(x_TD, w_gate_DF, w_up_DF, w_down_FD):
  """down(silu(x·gate) · (x·up)) on every token, float32 accumulation, x's dtype out. Global arrays: XLA
  partitions it along the weights' and tokens' shardings."""
  f32 = dict(preferred_element_type=jnp.float32, precision=matmul_precision(x_TD.dtype))
  h_TF = jax.nn.silu(jnp.dot(x_TD, w_gate_DF, **f32)) * jnp.dot(x_TD, w_up_DF, **f32)
  return jnp.dot(h_TF.astype(x_TD.dtype), w_down_FD, **f32).astype(x_TD.dtype)


def shared_expert(x_TD, w_gate_DF, w_up_DF, w_down_FD, gate_D1=None):
  """The Qwen2-MoE shared expert: a SwiGLU of width F (its own) on every token, scaled by sigmoid(x · gate) if
  given. Computed where the tokens are, outside the ring."""
  y_TD = dense_swiglu(x_TD, w_gate_DF, w_up_DF, w_down_FD)
  if gate_D1 is None:
    return y_TD
  gate_T1 = jnp.dot(x_TD, gate_D1, preferred_element_type=jnp.float32, precision=matmul_precision(x_TD.dtype))
  return (jax.nn.sigmoid(gate_T1) * y_TD).astype(x_TD.dtype)


def _check_shared(x_TD, shared, gate_D1):
  if len(shared) != 3:
    raise UserError(f"shared must be (w_gate_DF, w_up_DF, w_down_FD); got {len(shared)} arrays")
  d = x_TD.shape[1]
  f = shared[0].shape[-1]
  expected = dict(w_gate_DF=(d, f), w_up_DF=(d, f), w_down_FD=(f, d))
  arrays = dict(zip(expected, shared))
  if gate_D1 is not None:
    expected["shared_gate_D1"], arrays["shared_gate_D1"] = (d, 1), gate_D1
  wrong = {k: tuple(a.shape) for k, a in arrays.items() if tuple(a.shape) != expected[k]}
  if wrong:
    raise UserError(f"shared expert shape mismatch: {wrong}; expected {expected}")
  wrong_dtypes = {k: str(a.dtype) for k, a in arrays.items() if a.dtype != x_TD.dtype}
  if wrong_dtypes:
    raise UserError(f"shared expert dtype mismatch: {wrong_dtypes} differ from x_TD's {x_TD.dtype}")
