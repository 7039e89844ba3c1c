"""Context parallelism for Gated DeltaNet layers: one sequence spread over the mesh's 'expert' axis, by state passing.

Layout: as `models.attention.context_parallel` (device i of the N on 'expert' holds sequence chunks i and 2N−1−i of
C tokens each, "held order"; rows over 'data'). Each piece is one `jax.shard_map`:

- `preceding_rows`: the depthwise causal conv of window W needs the W − 1 tokens before each chunk. Every
  device all-gathers the last W − 1 rows (and segment ids) of its two chunks over 'expert' (2N × (W − 1) rows of
  the layer's input, tiny) and picks its chunks' predecessors in sequence order (zeros before chunk 0).
- `context_gated_delta_rule`: the delta rule's state is what crosses chunk boundaries. Each device computes the
  affine state map (M, b) of each of its chunks (`chunk_transition`) and all-gathers them over 'expert':
  2N × (K×K + K×V) float32 per head per row (4 MiB a chunk for 32 heads of 128 × 128: 32 MiB a row over 4
  devices). It reorders them into sequence order, prefix-combines them (`combine_transitions`; a document starting
  exactly at a chunk edge resets the state) and reruns the chunked rule on each of its chunks from that chunk's
  initial state. The chunks' first and last segment ids are gathered with the maps (4 integers per row per device).
- `entering_states`: the same gather and prefix-combine from maps the caller computed (the DeltaNet layer in spans
  carries each chunk's map through a scan over its spans, `models.qwen35.deltanet`).

Backward: autodiff through the all-gathers (their transpose is a reduce-scatter: each device gets the gradients
of its own halo rows and maps summed over the devices that read them).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.attention.context_parallel import check_sequence
from models.attention.gated_delta import SPAN_TOKENS, chunk_transition, combine_transitions, gated_delta_rule
from relaymoe_jax.axes import DATA, EXPERT
from relaymoe_jax.errors import UserError


# A Pallas call's outputs do not say how they vary over the mesh, which shard_map's check_vma requires (named by an
# argument that differs between JAX versions): shard_maps around one do without the check. Every input there is
# split, none replicated, so no gradient needs the psum the check would place.
def _sharded(local, mesh, arrays, optional, check_vma=True):
  """shard_map of `local` over rows ('data') and the held sequence ('expert'); `optional` arrays (None or [B, S])
  go after `arrays` ([B, S, ...]); the result is laid out as the first array."""
  spec = P(DATA, EXPERT)
  specs = tuple(spec for _ in arrays) + tuple(None if x is None else spec for x in optional)
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=check_vma)(*arrays, *optional)


def _local_chunks(x_BS):
  """A device's [b, 2C, ...] rows → [2, b, C, ...]: its early chunk, then its late one."""
  return jnp.moveaxis(x_BS.reshape(x_BS.shape[0], 2, x_BS.shape[1] // 2, *x_BS.shape[2:]), 1, 0)


def _from_local_chunks(x_2BC):
  return jnp.moveaxis(x_2BC, 0, 1).reshape(x_2BC.shape[1], -1, *x_2BC.shape[3:])


def _gathered_in_sequence_order(x_2B):
  """[2, ...] of each device (its early and late chunk) → [2N, ...] of every chunk in sequence order: all_gather over
  'expert' gives [N, 2, ...]; chunk m < N is device m's early one, chunk m ≥ N device 2N−1−m's late one."""
  all_N2B = jax.lax.all_gather(x_2B, EXPERT, axis=0)
  return jnp.concatenate([all_N2B[:, 0], all_N2B[::-1, 1]], axis=0)


def _own_chunks(x_PB, ring):
  """This device's two chunks' entries ([2, ...]) of a [2N, ...] array in sequence order."""
  i = jax.lax.axis_index(EXPERT)
  pick = lambda m: jax.lax.dynamic_index_in_dim(x_PB, m, axis=0, keepdims=False)
  return jnp.stack([pick(i), pick(2 * ring - 1 - i)])


def _halo(x_2BC, halo, ring):
  """The `halo` rows before each of this device's two chunks, [2, b, halo, ...]: zeros before chunk 0."""
  tails_PB = _gathered_in_sequence_order(x_2BC[:, :, -halo:])
  before_PB = jnp.concatenate([jnp.zeros_like(tails_PB[:1]), tails_PB[:-1]], axis=0)
  return _own_chunks(before_PB, ring)


def preceding_rows(x_BSX, rows, *, mesh):
  """The `rows` positions before each chunk of sequences in held order, split over 'expert' (a causal conv's
  history, e.g. the `rows` = W − 1 a conv of window W reads before a chunk's first position): [B, 2N × rows, ...],
  laid out as x, device i's early chunk's rows then its late chunk's; zeros before the sequence's first chunk.

  Moves: all_gather over 'expert' of each chunk's last `rows` positions; its transpose, a reduce-scatter, in
  backward."""
  ring = mesh.shape[EXPERT]
  check_sequence(x_BSX.shape[1], ring)
  if x_BSX.shape[1] // (2 * ring) < rows:
    raise UserError(f"context parallelism over {EXPERT}={ring}: chunks of {x_BSX.shape[1] // (2 * ring)} tokens are "
                    f"shorter than the DeltaNet conv's {rows} tokens of history")
  local = lambda x_BSX: _from_local_chunks(_halo(_local_chunks(x_BSX), rows, ring))
  spec = P(DATA, EXPERT)
  return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)(x_BSX)


def _initial_states(ms_2B, bs_2B, seg_2BC, ring):
  """Each of this device's two chunks' initial state [2, b, H, K, V] from every chunk's gathered state map."""
  resets = None
  if seg_2BC is not None:
    ends_P2B = _gathered_in_sequence_order(jnp.stack([seg_2BC[..., 0], seg_2BC[..., -1]], axis=1))
    resets = jnp.concatenate([jnp.zeros_like(ends_P2B[:1, 0], dtype=bool),
                              ends_P2B[1:, 0] != ends_P2B[:-1, 1]], axis=0)
  ms_PB, bs_PB = _gathered_in_sequence_order(ms_2B), _gathered_in_sequence_order(bs_2B)
  states_PB = combine_transitions(ms_PB, bs_PB, initial_state=jnp.zeros_like(bs_PB[0]), resets=resets)
  return _own_chunks(states_PB, ring)


def on_row_shards(rule, q, k, v, g, beta, *, mesh, spec, segment_ids=None, initial_state=None,
                  output_final_state=False, check_vma=False):
  """`rule` (`gated_delta_rule`; with its Pallas kernels, which XLA cannot partition) on each device's own rows: a
  shard_map splitting the leading dims as `spec` says ([B] rows, or [B, N] rows of chunks, merged into one batch on
  the device). Returns (o, final state or None), as `gated_delta_rule`. A Pallas call needs `check_vma` off."""
  lead = len(spec)

  def local(q, k, v, g, beta, seg, state):
    rows = lambda x: None if x is None else x.reshape(-1, *x.shape[lead:])
    o, final = rule(*map(rows, (q, k, v, g, beta)), segment_ids=rows(seg), initial_state=rows(state),
                    output_final_state=output_final_state)
    unrows = lambda x: None if x is None else x.reshape(*v.shape[:lead], *x.shape[1:])
    return unrows(o), unrows(final)

  specs = (spec,) * 5 + tuple(None if x is None else spec for x in (segment_ids, initial_state))
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(spec, spec), check_vma=check_vma)(
      q, k, v, g, beta, segment_ids, initial_state)


def entering_states(finals_BNHKW, *, mesh, segment_ids_BS=None):
  """The state entering each chunk of sequences in held order, split over 'expert', from each chunk's own state map:
  [B, 2N, H, K, V] (row b's chunks in held order, laid out over 'data' and 'expert'), from [M | b] of each chunk
  (`finals_BNHKW`, laid out so: the rule's final state from [I | 0] with values [0 | v], W = K + V columns). Moves as
  `context_gated_delta_rule`'s."""
  ring, key_dim = mesh.shape[EXPERT], finals_BNHKW.shape[-2]

  def local(finals_BNHKW, seg_BS):
    finals_2B = jnp.moveaxis(finals_BNHKW, 1, 0)
    seg_2BC = None if seg_BS is None else _local_chunks(seg_BS)
    return jnp.moveaxis(_initial_states(finals_2B[..., :key_dim], finals_2B[..., key_dim:], seg_2BC, ring), 0, 1)

  spec = P(DATA, EXPERT)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, None if segment_ids_BS is None else spec), out_specs=spec,
                       check_vma=True)(finals_BNHKW, segment_ids_BS)


def context_gated_delta_rule(q, k, v, g, beta, *, mesh, segment_ids=None, chunk_size=64, l2_normalize=True,
                             state_kernel="xla", span_tokens=SPAN_TOKENS):
  """`gated_delta_rule` (same arguments, no initial or final state) of sequences in held order, split over 'expert'.

  Moves: all_gather over 'expert' of every chunk's state map, 2N × (K×K + K×V) float32 per value head per row, and
  of the chunks' first and last segment ids; a reduce-scatter of their gradients in backward.

  Returns:
    (o [B, S, Hv, V] in v's dtype, held order, laid out as v; None: no final state), as `gated_delta_rule`.
  """
  ring = mesh.shape[EXPERT]
  check_sequence(v.shape[1], ring)
  rule = dict(chunk_size=chunk_size, l2_normalize=l2_normalize, state_kernel=state_kernel, span_tokens=span_tokens)

  def local(q, k, v, g, beta, seg_BS):
    chunked = [_local_chunks(x) for x in (q, k, v, g, beta)]
    rows = lambda x_2BC: x_2BC.reshape(-1, *x_2BC.shape[2:])  # the two chunks as rows of one batch
    seg_2BC = None if seg_BS is None else _local_chunks(seg_BS)
    seg_rows = None if seg_2BC is None else rows(seg_2BC)
    ms, bs = chunk_transition(*map(rows, chunked), segment_ids=seg_rows, **rule)
    unrows = lambda x: x.reshape(2, -1, *x.shape[1:])
    states_2B = _initial_states(unrows(ms), unrows(bs), seg_2BC, ring)
    o, _ = gated_delta_rule(*map(rows, chunked), segment_ids=seg_rows, initial_state=rows(states_2B), **rule)
    return _from_local_chunks(unrows(o))

  return _sharded(local, mesh, (q, k, v, g, beta), (segment_ids,), check_vma=state_kernel == "xla"), None

