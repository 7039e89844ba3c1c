"""`moe_ffn`: the public MoE block over global sharded arrays, and the dispatcher registry.

Every dispatcher computes y_TD = Σ_k w[t,k] · SwiGLU_{idx[t,k]}(x[t]); they differ only in where the pairs are
computed and what is held (see each dispatcher's module for what moves between devices).
"""

import dataclasses

import jax
import jax.numpy as jnp

from relaymoe_jax.all_to_all import AllToAll
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.dense import Dense
from relaymoe_jax.layout import ExpertLayout
from relaymoe_jax.ring_expert import RingExpert

DISPATCHERS = {
    "ring_expert": RingExpert,
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
  if t % layout.token_shards:
    raise ValueError(f"T={t} tokens is not divisible by the {layout.token_shards} token shards of axes "
                     f"{layout.token_axes}")


def moe_ffn(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, mesh, dispatcher="ring_expert",
            expert_axis=EXPERT, token_axes=None, **options):
  """The SwiGLU MoE block: y_TD = Σ_k w_TK[t,k] · SwiGLU_{idx_TK[t,k]}(x_TD[t]).

  Works on global `jax.Array`s, inside or outside `jax.jit`, under `jax.grad`; differentiable with respect to
  x_TD, w_TK and the three expert weights. Inputs with another sharding are resharded.

  Args:
    x_TD: tokens [T, D], float32 or bfloat16.
    idx_TK: int expert ids [T, K] (from `route`).
    w_TK: router weights [T, K], x's dtype.
    w_gate_EDF, w_up_EDF, w_down_EFD: SwiGLU expert weights, x's dtype.
    mesh: a `jax.sharding.Mesh` (Explicit axes from `jax.make_mesh`, or Auto).
    dispatcher: a name in `DISPATCHERS` ("ring_expert", "all_to_all", "dense") or a dispatcher instance.
    expert_axis: mesh axis the experts are split over; the ring runs along it.
    token_axes: mesh axes the tokens are split over (default: all axes of the mesh).
    **options: the named dispatcher's own options, e.g. `chunk_rows=` (ring_expert), `capacity_factor=`
      (all_to_all), `backend=`.

  Returns:
    y_TD in x's dtype, sharded over the token axes.
  """
  layout = ExpertLayout(mesh=mesh, expert_axis=expert_axis, token_axes=tuple(token_axes or ()))
  if isinstance(dispatcher, str):
    dispatcher = make_dispatcher(dispatcher, **options)
  elif options:
    raise ValueError(f"options {sorted(options)} are given with a dispatcher instance; set them on the instance")
  _check_inputs(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout)
  tok, exp = layout.token_spec, layout.expert_spec
  x_TD, idx_TK, w_TK = (layout.place(a, tok) for a in (x_TD, idx_TK.astype(jnp.int32), w_TK))
  w_gate_EDF, w_up_EDF, w_down_EFD = (layout.place(w, exp) for w in (w_gate_EDF, w_up_EDF, w_down_EFD))
  return dispatcher(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout=layout)
