"""The ring schedules both dispatchers are built from (inside `shard_map`, along one mesh axis of size N).

What moves between devices:
  ring_pass            the payload circulates r → r + 1, so at hop h device r holds the payload that started on
                       r − h; each hop computes on it into local state. N − 1 sends of the payload.
  ring_relay           the payload circulates r → r + 1, and each hop's partial result for the payload's partition
                       is relayed: the partition's accumulator follows one hop behind its payload, merged into the
                       same `ppermute`, and a last send brings it home. N − 1 payload sends, N accumulator sends;
                       the accumulator of a hop is sent only after the hop's own partial is added, while the
                       payload for the next hop is already in flight.
  ring_relay_homeward  the same relay run r → r − 1 from the payload `ring_pass` ends with (device r + 1's), so
                       that its last hop is on the device's own payload and its accumulator is merged in place:
                       N − 2 payload sends, N − 1 accumulator sends, none after the last hop.
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


def ring_perm(n, shift=1):
  """ppermute pairs sending device r to r + shift (mod n)."""
  return [(r, (r + shift) % n) for r in range(n)]


def partition_at_hop(r, h, n):
  """Whose payload device r holds at hop h: payloads move r → r+1, so the one that started on r − h."""
  return (r - h) % n


def _partition_homeward(r, h, n):
  """Whose payload device r holds at hop h of `ring_relay_homeward`: payloads move r → r − 1 from device r + 1's,
  so the one that started on r + 1 + h."""
  return (r + 1 + h) % n


def ring_pass(compute, state, payload, *, axis, n):
  """state = compute(state, partition, payload) for hops h = 0 … N−1 (partition (r − h) mod N), the payload sent
  on before each hop's compute. Returns (state, the payload of the last hop: device r + 1's)."""
  r = jax.lax.axis_index(axis)

  def body(h, carry):
    payload, state = carry
    incoming = jax.lax.ppermute(payload, axis, ring_perm(n))  # prefetch for hop h + 1
    return incoming, compute(state, partition_at_hop(r, h, n), payload)

  payload, state = jax.lax.fori_loop(0, n - 1, body, (payload, state))
  return compute(state, partition_at_hop(r, n - 1, n), payload), payload


class _Relay(NamedTuple):
  """One relay's static parts: what a hop computes, and the direction payloads and accumulators move in."""

  compute: Callable  # (state, partition, payload) -> (state, partial)
  to_relay: Callable  # float32 partial -> the accumulator's travelling form
  axis: str
  perm: list  # ppermute pairs of every send
  partition: Callable  # hop -> the partition of the payload held at that hop


def _hop(relay, h, state, payload, acc_in):
  """Hop h: this hop's partial for the payload's partition, added in float32 to the accumulator that arrived."""
  state, partial = relay.compute(state, relay.partition(h), payload)
  return state, relay.to_relay(jax.tree.map(lambda a, p: a.astype(jnp.float32) + p, acc_in, partial))


def _only_hop(relay, state, payload):
  """A ring of one: one hop, nothing sent."""
  state, partial = relay.compute(state, relay.partition(0), payload)
  return state, relay.to_relay(partial)


def _first_hop(relay, state, payload, incoming):
  """Hop 0, no accumulator to merge; `incoming` is the payload of hop 1 (its send already started, or at hand).
  Returns the carry (payload of hop 1, accumulator, state)."""
  state, partial = relay.compute(state, relay.partition(0), payload)
  # The payload must have arrived before the accumulator's send starts. Left free, XLA scheduled this prefetch
  # after hop 0's compute, next to that send, and hop 1 waited for it (2×H200 trace, docs/overlap.md).
  incoming, partial = jax.lax.optimization_barrier((incoming, partial))
  return incoming, relay.to_relay(partial), state


def _payload_hops(relay, carry, payload_sends):
  """Hops 1 … payload_sends − 1, each sending (payload of the next hop, accumulator) in one `ppermute` before its
  compute. Returns the carry of hop `payload_sends`, whose payload has arrived."""

  def body(h, carry):
    payload, acc, state = carry
    incoming, acc_in = jax.lax.ppermute((payload, acc), relay.axis, relay.perm)
    state, acc = _hop(relay, h, state, payload, acc_in)
    return incoming, acc, state

  if payload_sends > 1:  # (not traced when empty: each trace of `compute` is compiled again, grouped kernels and all)
    carry = jax.lax.fori_loop(1, payload_sends, body, carry)
  return carry


def _accumulator_hop(relay, h, state, payload, acc):
  """Hop h when no payload moves: the accumulator alone is sent, then merged with this hop's partial."""
  acc_in = jax.lax.ppermute(acc, relay.axis, relay.perm)
  return _hop(relay, h, state, payload, acc_in)


def ring_relay(compute, state, payload, *, axis, n, to_relay):
  """Runs (state, partial) = compute(state, partition, payload) at every hop and relays the partials home.

  `payload` is this device's own and travels r → r + 1 (partition (r − h) mod N at hop h); the last hop's
  accumulator is sent home: N − 1 payload sends, N accumulator sends.

  Args:
    compute: returns the new local state and this hop's partial for the payload's partition (float32 or the
      accumulator's travelling dtype; merged with the arriving accumulator in float32).
    to_relay: casts a float32 partial to the accumulator's travelling form (e.g. the weights' dtype).

  Returns:
    (state, accumulator of this device's own partition, summed over all N devices).
  """
  r = jax.lax.axis_index(axis)
  relay = _Relay(compute, to_relay, axis, ring_perm(n), functools.partial(partition_at_hop, r, n=n))
  if n == 1:
    return _only_hop(relay, state, payload)
  carry = _first_hop(relay, state, payload, jax.lax.ppermute(payload, axis, relay.perm))
  payload, acc, state = _payload_hops(relay, carry, n - 1)
  state, acc = _accumulator_hop(relay, n - 1, state, payload, acc)
  return state, jax.lax.ppermute(acc, axis, relay.perm)  # home


def ring_relay_homeward(compute, state, payload, *, home, axis, n, to_relay):
  """`ring_relay` run the other way so that it ends at home: no send after its last hop.

  `payload` is device r + 1's (what `ring_pass` holds after its last hop) and travels r → r − 1 (partition
  (r + 1 + h) mod N at hop h), so the last hop is on `home` (this device's own payload, already here) and its
  accumulator is merged in place: N − 2 payload sends, N − 1 accumulator sends. `compute`, `to_relay` and the
  result are as for `ring_relay`.
  """
  r = jax.lax.axis_index(axis)
  relay = _Relay(compute, to_relay, axis, ring_perm(n, -1), functools.partial(_partition_homeward, r, n=n))
  if n == 1:
    return _only_hop(relay, state, payload)
  # Payload sends for hops 1 … N−2; the last hop's payload, `home`, is already here.
  incoming = jax.lax.ppermute(payload, axis, relay.perm) if n > 2 else home
  payload, acc, state = _payload_hops(relay, _first_hop(relay, state, payload, incoming), n - 2)
  if n > 2:  # hop N−2: only the accumulator moves; the next payload is `home`
    state, acc = _accumulator_hop(relay, n - 2, state, payload, acc)
    payload = home
  return _accumulator_hop(relay, n - 1, state, payload, acc)  # hop N−1, on `home`
