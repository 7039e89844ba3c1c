"""`moe_ffn`: the public MoE block over global sharded arrays, and the dispatcher registry.

Every dispatcher computes y_TD = Σ_k w[t,k] · SwiGLU_{idx[t,k]}(x[t]); they differ only in where the pairs are
computed and what is held (see each dispatcher's module for what moves between devices). Shape letters: see
relaymoe_jax.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.all_to_all import AllToAll
from relaymoe_jax.auto import Auto
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.dense import Dense
from relaymoe_jax.grouped_matmul import matmul_precision
from relaymoe_jax.layout import ExpertLayout
from relaymoe_jax.ring_expert import RingExpert
from relaymoe_jax.ring_token import RingToken

DISPATCHERS = {
    "ring_expert": RingExpert,
    "ring_token": RingToken,
    "auto": Auto,
    "all_to_all": AllToAll,
    "dense": Dense,
}


def make_dispatcher(name, **options):
  """A dispatcher instance from its registry name and its own options, each rejected by name if unknown."""
  if name not in DISPATCHERS:
    raise ValueError(f"unknown dispatcher {name!r}; known: {sorted(DISPATCHERS)}")
  cls = DISPATCHERS[name]
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(options) - known)
  if unknown:
    raise ValueError(f"unknown option(s) {unknown} for dispatcher {name!r}; it takes {sorted(known)}")
  return cls(**options)


def _check_inputs(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout):
  shapes = dict(x_TD=x_TD.shape, idx_TK=idx_TK.shape, w_TK=w_TK.shape, w_gate_EDF=w_gate_EDF.shape,
                w_up_EDF=w_up_EDF.shape, w_down_EFD=w_down_EFD.shape)
  if x_TD.ndim != 2 or idx_TK.ndim != 2 or w_gate_EDF.ndim != 3:
    raise ValueError(f"expected x_TD [T, D], idx_TK [T, K], w_gate_EDF [E, D, F]; got {shapes}")
  (t, d), (e, _, f), k = x_TD.shape, w_gate_EDF.shape, idx_TK.shape[1]
  expected = dict(x_TD=(t, d), idx_TK=(t, k), w_TK=(t, k), w_gate_EDF=(e, d, f), w_up_EDF=(e, d, f),
                  w_down_EFD=(e, f, d))
  wrong = {name: shapes[name] for name in expected if tuple(shapes[name]) != expected[name]}
  if wrong:
    raise ValueError(f"shape mismatch: {wrong}; expected {expected} from x_TD {x_TD.shape} and "
                     f"w_gate_EDF {w_gate_EDF.shape}")
  if not 1 <= k <= e:
    raise ValueError(f"top_k={k} (idx_TK.shape[1]) must be between 1 and the number of experts E={e}")
  if not jnp.issubdtype(idx_TK.dtype, jnp.integer):
    raise ValueError(f"idx_TK must hold integer expert ids; got dtype {idx_TK.dtype}")
  if not jnp.issubdtype(x_TD.dtype, jnp.floating):
    raise ValueError(f"x_TD must be floating point; got dtype {x_TD.dtype}")
  dtypes = dict(w_TK=w_TK.dtype, w_gate_EDF=w_gate_EDF.dtype, w_up_EDF=w_up_EDF.dtype,
                w_down_EFD=w_down_EFD.dtype)
  wrong_dtypes = {name: str(dt) for name, dt in dtypes.items() if dt != x_TD.dtype}
  if wrong_dtypes:
    raise ValueError(f"dtype mismatch: {wrong_dtypes} differ from x_TD's {x_TD.dtype}")
  n = layout.ring_size
  if e % n:
    raise ValueError(f"E={e} experts is not divisible by the size {n} of expert axis {layout.expert_axis!r}")
  if f % layout.tensor_size:
    raise ValueError(f"F={f} is not divisible by the size {layout.tensor_size} of tensor axis {layout.tensor_axis!r}")
  if t % layout.token_shards:
    raise ValueError(f"T={t} tokens is not divisible by the {layout.token_shards} token shards of axes "
                     f"{layout.token_axes}")
  _check_expert_ids(idx_TK, e)


def _check_expert_ids(idx_TK, num_experts):
  """Rejects ids outside [0, E) where their values are known here: not traced, and every shard on this process.
  (Traced ids cannot be checked; the pair plan makes such a pair contribute nothing.)"""
  if isinstance(idx_TK, jax.core.Tracer) or not getattr(idx_TK, "is_fully_addressable", True):
    return
  ids_TK = np.asarray(idx_TK)
  bad = np.argwhere((ids_TK < 0) | (ids_TK >= num_experts))
  if bad.size:
    t, k = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise ValueError(f"idx_TK[{t}, {k}] = {ids_TK[t, k]} is not an expert id in [0, {num_experts}){more}")


def moe_ffn(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, mesh, dispatcher="ring_expert",
            expert_axis=EXPERT, token_axes=None, tensor_axis=None, shared=None, shared_gate_D1=None, **options):
  """The SwiGLU MoE block: y_TD = Σ_k w_TK[t,k] · SwiGLU_{idx_TK[t,k]}(x_TD[t]).

  Works on global `jax.Array`s, inside or outside `jax.jit`, under `jax.grad`; differentiable with respect to
  x_TD, w_TK and the three expert weights. Inputs with another sharding are resharded. Zero tokens give an empty
  y_TD (and zero expert-weight gradients) with every dispatcher, which is not run.

  Expert ids outside [0, E) raise a ValueError where idx_TK's values are known (an eager call, or a constant under
  `jit`); traced under `jit`, such a (token, expert) pair contributes nothing, with every dispatcher: no output,
  a zero gradient for its router weight, and no effect on any other pair.

  Args:
    x_TD: tokens [T, D], float32 or bfloat16.
    idx_TK: int expert ids [T, K] in [0, E) (from `route`).
    w_TK: router weights [T, K], x's dtype.
    w_gate_EDF, w_up_EDF, w_down_EFD: SwiGLU expert weights, x's dtype.
    mesh: a `jax.sharding.Mesh` (Explicit axes from `jax.make_mesh`, or Auto).
    dispatcher: a name in `DISPATCHERS` ("ring_expert", "all_to_all", "dense") or a dispatcher instance.
    expert_axis: mesh axis the experts are split over; the ring runs along it.
    token_axes: mesh axes the tokens are split over (default: all axes of the mesh but tensor_axis).
    tensor_axis: mesh axis that splits F of every expert (expert tensor parallelism), or None.
    shared: optional Qwen2-MoE shared expert (w_gate_DF, w_up_DF, w_down_FD), computed locally outside the ring
      and added to the output; scaled by sigmoid(x · shared_gate_D1) when that is given.
    **options: the named dispatcher's own options, e.g. `chunk_rows=` (ring_expert), `capacity_factor=`
      (all_to_all), `backend=`.

  Returns:
    y_TD in x's dtype. On an Explicit mesh, sharded as x_TD came (so a residual `x + y` type-checks); on an Auto
    mesh, over the token axes.

  Raises:
    ValueError: naming the bad value: shapes, dtypes, top-k, divisibility by the mesh axes, unknown dispatcher or
      option, and (where known) expert ids out of range.
  """
  layout = ExpertLayout(mesh=mesh, expert_axis=expert_axis, token_axes=tuple(token_axes or ()),
                        tensor_axis=tensor_axis)
  if isinstance(dispatcher, str):
    dispatcher = make_dispatcher(dispatcher, **options)
  elif options:
    raise ValueError(f"options {sorted(options)} are given with a dispatcher instance; set them on the instance")
  _check_inputs(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout)
  if shared is not None:
    _check_shared(x_TD, shared, shared_gate_D1)
  tok = layout.token_spec
  x_sharding = layout.caller_sharding(x_TD)
  x_TD, idx_TK, w_TK = (layout.place(a, tok) for a in (x_TD, idx_TK.astype(jnp.int32), w_TK))
  if x_TD.shape[0] == 0:
    # Every device sees the same global T, so all skip together. There is nothing to send, and XLA rejected the
    # token ring's backward shard_map over empty shards (JAX 0.10.2: no GlobalToLocalShape for its operand).
    y_TD = layout.place(jnp.zeros_like(x_TD), tok)
  else:
    w_gate_EDF, w_up_EDF, w_down_EFD = (layout.place(w, spec) for w, spec in
                                        zip((w_gate_EDF, w_up_EDF, w_down_EFD), layout.expert_specs))
    y_TD = dispatcher(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout=layout)
  if shared is not None:
    y_TD = y_TD + shared_expert(x_TD, *shared, shared_gate_D1)
  return layout.restore(y_TD, x_sharding)


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
    raise ValueError(f"shared must be (w_gate_DF, w_up_DF, w_down_FD); got {len(shared)} arrays")
  d = x_TD.shape[1]
  f = shared[0].shape[-1]
  expected = dict(w_gate_DF=(d, f), w_up_DF=(d, f), w_down_FD=(f, d))
  arrays = dict(zip(expected, shared))
  if gate_D1 is not None:
    expected["shared_gate_D1"], arrays["shared_gate_D1"] = (d, 1), gate_D1
  wrong = {k: tuple(a.shape) for k, a in arrays.items() if tuple(a.shape) != expected[k]}
  if wrong:
    raise ValueError(f"shared expert shape mismatch: {wrong}; expected {expected}")
  wrong_dtypes = {k: str(a.dtype) for k, a in arrays.items() if a.dtype != x_TD.dtype}
  if wrong_dtypes:
    raise ValueError(f"shared expert dtype mismatch: {wrong_dtypes} differ from x_TD's {x_TD.dtype}")
