"""The MoE block as a layer computes it, for the Flax layers (`linen_layer`, `nnx_layer`) to share: parameter
shapes and shardings, and route → moe_ffn (+ shared expert) on x [..., D] returning (y, MoEAux).

No communication of its own (`moe_ffn`'s). Shape letters: see relaymoe_jax.
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax import activations, placement
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.errors import UserError
from relaymoe_jax.layout import ExpertLayout
from relaymoe_jax.moe import make_dispatcher, moe_ffn
from relaymoe_jax.routing import RouterAux, route


class MoEAux(NamedTuple):
  """A layer's auxiliary outputs.

  Attributes:
    router: `RouterAux` (load-balancing loss, z-loss, per-expert counts, f and P); over several layers,
      `rm.load_balancing_loss([aux.router for aux in auxes])`.
    dropped_pairs: int32, token–expert pairs an all-to-all `capacity_factor` dropped (0 when dropless).
  """

  router: RouterAux
  dropped_pairs: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
  """What both layers take: the block's sizes, where it runs and how.

  Attributes:
    num_experts, top_k, d_ff: E, K and each expert's F (D comes from the input).
    shared_d_ff: the Qwen2-MoE shared expert's F, None for none; it is scaled by sigmoid(x · gate) when
      `shared_gate`.
    norm_topk_prob: renormalise the top-k router probabilities (Qwen3).
    mesh: the mesh, None for the `jax.set_mesh` context's.
    dispatcher: a name in `rm.DISPATCHERS` or an instance; `dispatcher_options` its options as a dict.
    expert_axis, token_axes, tensor_axis: as for `moe_ffn`.
    dtype: compute dtype (parameters are cast to it), None for the input's.
    activation: the experts' (`moe_ffn`'s): "swiglu", "geglu", or the plain two-matrix "gelu" and "relu", whose
      experts have no w_up_EDF.
  """

  num_experts: int
  top_k: int
  d_ff: int
  shared_d_ff: int | None = None
  shared_gate: bool = True
  norm_topk_prob: bool = True
  mesh: Any = None
  dispatcher: Any = "ring_expert"
  dispatcher_options: Any = None
  expert_axis: str = EXPERT
  token_axes: tuple[str, ...] | None = None
  tensor_axis: str | None = None
  dtype: Any = None
  activation: str = "swiglu"


def block_config(layer_name, **fields):
  """`BlockConfig(**fields)`, an unknown field refused naming the layer (not this class) and what it takes."""
  known = [f.name for f in dataclasses.fields(BlockConfig)]
  unknown = sorted(set(fields) - set(known))
  if unknown:
    raise UserError(f"unknown argument(s) {unknown} for {layer_name}; it takes {known} (a dispatcher's own options, "
                     "e.g. chunk_rows, go in dispatcher_options={...})")
  return BlockConfig(**fields)


def check_config(config, mesh):
  """The project's own errors for what would otherwise fail inside JAX when parameters are placed: an expert
  count or F the mesh does not divide, axes the mesh lacks, top_k out of range, an unknown dispatcher or option.
  `mesh`: where the parameters go (None: no mesh to check against)."""
  if not 1 <= config.top_k <= config.num_experts:
    raise UserError(f"top_k={config.top_k} must be between 1 and the number of experts E={config.num_experts}")
  if isinstance(config.dispatcher, str):
    make_dispatcher(config.dispatcher, **dict(config.dispatcher_options or {}))
  if mesh is None or mesh.empty:
    return
  layout = ExpertLayout(mesh=mesh, expert_axis=config.expert_axis, token_axes=tuple(config.token_axes or ()),
                        tensor_axis=config.tensor_axis)
  layout.check_sizes(config.num_experts, config.d_ff)


def check_experts_split(name, w, config, mesh):
  """`placement.check_experts_split` with the config's axes."""
  placement.check_experts_split(name, w, expert_axis=config.expert_axis, tensor_axis=config.tensor_axis, mesh=mesh)


def param_shapes(config, d_model):
  """{name: (shape, PartitionSpec entries, fan-in)} of every parameter the block holds."""
  e, d, f, ax, tp = config.num_experts, d_model, config.d_ff, config.expert_axis, config.tensor_axis
  bad = [f"{name}={n}" for name, n in dict(d_model=d, num_experts=e, d_ff=f, shared_d_ff=config.shared_d_ff or 0
                                              ).items() if n < (name != "shared_d_ff")]
  if bad:
    raise UserError(f"{', '.join(bad)}: must be ≥ 1 (shared_d_ff ≥ 0: 0 or None is no shared expert)")
  params = dict(router_DE=((d, e), (None, None), d), w_gate_EDF=((e, d, f), (ax, None, tp), d),
                w_up_EDF=((e, d, f), (ax, None, tp), d), w_down_EFD=((e, f, d), (ax, tp, None), f))
  if not activations.is_gated(config.activation):
    del params["w_up_EDF"]
  if config.shared_d_ff:
    fs = config.shared_d_ff
    params.update(shared_gate_DF=((d, fs), (None, None), d), shared_up_DF=((d, fs), (None, None), d),
                  shared_down_FD=((fs, d), (None, None), fs))
    if config.shared_gate:
      params["shared_gate_D1"] = ((d, 1), (None, None), d)
  return params


def initializer(shape, fan_in, *, init_scale=1.0, kernel_init=None):
  """A parameter's initializer, (key, shape, dtype) → array: `kernel_init` on each expert's own matrix (so a Flax
  variance-scaling initializer sees one expert's fan-in, not E times it) and on the router's, else normal ·
  init_scale / sqrt(fan-in)."""
  if kernel_init is None:
    return jax.nn.initializers.normal(init_scale / fan_in ** 0.5)
  if init_scale != 1.0:
    raise UserError(f"init_scale={init_scale} scales the default initializer; with kernel_init= give the scale in "
                    "the initializer instead")
  if len(shape) == 2:
    return kernel_init
  return lambda key, shape, dtype: jax.vmap(lambda k: kernel_init(k, shape[1:], dtype))(
      jax.random.split(key, shape[0]))


def moe_block(config, params, x):
  """y = the MoE block on x [..., D] (any leading dims), and its `MoEAux`.

  Args:
    config: `BlockConfig`.
    params: {name: array} as `param_shapes` names them.
    x: [..., D] tokens.

  Returns:
    (y with x's shape and the compute dtype, MoEAux).
  """
  dtype = config.dtype or x.dtype
  p = {name: jnp.asarray(a).astype(dtype) for name, a in params.items()}
  x = x.astype(dtype)
  idx_TK, w_TK, router_aux = route(x, p["router_DE"], top_k=config.top_k, norm_topk_prob=config.norm_topk_prob)
  shared = {}
  if config.shared_d_ff:
    shared = dict(shared=(p["shared_gate_DF"], p["shared_up_DF"], p["shared_down_FD"]),
                  shared_gate_D1=p.get("shared_gate_D1"))
  y, stats = moe_ffn(x, idx_TK, w_TK, p["w_gate_EDF"], p.get("w_up_EDF"),
                     p["w_down_EFD"], activation=config.activation, mesh=config.mesh, dispatcher=config.dispatcher,
                     expert_axis=config.expert_axis, token_axes=config.token_axes, tensor_axis=config.tensor_axis,
                     return_stats=True, **shared, **dict(config.dispatcher_options or {}))
  return y, MoEAux(router=router_aux, dropped_pairs=stats.dropped_pairs)
