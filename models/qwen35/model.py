"""Qwen3.5-MoE in Flax NNX, matching Hugging Face's `Qwen3_5MoeForCausalLM` so real checkpoints can be imported.

Decoder layer: h = x + Mixer(RMSNorm(x)); out = h + MoE(RMSNorm(h)), where Mixer is a Gated DeltaNet layer
(`linear_attention`) or gated attention (`full_attention`) and every MoE has a sigmoid-gated shared expert. All
RMSNorms but the DeltaNet's output norm are zero-centred (scale 1 + w). Gated attention: q_proj gives per head a
query and a gate, q and k are normed per head, RoPE turns the first `rotary_dim` dims, GQA causal attention (the
kernels of `models.attention`; on long rows its gated output projection in spans, `models.spans`), the output
times sigmoid(gate). Gated DeltaNet: `models.qwen35.deltanet`. The outer model (embedding, LM head, losses,
sharding) is `models.qwen3.model.Qwen3MoE`'s; the layers are stacked as repeats of the layer-type pattern (3
DeltaNet + 1 attention in the released model), one `lax.scan` over the repeats. Shape letters: see `relaymoe_jax`.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen3 import model as qwen3
from models.qwen3.layer import Layer
from models.qwen3.mlp import MoE
from models.qwen35.config import FULL
from models.qwen35.deltanet import GatedDeltaNet
from models.runtime import RuntimeConfig
from models.sharding import make_param
from models.spans import Spans


def zero_centred_rms_norm(x, weight, eps):
  """Qwen3.5's RMSNorm: normalise and scale by (1 + weight), all in float32, then cast back."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(Layer):

  def __init__(self, config, runtime, dim, mesh, rngs, role="norm_D"):
    super().__init__(config, runtime)
    self.weight = make_param(config, runtime, mesh, rngs, role, (dim,), "zeros")

  def __call__(self, x):
    with jax.named_scope("norm"):
      return zero_centred_rms_norm(x, self.weight[...], self.config.rms_norm_eps)


class GatedAttention(Layer):
  """Full attention with a sigmoid output gate and partial RoPE (`Qwen3_5MoeAttention`)."""

  def __init__(self, config, runtime, mesh, rngs):
    super().__init__(config, runtime)
    param = functools.partial(make_param, config, runtime, mesh, rngs)
    c = config
    d, hq, hkv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    self.mesh = mesh
    # Hugging Face's q_proj: per head, head_dim query columns then head_dim gate columns.
    self.q_gate_DH = param("q_DH", (d, 2 * hq))
    self.k_DG, self.v_DG = param("kv_DG", (d, hkv)), param("kv_DG", (d, hkv))
    self.o_HD = param("o_HD", (hq, d))
    self.q_norm = RMSNorm(c, runtime, c.head_dim, mesh, rngs, "head_norm")
    self.k_norm = RMSNorm(c, runtime, c.head_dim, mesh, rngs, "head_norm")

  def __call__(self, x_BSD, positions_BS, segment_ids_BS=None):
    c = self.config
    b, s, d = x_BSD.shape
    spans = Spans.of_run(s, self.runtime, self.mesh)
    # q and the gate as two projections: no [positions, 2 × heads × head_dim] tensor (nor its gradient) at once.
    q_gate_DQ2Z = self.cast(self.q_gate_DH).reshape(d, c.num_attention_heads, 2, c.head_dim)
    with jax.named_scope("projection"):
      q = (x_BSD @ q_gate_DQ2Z[:, :, 0].reshape(d, -1)).reshape(b, s, c.num_attention_heads, c.head_dim)
      k = (x_BSD @ self.cast(self.k_DG)).reshape(b, s, c.num_key_value_heads, c.head_dim)
      v = (x_BSD @ self.cast(self.v_DG)).reshape(b, s, c.num_key_value_heads, c.head_dim)
    q, k = self.q_norm(q), self.k_norm(k)
    with jax.named_scope("rope"):
      q, k = partial_rope(q, positions_BS, c), partial_rope(k, positions_BS, c)
    out_BSQZ = qwen3.attend_heads(q, k, v, c.head_dim ** -0.5, self.runtime, self.mesh, segment_ids_BS)
    w_gate, w_out = (spans.whole(w, self.mesh) for w in (q_gate_DQ2Z[:, :, 1].reshape(d, -1), self.cast(self.o_HD)))
    return spans.map(lambda x, out: gated_output(x, out, w_gate, w_out), x_BSD, out_BSQZ)


def gated_output(x, out, w_gate, w_out):
  """The attention's output projection of `out` [..., heads, head_dim] times sigmoid(x @ w_gate): a span at a time on
  long rows (`models.spans`), so the gate exists a span at a time."""
  with jax.named_scope("projection"):
    gate = (x @ w_gate).astype(jnp.float32)
    out = out.reshape(*out.shape[:-2], -1) * jax.nn.sigmoid(gate).astype(out.dtype)
    return out @ w_out


def partial_rope(x_BSQZ, positions_BS, config):
  """RoPE (half-split) over the first `rotary_dim` dims of each head; the rest pass through."""
  rotary = config.rotary_dim
  turned = qwen3.rope(x_BSQZ[..., :rotary], positions_BS, config.rope_theta)
  return jnp.concatenate([turned, x_BSQZ[..., rotary:]], axis=-1)


class DecoderLayer(qwen3.DecoderLayer):
  """A Qwen3.5 layer: its mixer (`attn`, gated attention or Gated DeltaNet by `layer_types`), then the MoE."""

  def __init__(self, config, runtime, layer, mesh, rngs):  # Qwen3's __init__ would build Qwen3's parts
    Layer.__init__(self, config, runtime)
    self.layer = layer
    self.input_norm = RMSNorm(config, runtime, config.hidden_size, mesh, rngs)
    mixer = GatedAttention if config.layer_types[layer] == FULL else GatedDeltaNet
    self.attn = mixer(config, runtime, mesh, rngs)
    self.post_attention_norm = RMSNorm(config, runtime, config.hidden_size, mesh, rngs)
    self.mlp = MoE(config, runtime, mesh, rngs)


class LayerBlock(nnx.Module):
  """Consecutive layers of different kinds run one after another: the unit a `LayerStack` repeats."""

  def __init__(self, config, runtime, first, period, mesh, rngs):
    self.layers = nnx.List([DecoderLayer(config, runtime, first + j, mesh, rngs) for j in range(period)])

  def __call__(self, x_BSD, positions_BS, segment_ids_BS=None):
    auxes = []
    for layer in self.layers:
      x_BSD, aux = layer(x_BSD, positions_BS, segment_ids_BS)
      auxes += aux
    return x_BSD, auxes


class Qwen35MoE(qwen3.Qwen3MoE):
  """The Qwen3.5 language model: `Qwen3MoE`'s interface (`logits_BSV = model(tokens_BS)`, the losses, segment ids
  and positions) over Qwen3.5's hybrid layers."""

  def layer_stacks(self, mesh, rngs):
    config, runtime = self.config, self.runtime

    def unit(group):
      if group.period == 1:
        return functools.partial(DecoderLayer, config, runtime, group.first, mesh)
      return functools.partial(LayerBlock, config, runtime, group.first, group.period, mesh)

    return [qwen3.LayerStack(g.count, unit(g), rngs) if runtime.scan_layers else unit(g)(rngs)
            for g in config.layer_groups(runtime)]

  def final_norm(self, mesh, rngs):
    return RMSNorm(self.config, self.runtime, self.config.hidden_size, mesh, rngs)


def abstract(config, mesh, seed=0, *, runtime=RuntimeConfig()):
  """(graphdef, state) of the model with every parameter a ShapeDtypeStruct carrying its sharding: nothing is made."""
  return nnx.split(nnx.eval_shape(lambda: Qwen35MoE(config, runtime, mesh=mesh, rngs=nnx.Rngs(seed))))


def create_sharded(config, mesh, seed=0, *, runtime=RuntimeConfig()):
  """Builds the model inside jit so each parameter is created directly with its sharding (no host copy)."""
  return nnx.jit(lambda: Qwen35MoE(config, runtime, mesh=mesh, rngs=nnx.Rngs(seed)))()
