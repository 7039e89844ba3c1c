"""`Layer`: what every layer of the model families here shares."""

from flax import nnx


class Layer(nnx.Module):
  """Creates parameters annotated with their sharding role, and casts them to the compute dtype."""

  def __init__(self, config, runtime):
    self.config, self.runtime = config, runtime

  def cast(self, p):
    return p[...].astype(self.runtime.dtype)
