"""`relaymoe-plan --maximize batch` where the run's batch does not fit in one pass: the fewest micro-batches that
do, each candidate confirmed by compiling the accumulating step."""

import dataclasses

import pytest

from train.plan import search as plan_search
from train.plan.record import Plan


class FakePlanner:
  """Fits where a micro-batch holds at most `most` sequences (an accumulating step needs more than its micro-batch
  alone, so `most` may be below what fits in one pass)."""

  def __init__(self, most):
    self.most, self.asked = most, []

  def plan(self, batch_size, micro_batches):
    self.asked.append(micro_batches)
    return Plan(remat=("layer",), batch_size=batch_size, micro_batches=micro_batches, seq_len=128, state_bytes=1,
                temp_bytes=1, total_bytes=1, budget_bytes=1, fits=batch_size // micro_batches <= self.most)


def test_the_fewest_micro_batches_that_split_over_the_shards_and_fit():
  planner = FakePlanner(most=16)
  plan = plan_search.accumulating(planner, 96, 16, shards=8, log=lambda *_: None)
  assert (plan.micro_batches, planner.asked) == (6, [6])  # 96 / 6 = 16, a multiple of 8
  planner = FakePlanner(most=8)  # the accumulating step needs more: 16 per pass no longer fits
  plan = plan_search.accumulating(planner, 96, 16, shards=8, log=lambda *_: None)
  assert (plan.micro_batches, planner.asked) == (12, [6, 12])  # 7..11 do not give multiples of 8
  assert plan_search.accumulating(FakePlanner(most=1), 96, 16, shards=8, log=lambda *_: None) is None
  table = plan_search.render({"ring": dict(dispatcher="ring_expert", plan=plan, not_fitting=24)})
  assert "| 96 = 12 × 8 |" in table


@pytest.mark.slow  # compiles the tiny model's step at several batch sizes (~1-3 min on 2 cores)
def test_maximize_batch_reports_micro_batches_for_a_batch_too_large_for_one_pass():
  from test_plan import BASE, between, planner_with
  from train.run import resolve_run
  budget = between({p: planner_with(1 << 50).measure(p)["total_bytes"] for p in ("none", "layer")}, 0.5)
  config = dataclasses.replace(BASE, batch_size=256, device_memory_gib=budget / (1 - BASE.memory_headroom) / 2**30)
  results = plan_search.search(resolve_run(config), maximize="batch", variants=("ring",), log=lambda *_: None,
                               upgrade=False)
  plan = results["ring"]["plan"]
  assert plan.fits and plan.batch_size == 256 and plan.micro_batches > 1
  assert plan.batch_size // plan.micro_batches < results["ring"]["not_fitting"]
