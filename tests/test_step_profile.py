"""The train-step profile: kernel time by part from a trace and the HLO's op metadata (synthetic GPU and CPU
traces, every part), `relaymoe-train --profile` and `benchmarks.train_step` on the tiny model."""

import gzip
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks import train_step
from conftest import assert_close, requires_devices
from models.qwen3 import model as qwen3
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from train import cli
from train.config import MeshConfig
from train.mesh import build_mesh
from train.profile.window import Window, check_window, parse_window
from train.profile.step_parts import PARTS, parse_hlo, step_parts
from train.profile.trace_events import op_events

STEP = "jit(train_step)/transpose(jvp())/while/body/closed_call"

HLO = f"""HloModule jit_train_step, is_scheduled=true, entry_computation_layout={{(bf16[64,32]{{1,0}})->bf16[64,16]{{1,0}}}}

%fused_gemm (param_0: bf16[64,32], param_1: bf16[32,16]) -> bf16[64,16] {{
  %param_0 = bf16[64,32]{{1,0}} parameter(0)
  %param_1 = bf16[32,16]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[64,16]{{1,0}} dot(bf16[64,32]{{1,0}} %param_0, bf16[32,16]{{1,0}} %param_1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="{STEP}/moe/shard_map/dot_general" source_file="a.py" source_line=1}}
}}

%fused_swiglu (param_0.1: f32[64,16]) -> f32[64,8] {{
  %param_0.1 = f32[64,16]{{1,0}} parameter(0)
  %slice.1 = f32[64,8]{{1,0}} slice(f32[64,16]{{1,0}} %param_0.1), slice={{[0:64], [0:8]}}
  ROOT %multiply.1 = f32[64,8]{{1,0}} multiply(f32[64,8]{{1,0}} %slice.1, f32[64,8]{{1,0}} %slice.1), metadata={{op_name="{STEP}/moe/shard_map/mul"}}
}}

%fused_transpose (param_0.2: bf16[64,16]) -> bf16[16,64] {{
  %param_0.2 = bf16[64,16]{{1,0}} parameter(0)
  ROOT %copy.9 = bf16[16,64]{{0,1}} copy(bf16[64,16]{{1,0}} %param_0.2)
}}

%fused_router (param_0.3: bf16[64,32], param_1.3: bf16[32,8]) -> bf16[64,8] {{
  %param_0.3 = bf16[64,32]{{1,0}} parameter(0)
  %param_1.3 = bf16[32,8]{{1,0}} parameter(1)
  ROOT %dot.3 = bf16[64,8]{{1,0}} dot(bf16[64,32]{{1,0}} %param_0.3, bf16[32,8]{{1,0}} %param_1.3), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (p: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {{
  %p = (s32[], bf16[64,32]{{1,0}}) parameter(0)
  ROOT %tuple.1 = (s32[], bf16[64,32]{{1,0}}) tuple(%p)
}}

%cond (p.1: (s32[], bf16[64,32])) -> pred[] {{
  %p.1 = (s32[], bf16[64,32]{{1,0}}) parameter(0)
  ROOT %constant.1 = pred[] constant(true)
}}

ENTRY %main.1 (Arg_0.1: bf16[64,32], Arg_1.1: bf16[32,16]) -> bf16[64,16] {{
  %Arg_0.1 = bf16[64,32]{{1,0}} parameter(0)
  %Arg_1.1 = bf16[32,16]{{1,0}} parameter(1)
  %gemm_fusion.2 = bf16[64,16]{{1,0}} fusion(bf16[64,32]{{1,0}} %Arg_0.1, bf16[32,16]{{1,0}} %Arg_1.1), kind=kCustom, calls=%fused_gemm, metadata={{op_name="{STEP}/moe/shard_map/dot_general"}}
  %custom-call.4 = (bf16[64,16]{{1,0}}, s8[1024]{{0}}) custom-call(bf16[64,32]{{1,0}} %Arg_0.1), custom_call_target="mosaic_gpu_v2", metadata={{op_name="{STEP}/moe/shard_map/pallas_call"}}
  %loop_multiply_fusion = f32[64,8]{{1,0}} fusion(f32[64,16]{{1,0}} %x), kind=kLoop, calls=%fused_swiglu, metadata={{op_name="{STEP}/moe/shard_map/mul"}}
  %router_fusion = bf16[64,8]{{1,0}} fusion(%Arg_0.1, %r), kind=kCustom, calls=%fused_router, metadata={{op_name="{STEP}/moe/router/dot_general"}}
  %custom-call.5 = (bf16[2,64,4,8]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", metadata={{op_name="{STEP}/attention/dot_product_attention"}}
  %cublas-gemm.6 = (bf16[64,32]{{1,0}}, s8[4194304]{{0}}) custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={{op_name="{STEP}/projection/dot_general"}}
  %loop_add_fusion.7 = bf16[64,32]{{1,0}} fusion(%a), kind=kLoop, calls=%fused_swiglu, metadata={{op_name="{STEP}/norm/add"}}
  %lm_fusion.8 = f32[64,16]{{1,0}} fusion(%a), kind=kCustom, calls=%fused_gemm, metadata={{op_name="jit(train_step)/transpose(jvp(lm_head))/shard_map/while/body/dot_general"}}
  %adam_fusion.9 = bf16[64,32]{{1,0}} fusion(%a), kind=kLoop, calls=%fused_swiglu, metadata={{op_name="jit(train_step)/optimizer/mul"}}
  %copy.10 = bf16[64,32]{{0,1}} copy(%a), metadata={{op_name="{STEP}/moe/shard_map/transpose"}}
  %transpose_fusion.11 = bf16[16,64]{{0,1}} fusion(%a), kind=kLoop, calls=%fused_transpose
  %collective-permute-start.12 = (bf16[64,32]{{1,0}}, bf16[64,32]{{1,0}}) collective-permute-start(%a), channel_id=1, source_target_pairs={{{{0,1}},{{1,0}}}}, metadata={{op_name="{STEP}/moe/shard_map/ppermute"}}
  %all-reduce-start.13 = f32[8]{{0}} all-reduce-start(%g), channel_id=2, replica_groups={{}}, to_apply=%add, metadata={{op_name="{STEP}/lm_head/psum"}}
  %while.14 = (s32[], bf16[64,32]{{1,0}}) while(%t), condition=%cond, body=%body
  %pallas_call.15 = bf16[8,64,64]{{2,1,0}} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="{STEP}/deltanet/pallas_call" scheduling_name="pallas_call.15"}}, backend_config={{debug_options=x, name = "gated_delta_chunk_wy", num_stages = 1 : i32}}
  %pallas_call.16 = bf16[8,64,64]{{2,1,0}} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="{STEP}/checkpoint/deltanet/pallas_call"}}, backend_config={{name = "gated_delta_chunk_wy", num_stages = 1 : i32}}
  ROOT %wrapped_exp = bf16[64,16]{{1,0}} fusion(%a), kind=kLoop, calls=%fused_swiglu, metadata={{op_name="{STEP}/jit(silu)/exp"}}
}}
"""

# (kernel name, HLO op, start µs, duration µs, the part it goes to) on the first GPU's compute stream, two steps
KERNELS = [("sm90_gemm_grouped", "gemm_fusion.2", 0, 1000, "moe_matmul"),
           ("mosaic_gpu_kernel", "custom-call.4", 1000, 1000, "moe_matmul"),
           ("loop_multiply_fusion", "loop_multiply_fusion", 2000, 500, "moe_other"),
           ("router_gemm", "router_fusion", 2500, 500, "moe_other"),
           ("cudnn_flash_fprop", "custom-call.5", 3000, 2000, "attention"),
           ("sm90_xmma_gemm", "cublas-gemm.6", 5000, 1000, "projection"),
           ("loop_add_fusion_7", "loop_add_fusion.7", 6000, 250, "other"),
           ("wrapped_exp", "wrapped_exp", 6250, 250, "other"),
           ("lm_gemm", "lm_fusion.8", 6500, 3000, "lm_head"),
           ("adam_fusion_9", "adam_fusion.9", 9500, 500, "optimizer"),
           ("copy_10", "copy.10", 10000, 250, "copy"),
           ("transpose_fusion_11", "transpose_fusion.11", 10250, 250, "copy"),
           ("ncclDevKernel_SendRecv", "collective-permute-start.12", 10500, 1500, "communication"),
           ("ncclDevKernel_AllReduce", "all-reduce-start.13", 12000, 500, "communication"),
           ("loop_add_fusion_7", "command_buffer.3", 12500, 500, "other"),  # a CUDA graph's: by its kernel's name
           # A graph's kernels no instruction is named after (cuBLAS, Mosaic): the part of the graph's named kernels
           # with matmuls that holds the most time, a grouped matmul in the MoE, else the graph's most.
           ("loop_multiply_fusion", "command_buffer.4", 16000, 300, "moe_other"),
           ("lm_fusion_8", "command_buffer.4", 16300, 100, "lm_head"),
           ("loop_add_fusion_7", "command_buffer.4", 16400, 900, "other"),
           ("sm90_xmma_gemm_bf16", "command_buffer.4", 17300, 700, "moe_matmul"),
           ("adam_fusion_9", "command_buffer.5", 18000, 100, "optimizer"),
           ("nvjet_kernel", "command_buffer.5", 18100, 100, "optimizer"),
           ("nvjet_kernel", "command_buffer.6", 18200, 100, "unattributed"),  # a graph of no named kernel
           # A library's kernel takes the part of that library's custom calls where they are all in one (cuDNN's
           # in attention, Mosaic GPU's in the MoE's matmuls), whatever else its graph holds; a memcpy is a copy.
           ("loop_add_fusion_7", "command_buffer.7", 18300, 400, "other"),
           ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "command_buffer.7", 18700, 300, "attention"),
           ("body_mosaic_gpu_kernel", "command_buffer.7", 19000, 200, "moe_matmul"),
           ("memcpy32_post", "command_buffer.7", 19200, 100, "copy"),
           # A Pallas (Triton) kernel in a graph takes its custom calls' part, found by the kernel's name (XLA's
           # "__1" suffix on a second of the name removed), not the part that holds most of the graph's time.
           ("loop_multiply_fusion", "command_buffer.8", 19300, 300, "moe_other"),
           ("gated_delta_chunk_wy", "command_buffer.8", 19600, 200, "deltanet"),
           ("gated_delta_chunk_wy__1", "command_buffer.8", 19800, 100, "deltanet"),
           ("some_kernel", "fusion.999", 13000, 500, "unattributed")]  # no such HLO instruction


def _write_trace(path, events):
  with gzip.open(path, "wt") as fh:
    json.dump({"traceEvents": events}, fh)
  return str(path)


def _gpu_trace(tmp_path):
  """Two steps of KERNELS 20 ms apart on GPU:0's stream, beside what must not count: GPU:1, the derived "XLA Ops"
  line, another module's kernel, and a host-to-device memcpy that does (no module: a copy)."""
  meta = [dict(ph="M", pid=pid, name="process_name", args=dict(name=name))
          for pid, name in [(1, "/host:CPU"), (2, "/device:GPU:0"), (3, "/device:GPU:1")]]
  meta += [dict(ph="M", pid=2, tid=tid, name="thread_name", args=dict(name=name))
           for tid, name in [(13, "Stream #13(compute)"), (99, "XLA Ops")]]
  events = []
  for step in range(2):
    for name, op, start, dur, _ in KERNELS:
      args = dict(hlo_op=op, hlo_module="jit_train_step", correlation_id="1")
      ts = step * 20000 + start
      events += [dict(ph="X", pid=2, tid=13, ts=ts, dur=dur, name=name, args=args),
                 dict(ph="X", pid=2, tid=99, ts=ts, dur=dur, name=op, args=args),
                 dict(ph="X", pid=3, tid=13, ts=ts, dur=dur, name=name, args=args)]
    events += [dict(ph="X", pid=2, tid=13, ts=step * 20000 + 14000, dur=1000, name="MemcpyH2D", args={}),
               dict(ph="X", pid=2, tid=13, ts=step * 20000 + 15000, dur=700, name="other",
                    args=dict(hlo_op="fusion.1", hlo_module="jit_other"))]
  return _write_trace(tmp_path / "perfetto_trace.json.gz", meta + events)


def test_every_part_is_attributed_from_the_hlo_op_metadata(tmp_path):
  events = op_events(_gpu_trace(tmp_path), "jit_train_step")
  profile = step_parts(events, HLO, steps=2, wall_s=0.04)
  expected = {part: 0.0 for part in PARTS}
  for *_, dur, part in KERNELS:
    expected[part] += dur / 1e3
  expected["copy"] += 1.0  # the memcpy
  assert {p: row["ms"] for p, row in profile["parts"].items()} == pytest.approx(expected, abs=1e-9)
  assert profile["parts"]["moe_matmul"]["launches"] == 4 and profile["parts"]["copy"]["launches"] == 4
  assert profile["parts"]["deltanet"]["launches"] == 2
  assert (profile["busy_ms"], profile["kernel_ms"], profile["step_ms"], profile["idle_ms"]) == pytest.approx(
      (18.4, 18.4, 20, 1.6))
  # A CUDA graph's kernels are listed by their own instruction (or kernel), not by the graph: lm_fusion.8 ran once
  # on its own and once in a graph each step.
  assert profile["parts"]["lm_head"]["top"][0][:3] == ("lm_fusion.8", 3.1, 2)
  other = {op: (ms, n) for op, ms, n, _ in profile["parts"]["other"]["top"]}
  assert other["loop_add_fusion.7"] == (0.25 + 0.5 + 0.9 + 0.4, 4)
  assert not any(op.startswith("command_buffer") for op in other)
  moe_matmul = [tuple(row[:3]) for row in profile["parts"]["moe_matmul"]["top"]]
  assert ("sm90_xmma_gemm_bf16", 0.7, 1) in moe_matmul and ("body_mosaic_gpu_kernel", 0.2, 1) in moe_matmul


CACHE_HITS = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np
    from jax._src import monitoring
    from train.profile.step_parts import full_op_names
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    hits = []
    monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
    def compiled_hits():
      jax.clear_caches()
      jax.jit(lambda x: jnp.sin(x) * 2).lower(np.ones(8, np.float32)).compile()
      return len(hits)
    before = compiled_hits(), compiled_hits()
    with full_op_names():
      profiled = compiled_hits()
    print(*before, profiled, compiled_hits())
    """)


def test_a_profiled_step_is_compiled_not_read_back_from_the_persistent_cache(tmp_path):
  """JAX's cache key leaves the op_name metadata out: a step cached by a run that did not profile read back without
  the names the parts come from. (A subprocess: the test process runs without the persistent cache.)"""
  run = subprocess.run([sys.executable, "-c", CACHE_HITS, str(tmp_path / "xla")], capture_output=True, text=True,
                       cwd=str(pathlib.Path(__file__).parents[1]), timeout=120)
  assert run.returncode == 0, run.stderr
  assert run.stdout.split() == ["0", "1", "1", "2"]  # cached, read back, compiled while profiling, read back


def test_hlo_opcodes_and_called_computations_are_read():
  instructions = parse_hlo(HLO)
  assert instructions["collective-permute-start.12"].opcode == "collective-permute-start"
  assert instructions["custom-call.4"].opcode == "dot"  # a Mosaic GPU kernel counts as a matmul
  assert instructions["custom-call.5"].opcode == "custom-call"
  assert instructions["gemm_fusion.2"].contains == {"parameter", "dot"}
  assert instructions["while.14"].contains == {"parameter", "tuple", "constant"}
  assert instructions["lm_fusion.8"].op_name.endswith("transpose(jvp(lm_head))/shard_map/while/body/dot_general")


def test_a_cpu_trace_counts_the_first_devices_ops_not_their_loops(tmp_path):
  """XLA:CPU: ops on host threads with their device ordinal; a while loop's event holds its body's."""
  def op(name, ts, dur, device="0", module="jit_train_step"):
    return dict(ph="X", pid=1, tid=7 + int(device), ts=ts, dur=dur, name=name,
                args=dict(hlo_op=name, hlo_module=module, device_ordinal=device))

  events = [dict(ph="M", pid=1, name="process_name", args=dict(name="/host:CPU")),
            op("while.14", 0, 3000), op("gemm_fusion.2", 100, 1000), op("lm_fusion.8", 1500, 1000),
            op("gemm_fusion.2", 0, 5000, device="1"), op("fusion.1", 0, 5000, module="jit_other")]
  profile = step_parts(op_events(_write_trace(tmp_path / "t.json.gz", events), "jit_train_step"), HLO, 1, 0.004)
  assert profile["parts"]["moe_matmul"]["ms"] == 1.0 and profile["parts"]["lm_head"]["ms"] == 1.0
  assert profile["kernel_ms"] == 2.0 and profile["idle_ms"] == 2.0


def test_a_bad_profile_window_is_one_line_naming_it(capsys):
  for bad in ["3", "a:2", "2:0", "-1:2", "2:3:4"]:
    with pytest.raises(ValueError, match=re.escape(f"--profile {bad!r}: expected START:COUNT")):
      parse_window(bad)
  assert parse_window("2:3") == Window(2, 3)
  with pytest.raises(SystemExit) as exit_:
    cli.main(["--profile", "2-3", "--steps", "4"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      "relaymoe-train: error: --profile '2-3': expected START:COUNT, the first step to profile and how many "
      "(integers, COUNT at least 1), e.g. --profile 2:3"]
  with pytest.raises(ValueError, match="profiles steps 3-5, and this run trains steps 0-4"):
    check_window(Window(3, 3), 0, 5)
  with pytest.raises(ValueError, match="profiles steps 1-2, and this run trains steps 2-9"):
    check_window(Window(1, 2), 2, 10)
  check_window(Window(2, 3), 0, 5)


TINY = ["batch_size=8", "seq_len=16", "tensorboard=false", "checkpoint_every=0"]


def _assert_a_real_step_profile(result, communication=True):
  parts = {p: row["ms"] for p, row in result["parts"].items()}
  for part in ("lm_head", "attention", "moe_matmul", "moe_other", "projection", "other", "optimizer",
               *(["communication"] if communication else [])):
    assert parts[part] > 0, (part, parts)
  assert parts["unattributed"] == 0, parts
  assert sum(parts.values()) == pytest.approx(result["kernel_ms"], abs=0.01)
  assert 0 < result["busy_ms"] <= result["kernel_ms"] + 0.01 and result["busy_ms"] < result["step_ms"]
  assert result["tokens_per_s"] > 0 and result["window"] == [2, 2]


@pytest.mark.slow  # trains a step of its own (compiles ~20-40 s on 2 cores); CI's second step runs it
def test_relaymoe_train_profile_writes_a_trace_and_prints_the_table(tmp_path, capsys):
  requires_devices(8)
  cli.main(["--config", "cpu", "--steps", "4", "--profile", "2:2", "--out", str(tmp_path / "run"), *TINY])
  out = capsys.readouterr().out
  assert list((tmp_path / "run" / "profile").glob("**/perfetto_trace.json.gz"))
  result = json.loads((tmp_path / "run" / "profile" / "parts.json").read_text())
  _assert_a_real_step_profile(result)
  assert "profile of steps 2-3 on the first device" in out
  assert f"| LM head and loss | {result['parts']['lm_head']['ms']:.2f} |" in out and "| idle (step less" in out


@pytest.mark.slow  # trains a step of its own (compiles ~20-40 s on 2 cores); CI's second step runs it
def test_train_step_benchmark_writes_its_table_and_summary(tmp_path, capsys):
  requires_devices(8)
  path = tmp_path / "train_step.json"
  train_step.main(["--config", "cpu", "--warmup", "2", "--steps", "2", "--out", str(path), *TINY])
  last = capsys.readouterr().out.strip().splitlines()[-1]
  result = json.loads(path.read_text())["profile"]
  _assert_a_real_step_profile(result)
  fields = dict(re.findall(r"(\w+)=([^ ]+)", last))
  assert last.startswith("summary: train_step cpu 8x16 mfu=nan ")  # CPU devices have no known peak
  assert float(fields["head_ms"]) == pytest.approx(result["parts"]["lm_head"]["ms"], abs=0.05)
  assert float(fields["attention_ms"]) == pytest.approx(result["parts"]["attention"]["ms"], abs=0.05)
  assert path.with_suffix(".txt").read_text().strip().endswith(last)


def test_train_step_results_are_named_by_config_dispatcher_and_head():
  assert train_step.run_name("ep8", "ring_expert") == "ep8"
  assert train_step.run_name("configs/runs/ep8.yaml", "all_to_all") == "ep8_a2a"
  assert train_step.run_name("ep8", "ring_token") == "ep8_ring_token"
  assert train_step.run_name("ep8", "all_to_all", "per_token") == "ep8_a2a_per_token_head"


@pytest.mark.slow  # four compiles of the tiny model's loss (~40 s on 2 cores); CI's second step runs it
def test_the_per_token_head_is_the_same_loss_and_gradients_and_is_put_back():
  """`--head per_token` steps the trainer with the head it had before (per-token, recomputing), the same loss and
  gradients (float32, within 1e-6), counted targets or all; after it the model's own head is back."""
  requires_devices(8)
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  runtime = RuntimeConfig(dtype="float32", loss_chunk_tokens=8)
  graphdef, state = nnx.split(qwen3.create_sharded(load_config("tiny", num_hidden_layers=1), mesh, runtime=runtime))
  rng = np.random.default_rng(0)
  tokens = jax.numpy.asarray(rng.integers(0, 128, (8, 17)), jax.numpy.int32)
  weights = jax.numpy.asarray(rng.random((8, 16)) < 0.7)

  def loss_and_grads(weights_BS):
    loss = lambda p: nnx.merge(graphdef, p).mean_cross_entropy_and_aux(tokens[:, :-1], tokens[:, 1:],
                                                                        weights_BS=weights_BS)[0]
    return jax.jit(jax.value_and_grad(loss))(state)

  own = qwen3.Qwen3MoE.mean_cross_entropy_and_aux
  expected = [loss_and_grads(w) for w in (None, weights)]
  with train_step.loss_head("per_token"):
    assert qwen3.Qwen3MoE.mean_cross_entropy_and_aux is not own
    actual = [loss_and_grads(w) for w in (None, weights)]
  assert qwen3.Qwen3MoE.mean_cross_entropy_and_aux is own
  for name, a, e in zip(("all targets", "counted targets"), actual, expected):
    assert_close(nnx.to_pure_dict(a[1]), nnx.to_pure_dict(e[1]), 1e-6, f"{name} gradients")
    assert_close(a[0], e[0], 1e-6, f"{name} loss")


@pytest.mark.gpu
def test_a_gpu_trace_maps_every_kernel_to_the_step_hlo(tmp_path):
  """On one GPU: every kernel of the step found in its HLO (the trace's hlo_op), each model part present."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  cli.main(["--config", "cpu", "--steps", "4", "--profile", "2:2", "--out", str(tmp_path / "run"), "mesh.data=1",
            "mesh.expert=1", "runtime.dtype=bfloat16", *TINY])
  _assert_a_real_step_profile(json.loads((tmp_path / "run" / "profile" / "parts.json").read_text()),
                              communication=False)
