"""The feed-forward blocks of a decoder layer: the dense SwiGLU MLP and the MoE (router, experts through
`relaymoe_jax.moe_ffn`, the optional Qwen2-MoE shared expert). Shape letters: see `relaymoe_jax`."""

import functools

import jax
from jax.sharding import PartitionSpec as P

import relaymoe_jax as rm
from models.attention.context_parallel import flatten_tokens, unflatten_tokens
from models.qwen3.layer import Layer
from models.router_state import bias_value, router_bias
from models.sharding import TOKEN_AXES, make_param
from models.spans import Spans
from relaymoe_jax.axes import TENSOR
from relaymoe_jax.moe import RINGS


class DenseMLP(Layer):

  def __init__(self, config, runtime, width, mesh, rngs):
    super().__init__(config, runtime)
    param = functools.partial(make_param, config, runtime, mesh, rngs)
    d = config.hidden_size
    self.gate_DF, self.up_DF = param("mlp_in_DF", (d, width)), param("mlp_in_DF", (d, width))
    self.down_FD = param("mlp_out_FD", (width, d))

  def __call__(self, x):
    with jax.named_scope("projection"):
      return rm.dense_swiglu(x, self.cast(self.gate_DF), self.cast(self.up_DF), self.cast(self.down_FD))


class MoE(Layer):
  """Router + experts through `relaymoe_jax`, plus the optional Qwen2-MoE shared expert."""

  def __init__(self, config, runtime, mesh, rngs):
    super().__init__(config, runtime)
    param = functools.partial(make_param, config, runtime, mesh, rngs)
    c = config
    d, f, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
    self.mesh = mesh
    self.router_DE = param("router_DE", (d, e))
    self.w_gate_EDF, self.w_up_EDF = param("experts_in_EDF", (e, d, f)), param("experts_in_EDF", (e, d, f))
    self.w_down_EFD = param("experts_out_EFD", (e, f, d))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # not a caller's context mesh
      self.router_bias_E = router_bias(c, mesh)
    if c.shared_expert_intermediate_size:
      fs = c.shared_expert_intermediate_size
      self.shared_gate_DF, self.shared_up_DF = param("mlp_in_DF", (d, fs)), param("mlp_in_DF", (d, fs))
      self.shared_down_FD = param("mlp_out_FD", (fs, d))
      self.shared_gate_D1 = param("shared_gate_D1", (d, 1))

  def __call__(self, x_BSD):
    with jax.named_scope("moe"):  # the step profile's part (`train.profile.step_parts`), as the other scopes in this file
      return self._moe(x_BSD)

  def _moe(self, x_BSD):
    c = self.config
    b, s, d = x_BSD.shape
    run = self.runtime
    x_TD = flatten_tokens(x_BSD, self.mesh) if run.context_parallel else x_BSD.reshape(b * s, d)
    with jax.named_scope("router"):
      idx_TK, w_TK, aux = rm.route(x_TD, self.cast(self.router_DE), top_k=c.num_experts_per_tok,
                                   norm_topk_prob=c.norm_topk_prob, bias_E=bias_value(self.router_bias_E))
    spans = self._shared_expert_spans(s)
    shared = {}
    if c.shared_expert_intermediate_size and not spans:
      shared = dict(shared=(self.cast(self.shared_gate_DF), self.cast(self.shared_up_DF),
                            self.cast(self.shared_down_FD)), shared_gate_D1=self.cast(self.shared_gate_D1))
    y_TD, stats = rm.moe_ffn(x_TD, idx_TK, w_TK, self.cast(self.w_gate_EDF), self.cast(self.w_up_EDF),
                             self.cast(self.w_down_EFD), mesh=self.mesh, dispatcher=run.dispatcher,
                             token_axes=TOKEN_AXES, tensor_axis=TENSOR if run.moe_tensor_parallel else None,
                             return_stats=True, out_sharding=P(TOKEN_AXES), **shared, **dict(run.dispatcher_options))
    y_BSD = unflatten_tokens(y_TD, b, s, self.mesh) if run.context_parallel else y_TD.reshape(b, s, d)
    if spans:
      ws = [spans.whole(self.cast(w), self.mesh)
            for w in (self.shared_gate_DF, self.shared_up_DF, self.shared_down_FD, self.shared_gate_D1)]
      y_BSD = y_BSD + spans.map(lambda x: rm.shared_expert(x.reshape(-1, d), *ws).reshape(x.shape), x_BSD)
    return y_BSD, rm.MoEAux(router=aux, dropped_pairs=stats.dropped_pairs)

  def _shared_expert_spans(self, seq_len):
    """The spans the shared expert runs in outside `moe_ffn`, or None: where rows run in spans and a ring dispatches
    (not under context parallelism). Its backward's float32 gradients and input gradients are then a span's, not the
    row's: compile-only for one H200, the Qwen3.5 slice's ring step at 1,163,264 tokens went from 131.57 to 117.23
    GiB. Not for the all-to-all, whose top-k-expanded buffers hold its peak: beside them the spans' backward added
    6.05 GiB at 507,904 tokens."""
    run = self.runtime
    if not self.config.shared_expert_intermediate_size or run.context_parallel or run.dispatcher not in RINGS:
      return None
    spans = Spans.of_run(seq_len, run, self.mesh)
    return spans if spans.count > 1 else None
