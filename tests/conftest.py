"""8 emulated CPU devices, set before JAX initialises, and shared helpers for the tests.

On a GPU machine, `pytest` runs on the real GPUs (cases whose mesh needs more devices than exist are skipped, with
the reason); `JAX_PLATFORMS=cpu pytest` runs everything on 8 emulated CPU devices, as CI does.
"""

import functools
import os
import struct

import chex

# XLA:CPU runs every emulated device's share of a program on one pool of max(cores, devices) threads. With two
# programs with collectives in flight, each can hold threads that wait for participants left without one: a
# deadlock that XLA ends after 40 s by aborting the process (2-core machines hit it, CI among them). XLA sizes the
# pool from NPROC where it is set: room for every program that may be in flight (32 per device).
os.environ.setdefault("NPROC", "256")
# pytest-xdist's workers share one GPU: each taking JAX's default 75% of its memory up front leaves the second none.
if "PYTEST_XDIST_WORKER" in os.environ:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
chex.set_n_cpu_devices(8)  # before any JAX operation: it rewrites XLA_FLAGS' host device count, keeping other flags

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import extend  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from tensorboardX.proto import event_pb2  # noqa: E402

import relaymoe_jax.testing as rmt  # noqa: E402
from train.config import MeshConfig  # noqa: E402
from train.mesh import build_mesh  # noqa: E402

# No persistent compilation cache in the test process, even after a test ran the trainer's CLI in-process (which
# turns it on): JAX gives every ppermute channel id 1, and a program XLA:CPU read back from that cache ran two of its
# collective-permutes at once, so one rendezvous got 5 of 4 participants and XLA aborted the process ("Check failed:
# id < num_threads"; reproduced with the oracle test, where CI's runs aborted). CLI tests in a subprocess still use it.
jax.config.update("jax_enable_compilation_cache", False)



@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path_factory, monkeypatch):
  """Each test runs in an empty directory of its own: nothing a test writes by default (`runs/<config>`) lands in
  the checkout, and nothing left there (a `relaymoe-train` run of the README's first command) changes a test."""
  monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


random_layer = rmt.random_moe_inputs
relative_error = rmt.relative_error


def tensorboard_events(directory):
  """Every TensorBoard event written under `directory` (TFRecord: length, CRC, data, CRC)."""
  for path in directory.rglob("events*"):
    data = path.read_bytes()
    while data:
      (length,) = struct.unpack("<Q", data[:8])
      yield event_pb2.Event.FromString(data[12:12 + length])
      data = data[12 + length + 4:]


def tensorboard_scalars(directory):
  """{(step, tag): value} of every scalar written under `directory`."""
  return {(e.step, v.tag): v.simple_value for e in tensorboard_events(directory) for v in e.summary.value}


@functools.cache
def trainer_mesh():
  """The trainer's mesh of `--config cpu`: 2 data × 4 expert."""
  return build_mesh(MeshConfig(data=2, expert=4, tensor=1))


def requires_devices(count):
  if len(jax.devices()) < count:
    pytest.skip(f"needs {count} devices, {jax.default_backend()} has {len(jax.devices())}")


def mesh_of(shape, names, explicit=False):
  """A mesh over the first prod(shape) devices: Explicit axes as `jax.make_mesh` gives them, or Auto."""
  size = int(np.prod(shape))
  requires_devices(size)
  devices = np.array(jax.devices()[:size])
  if explicit:
    return jax.make_mesh(shape, names, devices=devices)
  return jax.sharding.Mesh(devices.reshape(shape), names)


CONTEXT_MESHES = {  # meshes a caller may hold under `jax.set_mesh`: (shape, axis names, Explicit axes)
    "explicit": ((2, 4), ("data", "expert"), True),
    "expert-only-explicit": ((8,), ("expert",), True),
    "expert-only-auto": ((8,), ("expert",), False),
    "auto": ((2, 4), ("data", "expert"), False),
}


def place_tokens(tokens, mesh, placement):
  """Tokens [B, S] as a caller may pass them on `mesh`: unsharded (NumPy), rows over every axis of the mesh, or
  the sequence over 'expert'."""
  specs = {"rows": P(mesh.axis_names), "sequence": P(None, "expert")}
  return tokens if placement == "unsharded" else jax.device_put(tokens, NamedSharding(mesh, specs[placement]))


def assert_close(actual, expected, rtol, name=""):
  """`relaymoe_jax.testing.assert_trees_close` (max |a − b| / max |b| per array, shapes, finiteness), named."""
  try:
    rmt.assert_trees_close(actual, expected, rtol)
  except AssertionError as e:
    raise AssertionError(f"{name}: {e}") from None


def broadcast_constants(jaxpr, shape_filter):
  """The equations of `jaxpr` (and of the jaxprs inside them) that broadcast a literal to a shape `shape_filter`
  accepts: buffers XLA makes from a constant, where it may make them all at once, early."""
  return [e for e in jaxpr_equations(jaxpr) if e.primitive.name == "broadcast_in_dim"
          and isinstance(e.invars[0], extend.core.Literal) and shape_filter(e.outvars[0].aval.shape)]


def jaxpr_equations(jaxpr):
  """The equations of `jaxpr` and, depth first, of the jaxprs in their parameters."""
  for e in jaxpr.eqns:
    yield e
    for sub in extend.core.jaxprs_in_params(e.params):
      yield from jaxpr_equations(sub)
