"""The GPU benchmark harnesses still run (tiny shapes, 8 emulated devices) and their summaries parse."""

import gzip
import json
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import relaymoe_jax as rm
from benchmarks import (capacity, cp_attention, documents, gated_deltanet, grouped_gemm, harness, loss_head,
                        moe_layer, moe_layer_worker, train_compare)
from benchmarks.train_compare import ep8_summary
from benchmarks.trace_summary import collective_timeline, kernel_times, kind_of
from models.attention.documents import same_document
from models.attention.gated_delta import SPAN_TOKENS, gated_delta_rule


@pytest.fixture(scope="module")
def rows():
  return [moe_layer_worker.run_one(v, "tiny", 64, iters=1)
          for v in ("ring_expert", "compute_floor", moe_layer.TRANSFER, "a2a_dropless", "a2a_cf1", "ring_token@64/16",
                    "ring_nocomm", "ring_expert_reverse", "auto", "compute_floor_keep")]


@pytest.mark.slow  # 13-29 s on 2 cores (the default run reached 11.5 min); CI's second step runs it
def test_moe_layer_rows_measure_every_variant(rows):
  for row in rows:
    assert "error" not in row, row
    assert row["latency_ms"] > 0 and row["temp_bytes"] > 0
  assert [r["gpus"] for r in rows] == [8, 1, 8, 8, 8, 8, 8, 8, 8, 1]


# A ring of two reverses its backward, so its transfers differ (5-8 s each on 2 cores; CI's second step runs them).
@pytest.mark.slow
@pytest.mark.parametrize("gpus", [2, 8])
def test_overlap_bounds_split_the_ring_in_two(gpus):
  """ring_nocomm has the ring's matmuls and no send; transfer has exactly the ring's sends (compiled HLO)."""
  def sends(text):
    return sorted(re.findall(r"= (\S+) collective-permute\(", text))

  ring, nocomm, transfer = (moe_layer_worker.compile_variant(v, "tiny", 64, gpus=gpus)[0].as_text()
                            for v in ("ring_expert", "ring_nocomm", moe_layer.TRANSFER))
  assert sends(ring) and sends(ring) == sends(transfer)
  assert not sends(nocomm)
  assert ring.count(" dot(") == nocomm.count(" dot(") > 0


@pytest.mark.slow  # 6 s on 2 cores (the default run reached 10.5 min on CI); CI's second step runs it
def test_a_stack_of_layers_runs_each_layer():
  def sends(shape):
    return moe_layer_worker.compile_variant("ring_expert", shape, 64)[0].as_text().count("collective-permute(")

  assert sends("tiny*2") == 2 * sends("tiny") > 0
  assert moe_layer.stack_depth("tiny*3") == 3 and moe_layer.stack_depth("tiny") == 1
  with pytest.raises(ValueError, match="positive integer"):
    moe_layer.stack_depth("tiny*0")


@pytest.mark.slow  # an end-to-end run; CI's second step runs it
def test_variants_compile_together_and_measure_in_turn():
  jobs = [("tiny", "ring_expert", 64), ("tiny", "a2a_cf1", 64), ("tiny", "no_such_variant", 64)]
  rows = list(moe_layer.run_isolated(jobs, iters=1, parallel=2))
  assert [(r["shape"], r["variant"], r["tokens_per_gpu"]) for r in rows] == jobs
  for row in rows[:2]:
    assert row["latency_ms"] > 0 and row["compile_s"] > 0 and row["gpus"] == 8, row
  assert "no_such_variant" in rows[2]["error"], rows[2]


def _fake_child(code):
  """A `harness.Child` around `python -c code` instead of a variant process."""
  return harness.Child(dict(variant="v"), [sys.executable, "-c", code])


def test_a_variant_process_that_never_exits_is_killed():
  child = _fake_child("import json, time; print(json.dumps(dict(variant='v', error='out of memory')), flush=True); "
                      "time.sleep(60)")
  start = time.perf_counter()
  child.wait_ready()
  child.close(wait_s=0.5)
  assert child.result["error"] == "out of memory" and child.proc.returncode is not None
  assert time.perf_counter() - start < 10


def test_a_variant_process_that_never_reports_is_killed():
  child = _fake_child("import json, sys, time; print(json.dumps(dict(ready=True)), flush=True); "
                      "sys.stdin.readline(); time.sleep(60)")
  child.wait_ready()
  row = child.measure(timeout_s=0.5)
  assert row == dict(variant="v", error="no result within 0.5 s: killed") and child.proc.returncode is not None


def test_merge_keeps_the_latest_row_of_each_point(tmp_path):
  def run(name, rows, scaling=None):
    meta = dict(command=name, machine="m", jax="j", python="p", xla_flags="")
    (tmp_path / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows, ep_scaling=scaling or {})))
    return str(tmp_path / f"{name}.json")

  def row(shape, tokens, variant, ms):
    return dict(shape=shape, tokens_per_gpu=tokens, variant=variant, gpus=2, latency_ms=ms, peak_bytes=1,
                temp_bytes=1, useful_tflops_per_gpu=1.0)

  ep8 = dict(ep=8, num_experts=128, tokens_per_device=2048, ring_expert=1, a2a_dropless=40, a2a_cf1=5,
             ratio_dropless=40.0, ratio_cf1=5.0)
  first = run("a", [row("qwen3_30b", 65536, "ring_expert", 9.0), row("grid-x", 8, "ring_expert", 1.0),
                    row("qwen3_30b", 65536, moe_layer.TRANSFER, 6.6)],
              dict(command="ep", machine="cpu", jax="j", python="p", rows=[ep8]))
  second = run("b", [row("qwen3_30b", 65536, "ring_expert", 6.0), row("qwen3_30b", 65536, "a2a_cf1", 9.0),
                     row("qwen3_30b", 8192, "ring_expert", 2.0), row("qwen3_30b", 8192, moe_layer.TRANSFER, 4.8)])
  out = tmp_path / "merged.json"
  moe_layer.merge([first, second], str(out))
  merged = json.loads(out.read_text())
  assert [(r["shape"], r["tokens_per_gpu"], r["variant"], r["latency_ms"]) for r in merged["rows"]] == [
      ("qwen3_30b", 8192, moe_layer.TRANSFER, 4.8), ("qwen3_30b", 8192, "ring_expert", 2.0),
      ("qwen3_30b", 65536, "ring_expert", 6.0), ("qwen3_30b", 65536, "a2a_cf1", 9.0),
      ("grid-x", 8, "ring_expert", 1.0)]
  text = (tmp_path / "merged.txt").read_text()
  assert "# a\n" in text and "# b\n" in text and "# ep\n" in text
  assert text.splitlines()[-1].startswith("summary: moe_layer gpus=2 shape=qwen3_30b tokens=65536 ")
  third = run("c", [row("qwen3_30b", 8192, "ring_expert", 1.5)])
  moe_layer.merge([str(out), third], str(tmp_path / "again.json"))  # a merged file merged again keeps its runs
  again = json.loads((tmp_path / "again.json").read_text())
  assert [m["command"] for m in again["meta"]["runs"]] == ["a", "b", "c"]
  assert len(again["rows"]) == len(merged["rows"]) and ("qwen3_30b", 8192, "ring_expert", 1.5) in [
      (r["shape"], r["tokens_per_gpu"], r["variant"], r["latency_ms"]) for r in again["rows"]]
  assert "speedup_vs_cf1=1.50" in text and "ep8_mem_ratio_cf1=5.00" in text
  one_gpu = run("d", [dict(row("qwen3_30b", 65536, "a2a_cf1", 4.0), gpus=1),
                      dict(row("qwen3_30b", 65536, "compute_floor", 2.0), gpus=1)])
  moe_layer.merge([str(out), one_gpu], str(tmp_path / "one_gpu.json"))  # another GPU count is another point
  text = (tmp_path / "one_gpu.txt").read_text()
  assert "speedup_vs_cf1=1.50" in text  # the 2-GPU ring against the 2-GPU all-to-all still
  assert "| qwen3_30b | 1 | 65536 | compute_floor | 2.0 | 0.00 | 0.00 | 1 | — | 2.00× |" in text


def test_variant_names_a_chunk_ladder():
  assert moe_layer.variant_options("ring_expert@32768/8192") == ("ring_expert", {"chunk_rows": (32768, 8192)})
  assert moe_layer.variant_options("a2a_cf1") == ("all_to_all", {"capacity_factor": 1.0})


def test_xla_options_override_the_librarys():
  limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
  assert moe_layer_worker.compiler_options() == rm.COMPILER_OPTIONS
  options = moe_layer_worker.compiler_options([f"{limit}=1", "xla_gpu_use_memcpy_local_p2p=true"])
  assert options == {limit: 1, "xla_gpu_use_memcpy_local_p2p": True}
  with pytest.raises(ValueError, match="no_equals_sign"):
    moe_layer_worker.compiler_options(["no_equals_sign"])
  with pytest.raises(ValueError, match="no_equals_sign"):  # the driver's check, before any process starts
    moe_layer.main(["--xla-option", "no_equals_sign"])


@pytest.mark.slow  # 13-29 s on 2 cores (the default run reached 11.5 min); CI's second step runs it
def test_moe_layer_summary_has_every_field(rows):
  scaling = [dict(ep=8, ratio_cf1=5.0), dict(ep=64, ratio_cf1=20.0)]
  line = moe_layer.summary(rows, scaling, shape="tiny", tokens=64)
  fields = dict(re.findall(r"(\w+)=([^ ]+)", line))
  for key in ("speedup_vs_dropless", "speedup_vs_cf1", "hop_overlap", "ep8_mem_ratio_cf1", "ep64_mem_ratio_cf1"):
    assert float(fields[key]) > 0, (key, line)
  for key in ("useful_tflops", "floor_useful_tflops", "floor_keep_useful_tflops"):
    assert float(fields[key]) >= 0, (key, line)  # tiny on CPU rounds to 0.0; peak memory ratios are nan on CPU
  assert "| ring_expert |" in moe_layer.render(rows, [])


@pytest.mark.slow  # 6 s on 2 cores (the default run reached 10.5 min on CI); CI's second step runs it
def test_profile_reports_kernel_time(tmp_path):
  row = moe_layer_worker.run_one("ring_expert", "tiny", 64, iters=1, profile_dir=str(tmp_path))
  assert row["kernels"]["busy_ms"] > 0 and row["kernels"]["by_name"], row["kernels"]
  table = moe_layer.render([row], [])
  assert "Kernel time per step" in table and f"| {row['kernels']['busy_ms']:.1f} |" in table
  idle = f"{row['latency_ms'] - row['kernels']['busy_ms']:.1f}" if row["gpus"] == 1 else "—"
  assert table.splitlines()[-1].endswith(f" | {idle} |"), table


def test_trace_summary_places_collectives_beside_compute(tmp_path):
  """A send of 2 ms with 0.5 ms of GEMM beside it: 1.5 ms exposed, compute 0.5 + 1 ms."""
  def kernel(name, ts, dur):
    return dict(ph="X", pid=1, tid=7, name=name, ts=ts, dur=dur)

  events = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
            kernel("ncclDevKernel_SendRecv", 0, 2000), kernel("body_mosaic_gpu_kernel", 1500, 500),
            kernel("loop_add_fusion", 3000, 1000)]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as fh:
    json.dump(events, fh)
  times = kernel_times(str(path))
  assert (times["exposed_collective_ms"], times["compute_ms"]) == (1.5, 1.5), times
  assert collective_timeline(str(path)) == [(0.0, 2.0, 0.5, "ncclDevKernel_SendRecv")]


def test_kernels_are_classified_by_name():
  assert kind_of("body_mosaic_gpu_kernel") == "grouped matmul"
  assert kind_of("loop_gather_fusion_1") == "gather" and kind_of("_sort_kernel") == "other"


def test_ep8_summary_averages_over_points():
  rows = [dict(shape=s, tokens_per_gpu=t, variant=v, gpus=8, latency_ms=ms, peak_bytes=mem)
          for s, t, v, ms, mem in [("a", 1, "ring_expert", 10.0, 1.0), ("a", 1, "a2a_dropless", 30.0, 5.0),
                                   ("a", 1, "a2a_cf1", 20.0, 3.0), ("b", 1, "ring_expert", 10.0, 1.0),
                                   ("b", 1, "a2a_dropless", 10.0, 3.0), ("b", 1, "a2a_cf1", 10.0, 1.0),
                                   ("c", 1, "ring_expert", 1.0, 1.0)]]  # c: no all-to-all, not averaged
  line = ep8_summary(rows, {"loss_curve_max_abs_diff": 1e-6})
  assert line == ("summary: ep8 speedup_vs_dropless_mean=2.00 speedup_vs_cf1_mean=1.50 mem_ratio_dropless_mean=4.00 "
                  "loss_curve_max_abs_diff=1e-06")
  with pytest.raises(ValueError, match="no point"):
    ep8_summary([dict(r, gpus=2) for r in rows], {"loss_curve_max_abs_diff": 0.0})


def test_a_step_that_cannot_fit_is_reported_not_run():
  """Compiled needs (arguments + outputs + temporaries) over a device's allocator limit: out of memory, with both
  numbers; CPU devices report no limit, so nothing is refused there."""
  def gram_sum(a):
    return (a @ a.T).sum()

  compiled = jax.jit(gram_sum).lower(jnp.ones((256, 64))).compile()

  class Device:
    def __init__(self, limit):
      self.limit = limit

    def memory_stats(self):
      return dict(bytes_limit=self.limit)

  row = {}
  assert moe_layer_worker.does_not_fit(compiled, [Device(1 << 40), Device(1024)], row)
  assert row["error"] == "out of memory" and row["limit_bytes"] == 1024 and row["needed_bytes"] >= 256 * 64 * 4
  assert not moe_layer_worker.does_not_fit(compiled, [Device(1 << 40)], {})
  assert not moe_layer_worker.does_not_fit(compiled, jax.devices()[:1], {})


def test_train_compare_reports_the_trainers_own_error(tmp_path):
  with pytest.raises(SystemExit, match="the ring_expert run failed: relaymoe-train: error: override: "
                                       "seq_len='abc' is not an int"):
    train_compare.main(["--config", "cpu", "--steps", "1", "--work", str(tmp_path), "--out", str(tmp_path / "c.json"),
                        "seq_len=abc"])


def _capacity_found(seq_len, ran=None):
  found = dict(dispatcher="ring_expert", not_fitting=seq_len + 4096,
               plan=dict(seq_len=seq_len, summary="4 × offload", total_bytes=100 * 2**30, budget_bytes=128 * 2**30))
  if ran is not None:
    found["at_limit"] = dict(ran=ran, peak_gib=99.0, seconds=30, message="" if ran else "RESOURCE_EXHAUSTED")
  return found


def _capacity_setting(name, gpus, ring, a2a_dropless, a2a_cf1, topology=None):
  """A setting of the capacity table: each variant a `_capacity_found` argument tuple (seq_len[, ran])."""
  found = dict(ring=ring, a2a_dropless=a2a_dropless, a2a_cf1=a2a_cf1)
  return dict(name=name, layers=4, gpus=gpus, variants={v: _capacity_found(*f) for v, f in found.items()},
              **({"topology": topology} if topology else {}))


def test_capacity_summary_counts_limits_whose_real_step_trained_on_local_gpus():
  local = _capacity_setting("1xH200 4 layers", 1, (524288, True), (233472, True), (262144, False))
  topology = _capacity_setting("1x1x8 compile-only 4 layers", 8, (1048576,), (32768,), (249856,), "1x1x8")
  data = dict(command="python -m benchmarks.capacity", machine={}, settings=[local, topology])
  assert capacity.summary(data) == ("summary: capacity model=qwen3_30b gpus=1 ring_max_seq=524288 "
                                    "a2a_max_seq=233472 cf1_max_seq=0 ratio=2.25")
  text = capacity.render(data)
  assert text.splitlines()[-1] == capacity.summary(data)
  assert ("| 1xH200 4 layers | a2a_cf1 | 262144 | 4 × offload | 100.0 | 128.0 | 266240 | failed: RESOURCE_EXHAUSTED"
          in text)
  assert "| 1x1x8 compile-only 4 layers | ring | 1048576 |" in text


def test_capacity_summary_gives_the_all_to_all_a_longer_compile_only_limit_on_as_many_gpus():
  """Code newer than the all-to-all's real steps may fit it further: a compile-only search on one GPU raises its
  limit in the summary, never the ring's (compile-only from a CPU host has read 30 GiB under a GPU's own compile
  for the ring)."""
  local = _capacity_setting("1xH200 4 layers", 1, (999424, True), (237568, True), (237568, True))
  newer = _capacity_setting("1x1x1 compile-only 4 layers", 1, (1392640,), (344064,), (344064,), "1x1x1")
  data = dict(command="python -m benchmarks.capacity", machine={}, settings=[local, newer])
  assert capacity.summary(data) == ("summary: capacity model=qwen3_30b gpus=1 ring_max_seq=999424 "
                                    "a2a_max_seq=344064 cf1_max_seq=344064 ratio=2.90")


def test_context_parallel_capacity_summarises_the_deepest_setting_on_the_most_gpus():
  shallow = dict(name="1x1x8 compile-only 4 layers, context parallel", layers=4, gpus=8, topology="1x1x8",
                 variants=dict(ring=_capacity_found(8388608), a2a_dropless=_capacity_found(262144),
                               a2a_cf1=_capacity_found(2097152)))
  deep = dict(shallow, name="1x1x8 compile-only 48 layers, context parallel", layers=48, variants=dict(
      ring=_capacity_found(4194304), a2a_dropless=_capacity_found(131072), a2a_cf1=_capacity_found(1048576)))
  data = dict(command="python -m benchmarks.capacity --context-parallel", machine={}, settings=[shallow, deep],
              context_parallel=True)
  assert capacity.render(data).splitlines()[-1] == (
      "summary: capacity_cp model=qwen3_30b gpus=8 layers=48 ring_max_seq=4194304 a2a_max_seq=131072 "
      "cf1_max_seq=1048576 ratio=32.00")


def test_capacity_summary_counts_a_size_above_the_limit_whose_step_trained():
  """The planner's limit is conservative by its headroom: a step above it that trained (fit check lifted) is the
  variant's longest; one that failed is not."""
  ring, a2a = _capacity_found(524288, True), _capacity_found(233472, True)
  ring["above_limit"] = dict(ran=False, peak_gib=None, seconds=9, message="RESOURCE_EXHAUSTED")
  a2a["above_limit"] = dict(ran=True, peak_gib=127.5, seconds=9, message="")
  local = dict(name="1xH200 4 layers", layers=4, gpus=1, variants=dict(ring=ring, a2a_dropless=a2a))
  assert capacity.summary(dict(settings=[local])).endswith(
      f"ring_max_seq=524288 a2a_max_seq={a2a['not_fitting']} cf1_max_seq=0 ratio={524288 / a2a['not_fitting']:.2f}")


def test_capacity_confirming_step_runs_the_plan_with_its_chunk_cap():
  found = dict(_capacity_found(999424), options={"backend": "auto"})
  found["plan"].update(remat=["offload"] * 4, batch_size=1, max_chunk_rows=131072)
  cmd = capacity.train_command("ep8", 4, found, 999424, "/tmp/w", lift_fit_check=False)
  assert 'runtime.dispatcher_options={"backend": "auto", "max_chunk_rows": 131072}' in cmd
  assert "runtime.remat=[offload,offload,offload,offload]" in cmd and "seq_len=999424" in cmd
  assert "runtime.dispatcher=ring_expert" in cmd


def test_capacity_merge_keeps_the_latest_variant_of_each_setting(tmp_path):
  def run(name, seq_len, path, variants=("ring", "a2a_dropless"), note=None, topology=None):
    found = dict(ring=_capacity_found(seq_len, True), a2a_dropless=_capacity_found(seq_len // 2, True))
    setting = dict(name=name, layers=4, gpus=8 if topology else 1, variants={v: found[v] for v in variants},
                   **({"note": note} if note else {}), **({"topology": topology} if topology else {}))
    data = dict(command=f"run {seq_len}", machine={}, settings=[setting])
    path.write_text(json.dumps(data))
    return str(path)

  paths = [run("t", 8192, tmp_path / "0.json", topology="1x1x8"),
           run("a", 1024, tmp_path / "1.json", note="limit not run yet"), run("b", 4096, tmp_path / "2.json"),
           run("a", 2048, tmp_path / "3.json", variants=("ring",), note="limit trained")]
  capacity.merge(paths, str(tmp_path / "merged.json"))
  merged = json.loads((tmp_path / "merged.json").read_text())
  assert [(s["name"], s["variants"]["ring"]["plan"]["seq_len"]) for s in merged["settings"]] == [
      ("a", 2048), ("b", 4096), ("t", 8192)]  # real GPUs first, then compile-only
  assert merged["settings"][0]["variants"]["a2a_dropless"]["plan"]["seq_len"] == 512  # kept from the first run
  assert merged["settings"][0]["note"] == "limit trained"  # the later run's word on the setting
  assert merged["merged_from"] == ["run 8192", "run 1024", "run 4096", "run 2048"]
  assert (tmp_path / "merged.txt").read_text().splitlines()[-1].startswith("summary: capacity model=qwen3_30b gpus=1 "
                                                                           "ring_max_seq=4096 a2a_max_seq=2048")


@pytest.mark.slow  # 5 s on 2 cores (the default run reached 10.5 min on CI); CI's second step runs it
def test_capacity_loss_head_only_compares_plain_chunked_and_forward_grad(tmp_path):
  """Compile-only, this machine's first device: the chunked head needs a small fraction of the plain one's
  temporaries (the full float32 logits of 65536 tokens over Qwen3's vocabulary alone are 37 GiB)."""
  capacity.main(["--loss-head-only", "--out", str(tmp_path / "head.json")])
  head = json.loads((tmp_path / "head.json").read_text())["loss_head"]
  assert head["plain_temp_gib"] >= head["full_logits_gib"] > 37 and head["chunked_temp_gib"] < 3, head
  assert head["forward_grad_temp_gib"] < head["full_logits_gib"] / 8, head  # 3.1 GiB on CPU: dx, dhead, a chunk
  text = (tmp_path / "head.txt").read_text()
  assert "Loss head fwd+bwd at 65536 tokens" in text and "summary:" not in text
  assert "GiB as the trainer's mean with its gradient from the forward" in text


def test_grouped_gemm_merge_replaces_rows_and_marks_other_tiles(tmp_path):
  def row(name, k, n, fwd, tiles=None):
    r = dict(name=name, m=64, k=k, n=n, groups=2, fwd_tflops=fwd, dgrad_tflops=1.0, wgrad_tflops=1.0,
             xla_fwd_tflops=None, dense_tflops=1.0)
    return dict(r, tiles=grouped_gemm._tiles_in_use(r) if tiles is None else tiles)

  def run(name, rows):
    meta = dict(command=name, device="d", jax="j", python="p")
    (tmp_path / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    return str(tmp_path / f"{name}.json")

  first = run("a", [row("qwen3_30b_ep8", 2048, 768, 1.0), row("x", 2048, 1536, 2.0, tiles={})])
  second = run("b", [row("qwen3_30b_ep8", 2048, 768, 3.0)])
  text = grouped_gemm.merge([first, second], str(tmp_path / "m.json"))
  assert [r["fwd_tflops"] for r in json.loads((tmp_path / "m.json").read_text())["rows"]] == [3.0, 2.0]
  assert "| qwen3_30b_ep8 | 64 |" in text and "| x † | 64 |" in text and "# a\n" in text and "# b\n" in text
  assert text.splitlines()[-1] == "summary: grouped_gemm shape=qwen3_30b_ep8 fwd_tflops=3.0 wgrad_tflops=1.0 " \
                                  "xla_fwd_tflops=0.0"


def test_the_drivers_import_no_jax():
  """The drivers orchestrate processes, merge, render and plot; JAX lives in the workers they start."""
  code = ("import sys; import benchmarks.moe_layer, benchmarks.capacity, benchmarks.train_compare; assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=harness.REPO)


def test_merge_by_key_keeps_the_first_place_and_the_latest_item():
  items = [dict(k="a", v=1), dict(k="b", v=2), dict(k="a", v=3), dict(k="c", v=4)]
  assert harness.merge_by_key(items, lambda r: r["k"]) == [dict(k="a", v=3), dict(k="b", v=2), dict(k="c", v=4)]

  def add(earlier, later):
    return dict(later, v=earlier["v"] + later["v"])

  assert harness.merge_by_key(items, lambda r: r["k"], add) == [dict(k="a", v=4), dict(k="b", v=2),
                                                                 dict(k="c", v=4)]
  assert harness.merge_by_key([], lambda r: r) == []


def test_cp_attention_packs_documents_one_after_another():
  segments = np.asarray(cp_attention.documents(3, 4096, 256))
  assert segments.shape == (3, 4096) and (segments[:, 0] == 0).all()
  assert set(np.unique(np.diff(segments, axis=1))) <= {0, 1}  # contiguous documents, ids counting up
  assert 4096 / 512 < 4096 * 3 / (segments[:, -1] + 1).sum() < 512  # mean length near 256 (exponential, ≥ 1)


def test_cp_attention_times_the_tile_loop_and_writes_its_summary(tmp_path):
  """XLA's tiles run anywhere (cuDNN's need a GPU): a row with both timings, of packed documents, and the summary
  naming it."""
  out = tmp_path / "cp.json"
  cp_attention.main(["--tokens", "256", "--variants", "xla_tiles", "--mean-doc", "32", "--iters", "1", "--out",
                     str(out)])
  (row,) = json.loads(out.read_text())["rows"]
  # Times only positive: at 256 tokens on a loaded CPU the forward alone has measured longer than both passes.
  assert row["variant"] == "xla_tiles" and row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
  assert row["most_documents_in_a_row"] > 1
  assert out.with_suffix(".txt").read_text().splitlines()[-1] == (
      f"summary: cp_attention gpu=cpu tokens=256 xla_tiles_tflops={row['fwd_bwd_tflops']:.0f}")


def test_cp_attention_tile_loop_attends_within_the_documents():
  """The tile variants take the documents: XLA's tile loop (two tiles of 128 rows) over packed documents equals XLA's
  masked attention (float32, 1e-5)."""
  mesh = jax.make_mesh((1, 1, 1), cp_attention.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:1])
  segments = cp_attention.documents(2, 256, 48)
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (2, 256, h, 16)) for key, h in zip(keys, (4, 2, 2)))
  tiles = cp_attention._attend("xla_tiles", mesh, None, segments, 16, None)(q, k, v)
  masked = jax.nn.dot_product_attention(q, k, v, scale=cp_attention.HEAD_DIM ** -0.5, is_causal=True,
                                        mask=same_document(segments)[:, None])
  np.testing.assert_allclose(tiles, masked, rtol=1e-5, atol=1e-5)


def test_loss_head_times_every_variant_and_writes_its_summary(tmp_path):
  """Tiny shapes on CPU: a row per variant and chunk, the matmul roof first, and the summary naming the best."""
  out = tmp_path / "loss_head.json"
  loss_head.main(["--tokens", "256", "--d-model", "16", "--vocab", "512", "--recompute-chunks", "64",
                  "--forward-chunks", "64,256", "--iters", "1", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [(r["variant"], r["chunk"]) for r in rows] == [("matmul", None), ("recompute", 64), ("forward_grad", 64),
                                                         ("forward_grad", 256)]
  assert all(r["ms"] > 0 and r["tflops"] > 0 for r in rows), rows
  best = min(r["ms"] for r in rows if r["variant"] == "forward_grad")
  assert out.with_suffix(".txt").read_text().splitlines()[-1] == (
      f"summary: loss_head gpu=cpu tokens=256 recompute_ms={rows[1]['ms']:.1f} forward_grad_ms={best:.1f} "
      f"matmul_roof_ms={rows[0]['ms']:.1f}")


def test_documents_file_holds_whole_documents_each_ended_by_eos(tmp_path):
  path = tmp_path / "docs.u32"
  data = documents.write_documents(path, 20000, 500, 7, 64)
  tokens = np.fromfile(path, np.uint32)
  ends = np.flatnonzero(tokens == 7)
  lengths = np.diff(np.concatenate([[-1], ends])) - 1
  assert tokens.size == data["tokens"] >= 20000 and ends[-1] == tokens.size - 1 and ends.size == data["documents"]
  assert lengths.min() >= 16 and 40 < lengths.mean() < 90 and int(tokens.max()) < 500, lengths.mean()


@pytest.mark.slow  # two trainer processes; CI's second step runs it
def test_documents_benchmark_trains_with_masking_on_and_off(tmp_path):
  out = tmp_path / "documents.json"
  assert documents.main(["--config", "cpu", "--steps", "2", "--log-every", "1", "--tokens", "30000", "--mean-doc",
                         "64", "--eval-batches", "1", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  for run in result["runs"].values():
    assert run["tokens_per_s"] > 0 and run["eval_tokens"] > 0 and np.isfinite(run["eval_loss"]), run
  masked, unmasked = result["runs"]["true"], result["runs"]["false"]
  # Masking leaves the target after each EOS out of the held-out loss (documents of ~64 tokens: ~1/64 of them).
  assert 0.9 * unmasked["eval_tokens"] < masked["eval_tokens"] < unmasked["eval_tokens"], (masked, unmasked)
  assert 0 < masked["eval_loss"] < 2 * np.log(500) and 0 < unmasked["eval_loss"] < 2 * np.log(500), result
  lines = out.with_suffix(".txt").read_text().splitlines()
  assert lines[0].startswith("# python -m benchmarks.documents --config cpu ") and " jax " in lines[1]
  assert re.match(r"summary: documents cpu \d+x\d+ masked_over_unmasked=\d\.\d{3} eval_s_per_1m_tokens=[\d.]+ mean_doc=64$",
                  lines[-1])


@pytest.mark.slow  # ~8 s; a benchmark's baseline, not a user's path
def test_the_maxtext_baseline_computes_the_gated_delta_rule():
  """The comparison's MaxText formulation (written from its description) is the rule itself: our chunked form's
  output in float32 (1e-5 of the largest entry), so its times are those of the same math."""
  q, k, v, g, beta, _ = (x.astype(jnp.float32) for x in gated_deltanet.inputs(2, 100, 2, 4, 16))
  theirs = gated_deltanet.maxtext_gated_delta_rule(q, k, v, g, beta, chunk_size=16, compute_dtype=jnp.float32)
  ours, _ = gated_delta_rule(q, k, v, g, beta, chunk_size=16)
  assert np.abs(np.asarray(theirs) - np.asarray(ours)).max() <= 1e-5 * np.abs(np.asarray(ours)).max()


def test_gated_deltanet_writes_its_table_and_summary(tmp_path):
  """At a tiny shape on CPU: the XLA form measured forward and forward + backward, the kernels' and fla's rows
  saying they need a GPU, the summary line last."""
  out = tmp_path / "gdn.json"
  gated_deltanet.main(["--shapes", "1x128", "--variants", "xla,pallas,fla", "--key-heads", "1", "--value-heads", "2",
                       "--head-dim", "16", "--iters", "1", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert rows[0]["variant"] == "xla" and rows[0]["fwd_ms"] > 0 and rows[0]["fwd_bwd_ms"] > 0
  assert [r.get("note") for r in rows[1:]] == ["needs a GPU", "needs a GPU"]
  last = (tmp_path / "gdn.txt").read_text().splitlines()[-1]
  assert last.startswith("summary: gated_deltanet 1x128 variant=xla fwd_ms=") and "fla_fwd_ms=-" in last


def test_gated_deltanet_variants_call_the_rule_as_named(monkeypatch):
  """Each JAX variant's options to `gated_delta_rule`: the kernel path or XLA form, bfloat16 chunks, and for
  `pallas_whole` rows unspanned (the others the rule's default spans)."""
  calls = []
  monkeypatch.setattr(gated_deltanet, "gated_delta_rule", lambda *args, **options: calls.append(options) or args)
  for variant in ("pallas", "pallas_whole", "xla_bf16chunks"):
    gated_deltanet.jax_rule(variant)(*range(5))
  assert [(c["state_kernel"], c["chunk_dtype"], c["span_tokens"]) for c in calls] == [
      ("pallas", None, SPAN_TOKENS), ("pallas", None, None), ("xla", jnp.bfloat16, SPAN_TOKENS)]


def test_gated_deltanet_compile_only_rows_give_compiled_temporaries():
  """`--compile-only`'s rows, here compiled for this CPU device (a GPU target needs the CUDA plugin): each pass's
  temporaries instead of times, fla said not to be JAX, and a summary of the temporaries."""
  device = jax.devices("cpu")[0]
  rows = [dict(shape="1x128", variant=v, **gated_deltanet.measure(v, (1, 128), (1, 2, 16), 1, device=device))
          for v in ("xla", "fla")]
  assert rows[0]["fwd_ms"] is None and rows[0]["fwd_bwd_temp_gib"] >= rows[0]["fwd_temp_gib"] >= 0
  assert rows[1]["note"] == "compile-only: fla is not JAX"
  assert gated_deltanet.summary(rows).startswith("summary: gated_deltanet_compile_only 1x128 xla_fwd_bwd_temp_gib=")


PTXAS_REPORT = """ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'gated_delta_wy_backward'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gated_delta_wy_backward' for 'sm_90a'
ptxas info    : Function properties for gated_delta_wy_backward
    1312 bytes stack frame, 1464 bytes spill stores, 1664 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1312 bytes cumulative stack size
ptxas info    : Compiling entry function 'gated_delta_state_forward' for 'sm_90a'
ptxas info    : Function properties for gated_delta_state_forward
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 57 registers, used 1 barriers
"""


def test_ptxas_report_reads_each_kernels_registers_and_spills():
  """`ptxas -v`'s report (as it printed it for this project's kernels, compiled for an H200): each entry's registers
  per thread and spill stores, not another entry's."""
  assert harness.parse_ptxas(PTXAS_REPORT) == {"gated_delta_wy_backward": (255, 1464),
                                              "gated_delta_state_forward": (57, 0)}
