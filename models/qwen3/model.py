"""Qwen3-MoE (and Qwen2-MoE options) in Flax NNX, matching Hugging Face's math so real checkpoints can be imported.

Decoder layer: h = x + Attn(RMSNorm(x)); out = h + MLP(RMSNorm(h)), where MLP is the MoE block
(`relaymoe_jax.route` + `relaymoe_jax.moe_ffn`) or a dense SwiGLU on `mlp_only_layers` / off-`decoder_sparse_step`
layers. Attention: GQA, per-head RMSNorm on q and k before RoPE (Qwen3), half-split RoPE over the full head_dim,
scale head_dim^-0.5, causal, through `jax.nn.dot_product_attention` (cuDNN flash attention on GPU). Consecutive
layers of one kind are one `LayerStack` (stacked parameters, one `lax.scan`) unless `runtime.scan_layers` is off.

A model is built from its architecture (`Qwen3MoEConfig`) and how it runs (`RuntimeConfig`, `models.qwen3.config`);
where everything lives on the mesh is `models.sharding`'s. Shape letters: see `relaymoe_jax`.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from models.attention.causal import attention
from models.attention.context_parallel import (check_sequence, context_attention, splits_sequences, to_held_order,
                                               to_sequence_order)
from models.attention.cudnn import tile_kernels
from models.inputs import check_rows, checked_inputs, embed
from models.loss import chunked_cross_entropy, mean_cross_entropy, plain_mean_cross_entropy
from models.qwen3.config import Qwen3MoEConfig, layer_groups
from models.qwen3.layer import Layer
from models.qwen3.mlp import DenseMLP, MoE
from models.runtime import RuntimeConfig
from models.remat import offloaded, remat_policy
from models.router_state import router_losses
from models.sharding import activation_spec, batch_axes, make_param, model_mesh, runs_on_model_mesh, sequence_axis
from relaymoe_jax.axes import EXPERT, TENSOR


def rms_norm(x, weight, eps):
  """Hugging Face RMSNorm: normalise in float32, cast back, then scale."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * y.astype(x.dtype)


def rope(x_BSQZ, positions_BS, theta):
  """Half-split rotary embedding (Hugging Face rotate_half) over the full head_dim, computed in float32."""
  half = x_BSQZ.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2 / x_BSQZ.shape[-1]))
  angles = positions_BS[..., None].astype(jnp.float32) * inv_freq  # [B, S, half]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :]
  x32 = x_BSQZ.astype(jnp.float32)
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
  return (x32 * cos + rotated * sin).astype(x_BSQZ.dtype)


class RMSNorm(Layer):

  def __init__(self, config, runtime, dim, mesh, rngs, role="norm_D"):
    super().__init__(config, runtime)
    param = functools.partial(make_param, config, runtime, mesh, rngs)
    self.weight = param(role, (dim,), "ones")

  def __call__(self, x):
    with jax.named_scope("norm"):
      return rms_norm(x, self.weight[...], self.config.rms_norm_eps)


class Attention(Layer):

  def __init__(self, config, runtime, mesh, rngs):
    super().__init__(config, runtime)
    param = functools.partial(make_param, config, runtime, mesh, rngs)
    c = config
    d, hq, hkv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    self.mesh = mesh
    self.q_DH, self.k_DG, self.v_DG = param("q_DH", (d, hq)), param("kv_DG", (d, hkv)), param(
        "kv_DG", (d, hkv))
    self.o_HD = param("o_HD", (hq, d))
    if c.attention_bias:
      self.q_bias, self.k_bias, self.v_bias = (param("bias_H", (n,), "zeros") for n in (hq, hkv, hkv))
    if c.qk_norm:
      self.q_norm, self.k_norm = (RMSNorm(c, runtime, c.head_dim, mesh, rngs, "head_norm"),
                                   RMSNorm(c, runtime, c.head_dim, mesh, rngs, "head_norm"))

  def __call__(self, x_BSD, positions_BS, segment_ids_BS=None):
    c = self.config
    b, s, _ = x_BSD.shape

    def project(w, bias_name, heads):
      y = x_BSD @ self.cast(w)
      if c.attention_bias:
        y = y + self.cast(getattr(self, bias_name))
      return y.reshape(b, s, heads, c.head_dim)

    with jax.named_scope("projection"):
      q = project(self.q_DH, "q_bias", c.num_attention_heads)
      k = project(self.k_DG, "k_bias", c.num_key_value_heads)
      v = project(self.v_DG, "v_bias", c.num_key_value_heads)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    with jax.named_scope("rope"):
      q, k = rope(q, positions_BS, c.rope_theta), rope(k, positions_BS, c.rope_theta)
    out = attend_heads(q, k, v, c.head_dim ** -0.5, self.runtime, self.mesh, segment_ids_BS)
    with jax.named_scope("projection"):
      return out.reshape(b, s, -1) @ self.cast(self.o_HD)


def attend_heads(q_BSQZ, k_BSJZ, v_BSJZ, scale, runtime, mesh, segment_ids_BS=None):
  """Causal attention of the heads, on the kernel `runtime` asks for: across the sequence's shards under context
  parallelism (`models.attention.context_parallel`), else of each row (`models.attention.causal`)."""
  platform = mesh.devices.flat[0].platform  # of the devices it will run on: compile-only ones too
  with jax.named_scope("attention"):
    if splits_sequences(runtime, mesh):
      kernels = tile_kernels(runtime.attention_implementation, platform, q_BSQZ.dtype, q_BSQZ.shape[-1])
      return context_attention(q_BSQZ, k_BSJZ, v_BSJZ, mesh=mesh, scale=scale, kernels=kernels,
                               segment_ids_BS=segment_ids_BS)
    return attention(q_BSQZ, k_BSJZ, v_BSJZ, scale, runtime.attention_implementation, platform, segment_ids_BS,
                     mesh, batch_axes(runtime), runtime.packed_documents())


class DecoderLayer(Layer):

  def __init__(self, config, runtime, layer, mesh, rngs):
    super().__init__(config, runtime)
    self.layer = layer
    self.input_norm = RMSNorm(config, runtime, config.hidden_size, mesh, rngs)
    self.attn = Attention(config, runtime, mesh, rngs)
    self.post_attention_norm = RMSNorm(config, runtime, config.hidden_size, mesh, rngs)
    if config.is_sparse(layer):
      self.mlp = MoE(config, runtime, mesh, rngs)
    else:
      self.mlp = DenseMLP(config, runtime, config.intermediate_size, mesh, rngs)

  def __call__(self, x_BSD, positions_BS, segment_ids_BS=None):
    policy = self.runtime.remat_of(self.layer)
    if policy == "offload":
      return offloaded(_layer_forward, self, x_BSD, positions_BS, segment_ids_BS)
    if policy in ("layer", "all_but_attention"):
      return nnx.remat(_layer_forward, policy=remat_policy(policy))(self, x_BSD, positions_BS, segment_ids_BS)
    return self.forward(x_BSD, positions_BS, segment_ids_BS, remat_attention=policy == "attention")

  def forward(self, x_BSD, positions_BS, segment_ids_BS=None, remat_attention=False):
    attend = nnx.remat(_attend) if remat_attention else _attend
    h = x_BSD + attend(self.attn, self.input_norm(x_BSD), positions_BS, segment_ids_BS)
    out = self.mlp(self.post_attention_norm(h))
    if isinstance(self.mlp, MoE):
      out, aux = out
      return h + out, [aux]
    return h + out, []


def _layer_forward(layer, x_BSD, positions_BS, segment_ids_BS):
  return layer.forward(x_BSD, positions_BS, segment_ids_BS)


def _attend(attn, x_BSD, positions_BS, segment_ids_BS):
  return attn(x_BSD, positions_BS, segment_ids_BS)


STACKED = "stacked"  # LayerStack's attribute: parameters below it carry a leading layer axis


class LayerStack(nnx.Module):
  """`count` repeats of one unit (a decoder layer, or a block of layers of different kinds) as one unit whose
  parameters are stacked on a leading axis (sharding specs gain a leading None), run by `lax.scan`: the unit is
  traced and compiled once. `make_unit(rngs)` builds one; it returns (x, [aux of each of its MoE layers])."""

  def __init__(self, count, make_unit, rngs):
    self.count = count

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def build(rngs):
      return make_unit(rngs)

    setattr(self, STACKED, build(rngs))

  def __call__(self, x_BSD, positions_BS, segment_ids_BS=None):
    graphdef, params = nnx.split(getattr(self, STACKED))

    def one_layer(x, layer_params):
      return nnx.merge(graphdef, layer_params)(x, positions_BS, segment_ids_BS)

    x_BSD, auxes = jax.lax.scan(one_layer, x_BSD, params)
    return x_BSD, [jax.tree.map(lambda a: a[i], aux) for i in range(self.count) for aux in auxes]


def per_layer_ndim(path, param):
  """A parameter's rank in one layer: its rank, less the layer axis when it lives in a `LayerStack` (`path`: a
  key path into the model's parameters, e.g. from `jax.tree_util.tree_map_with_path`)."""
  return param.ndim - any(getattr(key, "key", None) == STACKED for key in path)


class Qwen3MoE(Layer):
  """The language model: `logits_BSV = model(tokens_BS)` (float32 logits), with or without `jax.set_mesh` (any
  mesh of its devices), on tokens sharded any way. The logits (and the other methods' outputs) are sharded B over
  ('data', 'expert') (context parallelism: B over 'data', S over 'expert'), V whole: on the context's mesh (those
  of these axes it has) under one, else on `self.mesh` (`model_mesh(mesh)`); see `models.sharding.on_model_mesh`.
  """

  def __init__(self, config: Qwen3MoEConfig, runtime: RuntimeConfig = RuntimeConfig(), *, mesh, rngs):
    super().__init__(config, runtime)
    mesh = model_mesh(mesh)
    param = functools.partial(make_param, config, runtime, mesh, rngs)
    self.mesh = mesh
    self.embed_VD = param("embed_VD", (config.vocab_size, config.hidden_size))
    self.layers = nnx.List(self.layer_stacks(mesh, rngs))
    self.norm = self.final_norm(mesh, rngs)
    if not config.tie_word_embeddings:
      self.lm_head_DV = param("lm_head_DV", (config.hidden_size, config.vocab_size))

  def layer_stacks(self, mesh, rngs):
    """The decoder's layers, each stretch of one kind (`layer_groups`) one `LayerStack` or a lone layer."""
    config, runtime = self.config, self.runtime
    make = lambda first: functools.partial(DecoderLayer, config, runtime, first, mesh)
    return [LayerStack(count, make(first), rngs) if runtime.scan_layers else make(first)(rngs)
            for first, count, _ in layer_groups(config, runtime)]

  def final_norm(self, mesh, rngs):
    return RMSNorm(self.config, self.runtime, self.config.hidden_size, mesh, rngs)

  def __call__(self, tokens_BS, segment_ids_BS=None, positions_BS=None):
    return self.logits_and_aux(tokens_BS, segment_ids_BS, positions_BS)[0]

  @runs_on_model_mesh
  def logits_and_aux(self, tokens_BS, segment_ids_BS=None, positions_BS=None):
    """(float32 logits [B, S, V], router losses: see `hidden_and_aux`, which says what the arguments are)."""
    with _matmul_precision(self.runtime):
      x_BSD, aux = self.hidden_and_aux(tokens_BS, segment_ids_BS, positions_BS)
      x_BSD = self._in_sequence_order(x_BSD)
      with jax.named_scope("lm_head"):
        return jnp.dot(x_BSD, self.head_DV(), preferred_element_type=jnp.float32), aux

  @runs_on_model_mesh
  def cross_entropy_and_aux(self, tokens_BS, labels_BS, segment_ids_BS=None, positions_BS=None):
    """(float32 cross-entropy per token [B, S] of predicting labels_BS, router losses: see `hidden_and_aux`).
    Chunked (`models.loss`, `loss_chunk_tokens` per device) so the full logits never exist; 0: from full logits."""
    with _matmul_precision(self.runtime):
      x_BSD, aux = self.hidden_and_aux(tokens_BS, segment_ids_BS, positions_BS)
      with jax.named_scope("lm_head"):
        ce_BS = self._head_loss(chunked_cross_entropy, optax.softmax_cross_entropy_with_integer_labels, x_BSD,
                                self._in_held_order(labels_BS))
      return self._in_sequence_order(ce_BS), aux

  @runs_on_model_mesh
  def mean_cross_entropy_and_aux(self, tokens_BS, labels_BS, segment_ids_BS=None, positions_BS=None,
                                 weights_BS=None):
    """(the mean of `cross_entropy_and_aux`'s cross-entropy, a float32 scalar, router losses). Chunked, its
    gradient is computed in the forward pass (`models.loss.mean_cross_entropy`): for a loss that ends in it.
    `weights_BS` (0 or 1 per target; None: all 1): the mean is over the counted targets."""
    with _matmul_precision(self.runtime):
      x_BSD, aux = self.hidden_and_aux(tokens_BS, segment_ids_BS, positions_BS)
      weights = None if weights_BS is None else self._in_held_order(weights_BS.astype(jnp.float32))
      with jax.named_scope("lm_head"):
        return self._head_loss(mean_cross_entropy, plain_mean_cross_entropy, x_BSD,
                               self._in_held_order(labels_BS), weights_BS=weights), aux

  def _head_loss(self, chunked, plain, x_BSD, labels_BS, **weights):
    chunk_tokens = self.runtime.loss_chunk()
    if not chunk_tokens:
      return plain(jnp.dot(x_BSD, self.head_DV(), preferred_element_type=jnp.float32), labels_BS, **weights)
    return chunked(x_BSD, self.head_DV(), labels_BS, mesh=self.mesh, token_axes=batch_axes(self.runtime),
                   sequence_axis=sequence_axis(self.runtime), vocab_axis=TENSOR, chunk_tokens=chunk_tokens,
                   **weights)

  def head_DV(self):
    """The LM head in the compute dtype (the embedding's transpose when tied)."""
    return self.cast(self.embed_VD).T if self.config.tie_word_embeddings else self.cast(self.lm_head_DV)

  @runs_on_model_mesh
  def hidden_and_aux(self, tokens_BS, segment_ids_BS=None, positions_BS=None):
    """(final normed hidden states [B, S, D] in the order the model holds the sequence (`_in_held_order`), router
    losses and statistics of the MoE layers: `models.router_state.router_losses`).

    `segment_ids_BS`: packed documents (int, a change of id starts one: `models.inputs`); a token attends only to its
    own document's (`models.attention.causal`). `positions_BS`: RoPE's positions; None: each token's place in its
    document (`models.inputs`), or in the row without segment ids."""
    segment_ids_BS, positions_BS = checked_inputs(tokens_BS, segment_ids_BS, positions_BS, self.config.vocab_size)
    check_rows(tokens_BS.shape[0], self.mesh, batch_axes(self.runtime))
    x = embed(self.cast(self.embed_VD), self._placed(tokens_BS))
    if positions_BS is None:
      b, s = tokens_BS.shape
      positions_BS = self._placed(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    else:
      positions_BS = self._placed(positions_BS)
    segment_ids_BS = None if segment_ids_BS is None else self._placed(segment_ids_BS)
    auxes = []
    for layers in self.layers:
      x, layer_auxes = layers(x, positions_BS, segment_ids_BS)
      auxes += layer_auxes
    return self.norm(x), router_losses(auxes)

  def _ring(self):
    return self.mesh.shape[EXPERT]

  def _placed(self, x_BS, shape=None):
    """x in the held order (broadcast to `shape`), where the model's activations live."""
    x_BS = self._in_held_order(x_BS)
    held = NamedSharding(self.mesh, activation_spec(self.runtime))
    return jax.lax.with_sharding_constraint(x_BS if shape is None else jnp.broadcast_to(x_BS, shape), held)

  def _in_held_order(self, x_BS):
    """x in the order the model holds a sequence: its own, or under context parallelism each device's two chunks
    (`models.attention.context_parallel`)."""
    if not splits_sequences(self.runtime, self.mesh):
      return x_BS
    check_sequence(x_BS.shape[1], self._ring())
    return to_held_order(x_BS, self._ring())

  def _in_sequence_order(self, x_BS):
    return to_sequence_order(x_BS, self._ring()) if splits_sequences(self.runtime, self.mesh) else x_BS


def _matmul_precision(runtime):
  """float32 compute at float32 precision: on GPUs XLA's default for a float32 matmul is TF32 (a 10-bit mantissa),
  which made two compiles of one float32 step (with and without offload) differ by 6e-4 in a gradient. The MoE
  block's own matmuls already ask for it (`grouped_matmul.matmul_precision`)."""
  if jnp.dtype(runtime.dtype) == jnp.float32:
    return jax.default_matmul_precision("highest")
  return contextlib.nullcontext()


def abstract(config, mesh, seed=0, *, runtime=RuntimeConfig()):
  """(graphdef, state) of the model with every parameter a ShapeDtypeStruct carrying its sharding: nothing is made."""
  return nnx.split(nnx.eval_shape(lambda: Qwen3MoE(config, runtime, mesh=mesh, rngs=nnx.Rngs(seed))))


def create_sharded(config, mesh, seed=0, *, runtime=RuntimeConfig()):
  """Builds the model inside jit so each parameter is created directly with its sharding (no host copy)."""
  return nnx.jit(lambda: Qwen3MoE(config, runtime, mesh=mesh, rngs=nnx.Rngs(seed)))()
