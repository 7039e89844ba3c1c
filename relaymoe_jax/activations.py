"""The experts' activations, by name, and their derivatives.

Gated (three matrices: the input projection is x·[gate | up] in `gate_up`'s layout, U = 2F):
  swiglu  silu(x·gate) · (x·up)                      Qwen, Mixtral, DeepSeek
  geglu   gelu(x·gate) · (x·up), gelu's tanh form    Gemma
Plain (two matrices: the input projection is x·W_in, U = F; no up matrix):
  gelu    gelu(x·W_in), the tanh form (jax.nn.gelu's default)
  relu    relu(x·W_in)                               Switch, GShard
The expert's output is act · W_down. No communication. Shape letters: see relaymoe_jax.
"""

import functools

import jax

from relaymoe_jax import gate_up
from relaymoe_jax.errors import UserError

_gelu_tanh = functools.partial(jax.nn.gelu, approximate=True)
GATED = {"swiglu": jax.nn.silu, "geglu": _gelu_tanh}  # the function on the gate
PLAIN = {"gelu": _gelu_tanh, "relu": jax.nn.relu}
ACTIVATIONS = (*GATED, *PLAIN)


def check(activation):
  """Raises UserError naming an unknown activation."""
  if activation not in ACTIVATIONS:
    raise UserError(f"unknown activation {activation!r}; known: {list(ACTIVATIONS)}")
  return activation


def is_gated(activation):
  return check(activation) in GATED


def elementwise(activation):
  """The elementwise function: on the gate (gated experts) or on x·W_in (plain)."""
  return {**GATED, **PLAIN}[check(activation)]


def apply(h_RU, activation, dtype):
  """act_RF in `dtype` from the input projection h_RU (gated: [gate | up])."""
  if not is_gated(activation):
    return elementwise(activation)(h_RU).astype(dtype)
  gate_RF, up_RF = gate_up.split(h_RU)
  return (elementwise(activation)(gate_RF) * up_RF).astype(dtype)


def with_derivative(h_RU, activation):
  """(act_RF, d_input): the activation of the input projection h_RU and a function d(act)_RF ↦ d(h)_RU, all in
  h's dtype (a backward passes float32).

  SwiGLU's derivative is by hand, one join: autodiff's transpose of the gate/up split is two padded halves added,
  and XLA computed both halves (sigmoid included) for every element of the result (docs/ring.md). The others take
  the elementwise function's own vjp, joined the same way for GeGLU."""
  if not is_gated(activation):
    act_RF, act_vjp = jax.vjp(elementwise(activation), h_RU)
    return act_RF, lambda d_act_RF: act_vjp(d_act_RF)[0]
  gate_RF, up_RF = gate_up.split(h_RU)
  if activation == "swiglu":
    sigmoid_RF = jax.nn.sigmoid(gate_RF)
    silu_RF = gate_RF * sigmoid_RF
    return silu_RF * up_RF, lambda d_act_RF: gate_up.join(
        d_act_RF * up_RF * sigmoid_RF * (1 + gate_RF * (1 - sigmoid_RF)), d_act_RF * silu_RF)
  on_gate_RF, gate_vjp = jax.vjp(elementwise(activation), gate_RF)
  return on_gate_RF * up_RF, lambda d_act_RF: gate_up.join(gate_vjp(d_act_RF * up_RF)[0], d_act_RF * on_gate_RF)
