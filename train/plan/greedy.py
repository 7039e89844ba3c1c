"""The planner's choice among remat policies from their uniform steps' bytes (`uniform`: policy → its step's memory
plan) and their estimated recompute seconds per layer (`seconds`): the order to plan along, the paper's §3.4 greedy
upgrades, and the step back when a plan does not fit."""


def cheapest_first(uniform, seconds):
  """The policies by their uniform steps' bytes, fewest first (`planner.FRUGAL_FIRST` as a rule), less each that a
  policy needing no more bytes beats on recompute time: XLA's schedule can make recomputing more cost more (Qwen3.5's
  4-layer slice at 16 × 4096 on an H100: `attention` 73.8 GiB, `layer` 76.0, `offload` 77.6)."""
  kept = []
  for policy in sorted(uniform, key=lambda p: (uniform[p]["total_bytes"], seconds[p])):
    if all(seconds[policy] < seconds[cheaper] for cheaper in kept):
      kept.append(policy)
  return tuple(kept)


def upgrades(uniform, seconds, layers, budget, order):
  """Per layer, start at the most frugal policy (`order`'s first); take (layer, policy) upgrades by recompute
  seconds saved per byte while `budget` allows. Bytes per layer of a policy: its uniform step's bytes over the
  frugal one's, divided among the layers."""
  frugal = order[0]
  base = uniform[frugal]["total_bytes"]
  extra_bytes = {p: max((uniform[p]["total_bytes"] - base) / layers, 1.0) for p in order}
  extra_bytes[frugal] = 0.0
  options = sorted(((seconds[frugal] - seconds[p]) / extra_bytes[p], p) for p in order[1:])
  slack = budget - base
  chosen = [frugal] * layers
  for _, policy in reversed(options):
    for i in range(layers):
      cost = extra_bytes[policy] - extra_bytes[chosen[i]]
      if seconds[policy] < seconds[chosen[i]] and cost <= slack:
        slack -= cost
        chosen[i] = policy
  # Keep layers of one policy together (one scanned stretch each); the layers are alike, so order is free.
  return tuple(sorted(chosen, key=order.index))


def step_back(remat, order):
  """One layer one policy more frugal (along `order`): the last layer whose policy is not already the most frugal."""
  remat = list(remat)
  for i in range(len(remat) - 1, -1, -1):
    level = order.index(remat[i])
    if level > 0:
      remat[i] = order[level - 1]
      break
  return tuple(sorted(remat, key=order.index))
