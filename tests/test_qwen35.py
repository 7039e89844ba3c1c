"""Qwen3.5-MoE (`models.qwen35`): the tiny transformers checkpoints of tests/fixtures/hf (text-only
`qwen3_5_moe_text`, experts per expert; multimodal `qwen3_5_moe`, fused experts, `model.visual.*` and `mtp.*` left
out) import to transformers' logits at sequence lengths that are and are not multiples of the DeltaNet's chunk of
64, under every dispatcher; the export reads back the same; packed documents are independent; the hybrid layers
stack as repeats of their pattern; the trainer's FLOPs count the DeltaNet and the attention gate."""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import requires_devices, trainer_mesh
import relaymoe_jax as rm
import relaymoe_jax.testing as rmt
from models import families
from models.config import read_hf_config
from models.hf import transfer as hf
from models.qwen3.mlp import MoE
from models.qwen35 import deltanet as qwen35_deltanet
from models.qwen35.config import FULL, LINEAR, layer_groups
from models.runtime import RuntimeConfig
from models.spans import Spans
from relaymoe_jax.errors import UserError
from train.config import EvalConfig, MeshConfig, load_run_config
from train.loop import run
from train.mesh import build_mesh
from train.profile.step_parts import full_op_names, parse_hlo, part_of
from train.step import delta_flops, layer_forward_flops, mean_layer_flops

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
TEXT, MULTIMODAL = "qwen3_5_moe_text", "qwen3_5_moe"
# The fixture is conditioned (small random weights) so float32 rounding stays near 1e-6: transformers' own float32 and
# float64 logits differ by 5.6e-7. A float32 port is held to 1e-5; a wrong op is off by far more.
LOGITS_ATOL = 1e-5
ROWS = 8  # the fixture's 2 rows repeated, so every one of the 8 devices holds a row


@pytest.fixture(autouse=True)
def _eight_devices(request):
  if not request.node.get_closest_marker("gpu"):
    requires_devices(8)
  elif jax.default_backend() != "gpu":
    pytest.skip("needs a GPU; run `pytest -m gpu` there")


@functools.cache
def _reference(length):
  ref = np.load(FIXTURES / TEXT / "reference.npz")
  return (np.tile(ref["tokens"][:, :length], (ROWS // 2, 1)).astype(np.int32),
          np.tile(ref["logits"][:, :length], (ROWS // 2, 1, 1)))


@functools.cache
def _loaded(family=TEXT, **runtime):
  return hf.from_hf(FIXTURES / family, mesh=trainer_mesh(),
                    runtime=RuntimeConfig(**{"dtype": "float32", "dispatcher": "dense", **runtime}))


_logits = nnx.jit(lambda model, tokens, segment_ids=None: model(tokens, segment_ids))


@pytest.mark.parametrize("family,length", [(TEXT, 100), (MULTIMODAL, 64),
                                           pytest.param(TEXT, 64, marks=pytest.mark.slow),
                                           pytest.param(MULTIMODAL, 136, marks=pytest.mark.slow)])
def test_import_gives_transformers_logits(family, length):
  tokens, expected = _reference(length)
  assert np.abs(np.asarray(_logits(_loaded(family), tokens)) - expected).max() <= LOGITS_ATOL


@pytest.mark.parametrize("dispatcher", [d if d == "ring_expert" else pytest.param(d, marks=pytest.mark.slow)
                                        for d in sorted(set(rm.DISPATCHERS) - {"dense"})])
def test_every_dispatcher_gives_transformers_logits(dispatcher):
  tokens, expected = _reference(136)
  assert np.abs(np.asarray(_logits(_loaded(dispatcher=dispatcher), tokens)) - expected).max() <= LOGITS_ATOL


def test_both_checkpoint_layouts_load_the_same_parameters():
  ours = [nnx.to_pure_dict(nnx.state(_loaded(f), nnx.Param)) for f in (TEXT, MULTIMODAL)]
  for a, b in zip(jax.tree.leaves(ours[0]), jax.tree.leaves(ours[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_multimodal_checkpoints_extras_are_named_as_left_out(caplog):
  hf.from_hf(FIXTURES / MULTIMODAL, mesh=trainer_mesh(), runtime=RuntimeConfig(dtype="float32", dispatcher="dense"))
  assert "model.visual.* (21 tensors), mtp.* (41 tensors)" in caplog.text


@functools.cache
def _random(**runtime):
  """The tiny config's model with its own initialisation: small weights, so float32 rounding stays near 1e-7 (the
  fixture's random weights amplify it to 4e-4 between two compiles of the same model)."""
  return families.create_sharded(families.load_config("qwen3.5-tiny"), trainer_mesh(),
                                 runtime=RuntimeConfig(**{"dtype": "float32", "dispatcher": "dense", **runtime}))


def _random_tokens(length):
  return np.random.default_rng(0).integers(0, 128, (ROWS, length)).astype(np.int32)


def test_the_pallas_delta_kernels_give_transformers_logits(monkeypatch):
  """The DeltaNet's loop over chunks as Pallas kernels (what GPUs run; Pallas' interpreter here) on each device's
  rows (`on_row_shards`: XLA cannot partition a Pallas call)."""
  monkeypatch.setattr(qwen35_deltanet, "delta_state_kernel", lambda runtime, platform: "pallas")
  tokens, expected = _reference(100)
  logits = nnx.jit(lambda model, tokens: model(tokens))(_loaded(), tokens)  # traced afresh, with the kernels
  assert np.abs(np.asarray(logits) - expected).max() <= LOGITS_ATOL


@pytest.mark.parametrize("kernel", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_layers_in_spans_give_transformers_logits(monkeypatch, kernel):
  """Rows of 100 in spans of 24, the last padded (`runtime.sequence_span_tokens`): the DeltaNet layers, the conv's
  history carried across spans, and the attention's gated output projection; with the DeltaNet's Pallas kernels too
  (what GPUs run)."""
  monkeypatch.setattr(qwen35_deltanet, "delta_state_kernel", lambda runtime, platform: kernel)
  tokens, expected = _reference(100)
  logits = nnx.jit(lambda model, tokens: model(tokens))(_loaded(sequence_span_tokens=24), tokens)  # traced afresh
  assert np.abs(np.asarray(logits) - expected).max() <= LOGITS_ATOL


@functools.cache
def _moe_gradients(**runtime):
  """(loss, gradients of x and every parameter) of one Qwen3.5 MoE layer on random rows of 40 positions."""
  rng = np.random.default_rng(0)
  config = families.load_config("qwen3.5-tiny")
  x, r = (jnp.asarray(rng.standard_normal((ROWS, 40, config.hidden_size)), jnp.float32) for _ in range(2))
  graphdef, params, rest = nnx.split(MoE(config, RuntimeConfig(dtype="float32", **runtime), trainer_mesh(),
                                         nnx.Rngs(0)), nnx.Param, ...)

  def loss(params, x):
    return jnp.sum(nnx.merge(graphdef, params, rest)(x)[0] * r)

  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
  return float(value), grads


def test_the_rings_shared_expert_in_spans_trains_as_dense():
  """Under a ring, rows in spans run the shared expert outside `moe_ffn`, a span at a time (`MoE`): loss and the
  gradients of x and of every parameter (the shared expert's and its gate's among them) as the dense dispatcher's,
  whose shared expert runs in `moe_ffn` on whole rows."""
  moe = MoE(families.load_config("qwen3.5-tiny"), RuntimeConfig(dispatcher="ring_expert", sequence_span_tokens=16),
            trainer_mesh(), nnx.Rngs(0))
  assert moe._shared_expert_spans(40) == Spans(chunks=1, chunk=40, count=3, length=16)  # the last one padded
  loss, grads = _moe_gradients(dispatcher="ring_expert", sequence_span_tokens=16)
  loss_ref, grads_ref = _moe_gradients(dispatcher="dense")
  assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref), (loss, loss_ref)
  rmt.assert_trees_close(grads, grads_ref, 1e-5)


def test_unscanned_layers_give_transformers_logits():
  tokens, expected = _reference(100)
  assert np.abs(np.asarray(_logits(_loaded(scan_layers=False), tokens)) - expected).max() <= LOGITS_ATOL


def test_export_reads_back_the_same_model(tmp_path):
  model = _loaded(MULTIMODAL)
  hf.to_hf(model, tmp_path, max_shard_bytes=200_000)
  config = read_hf_config(tmp_path)[0]
  assert config["model_type"] == TEXT and config["layer_types"][3] == FULL
  back = hf.from_hf(tmp_path, mesh=trainer_mesh(), runtime=model.runtime)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_packed_documents_are_independent():
  """A document's logits do not depend on what precedes it in the row: the DeltaNet state and conv window restart,
  positions restart for RoPE, attention is masked."""
  tokens = _random_tokens(100)
  segment_ids = np.repeat(np.array([[0] * 37 + [1] * 63]), ROWS, axis=0).astype(np.int32)
  packed = np.asarray(_logits(_random(), tokens, segment_ids))
  shuffled = tokens.copy()
  shuffled[:, :37] = np.roll(tokens[:, :37], 5, axis=1)  # another first document: the second's logits stay
  np.testing.assert_allclose(np.asarray(_logits(_random(), shuffled, segment_ids))[:, 37:], packed[:, 37:], atol=1e-6)
  unpacked = np.asarray(_logits(_random(), shuffled))
  assert np.abs(unpacked[:, 37:] - packed[:, 37:]).max() > 1e-3  # without documents the first one is seen


def test_layers_stack_as_repeats_of_the_pattern():
  config = families.load_config("qwen3.5-35b-a3b")
  assert config.layer_types[:4] == (LINEAR, LINEAR, LINEAR, FULL) and config.layer_types.count(FULL) == 10
  assert layer_groups(config, RuntimeConfig()) == [(0, 10, 4)]
  remat = ("layer",) * 8 + ("none",) * 32
  assert layer_groups(config, RuntimeConfig(remat=remat)) == [(0, 2, 4), (8, 8, 4)]
  assert len(layer_groups(config, RuntimeConfig(scan_layers=False))) == 40


def test_flops_count_the_deltanet_and_the_attention_gate():
  """Megatron's count for the 35B shape: 71.63 MFLOP per token for a DeltaNet layer's forward (projections 67.37,
  conv 0.066, core 8·32·128·128); the gated attention's projections 54.53 MFLOP."""
  config = families.load_config("qwen3.5-35b-a3b")
  assert delta_flops(config) == pytest.approx(71.63e6, rel=1e-3)
  attention, _ = layer_forward_flops(config, 0, 3)
  assert attention == pytest.approx(54.53e6, rel=1e-3)
  # The planner's means: a DeltaNet layer keeps no attention kernel's outputs, so only the 10 attention layers' scores
  # are what `all_but_attention` saves recomputing.
  mean_attention, _, scores = mean_layer_flops(config, 4096)
  assert scores == pytest.approx(10 / 40 * 2 * 4096 * 16 * 256)
  assert mean_attention == pytest.approx((30 * delta_flops(config) + 10 * layer_forward_flops(config, 4096, 3)[0]) / 40)


@pytest.mark.parametrize("value", [-1, 0.5, "auto"])
def test_a_bad_span_is_named(value):
  with pytest.raises(UserError, match=f"sequence_span_tokens={value!r} must be an integer ≥ 0"):
    RuntimeConfig(sequence_span_tokens=value)


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention"]), "layer_types has 1 entries"),
    (dict(layer_types=["sliding"] * 4), "layer_types ['sliding'] unknown"),
    (dict(linear_num_value_heads=3), "not a multiple of linear_num_key_heads"),
    (dict(model_type="qwen4"), "model_type 'qwen4' unknown"),
])
def test_bad_config_is_named(change, message):
  with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
    families.load_config("qwen3.5-tiny", **change)


@pytest.mark.hf
def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
  """Our export of the multimodal fixture's text model loads as `Qwen3_5MoeForCausalLM` and gives its logits."""
  torch = pytest.importorskip("torch", reason="needs torch (pip install '.[hf]')")
  transformers = pytest.importorskip("transformers", reason="needs transformers (pip install '.[hf]')")
  hf.to_hf(_loaded(MULTIMODAL), tmp_path, max_shard_bytes=200_000)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                             experts_implementation="eager").to(torch.float32)
  tokens, expected = _reference(100)
  with torch.no_grad():
    logits = theirs(torch.as_tensor(tokens[:2], dtype=torch.long), use_cache=False).logits.numpy()
  assert type(theirs).__name__ == "Qwen3_5MoeForCausalLM"
  np.testing.assert_allclose(logits, expected[:2], atol=1e-5)


def _worst_leaf(low, high):
  """max over leaves of max |low − high| / max |high|."""
  return max(np.abs(low[k] - high[k]).max() / np.abs(high[k]).max() for k in high)


@pytest.mark.hf
def test_bf16_gradients_stray_from_float32_about_as_far_as_transformers_own(tmp_path):
  """The 256-wide model at random init: our bfloat16 compute's gradients against our float32 ones, worst leaf, within
  1.5x of transformers' own bfloat16 against float32 on the same weights (measured: ours 0.57, transformers' 0.44;
  near-zero gradients of a random model make the ratio large for both)."""
  torch = pytest.importorskip("torch", reason="needs torch (pip install '.[hf]')")
  transformers = pytest.importorskip("transformers", reason="needs transformers (pip install '.[hf]')")
  config, mesh = _wide_config(), build_mesh(MeshConfig(data=1, expert=1, tensor=1), jax.devices()[:1])
  tokens = np.random.default_rng(0).integers(0, 512, (2, 257)).astype(np.int32)

  def ours(dtype):
    model = families.create_sharded(config, mesh, runtime=RuntimeConfig(dispatcher="dense", dtype=dtype))
    graphdef, params = nnx.split(model)
    loss = lambda p: nnx.merge(graphdef, p).mean_cross_entropy_and_aux(tokens[:, :-1], tokens[:, 1:])[0]
    grads = jax.jit(jax.grad(loss))(nnx.to_pure_dict(params))
    return model, {jax.tree_util.keystr(k): np.asarray(g, np.float32) for k, g in
                   jax.tree_util.tree_leaves_with_path(grads)}

  model, high = ours("float32")
  ours_drift = _worst_leaf(ours("bfloat16")[1], high)
  hf.to_hf(model, tmp_path)

  def theirs(dtype):
    net = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).to(dtype)
    t = torch.as_tensor(tokens, dtype=torch.long)
    logits = net(t[:, :-1], use_cache=False).logits.float()
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1)).backward()
    return {n: p.grad.detach().float().numpy() for n, p in net.named_parameters() if p.grad is not None}

  their_drift = _worst_leaf(theirs(torch.bfloat16), theirs(torch.float32))
  assert ours_drift <= 1.5 * their_drift, (ours_drift, their_drift)


def _wide_config():
  """qwen3.5-tiny at width 256 (heads of 64): where bfloat16 rounding is typical of a real model's."""
  return dataclasses.replace(families.load_config("qwen3.5-tiny"), vocab_size=512, hidden_size=256,
                             moe_intermediate_size=256, shared_expert_intermediate_size=256, head_dim=64,
                             linear_key_head_dim=64, linear_value_head_dim=64)


@functools.lru_cache(maxsize=None)
def _gpu_gradients(dispatcher, span_tokens=0):
  """(loss, every parameter's gradient) of a 4-layer Qwen3.5 on one GPU, 4 × 512 tokens, in float32 (in bf16 this
  model's gradients are 0.46, max |a − b| / max |b| of a leaf, from float32's for the dense dispatcher itself, too
  coarse to tell a wrong dispatcher), its rows in spans of `span_tokens` (0: whole)."""
  config = _wide_config()
  mesh = build_mesh(MeshConfig(data=1, expert=1, tensor=1), jax.devices()[:1])
  runtime = RuntimeConfig(dispatcher=dispatcher, dtype="float32", sequence_span_tokens=span_tokens)
  graphdef, params = nnx.split(families.create_sharded(config, mesh, runtime=runtime))
  tokens = np.random.default_rng(0).integers(0, 512, (4, 513)).astype(np.int32)

  def loss(params):
    return nnx.merge(graphdef, params).mean_cross_entropy_and_aux(tokens[:, :-1], tokens[:, 1:])[0]

  value, grads = jax.jit(jax.value_and_grad(loss))(nnx.to_pure_dict(params))
  return float(value), jax.tree.map(lambda g: np.asarray(g, np.float32), grads)


@pytest.mark.gpu
@pytest.mark.parametrize("dispatcher, span_tokens", [("ring_expert", 128), ("all_to_all", 0)])
def test_on_a_gpu_each_dispatcher_trains_qwen35_as_dense(dispatcher, span_tokens):
  """Loss within 1e-5 and every parameter's gradient within 2e-3 (max |a − b| / max |b|) of the dense dispatcher's
  on whole rows (on CPU: 3.6e-4; two swapped experts move a leaf by O(1)); the ring's rows in 4 spans of 128
  (`models.spans`: the scan, the state and the conv's history carried across spans, on the GPU's kernels, and the
  ring's shared expert one span at a time)."""
  loss, grads = _gpu_gradients(dispatcher, span_tokens)
  loss_ref, grads_ref = _gpu_gradients("dense")
  assert np.isfinite(loss) and abs(loss - loss_ref) <= 1e-5 * loss_ref, (loss, loss_ref)
  rmt.assert_trees_close(grads, grads_ref, 2e-3)


def test_the_step_profile_names_the_deltanet_a_part_of_its_own():
  """The compiled forward's DeltaNet instructions (its conv, gates and delta rule) go to the part `deltanet`, the
  gated attention's to `attention`, the MoE's to its two parts."""
  model = _random()
  tokens = _random_tokens(64)
  graphdef, state = nnx.split(model)
  with full_op_names(True):
    hlo = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, tokens).compile().as_text()
  parts = {part_of(i) for i in parse_hlo(hlo).values()}
  assert {"deltanet", "attention", "moe_matmul", "moe_other", "projection"} <= parts, parts


@pytest.mark.slow  # two short trainer runs (~40 s on 2 cores); CI's second step runs it
def test_remat_policies_accumulation_and_eval_train_qwen35_as_the_plain_step(tmp_path):
  """A remat policy per layer (all four kinds that differ on CPU), two micro-batches and a held-out evaluation give
  the plain step's losses (same seed, same batches)."""
  base = dataclasses.replace(load_run_config("cpu", ["model=qwen3.5-tiny"]), steps=4, log_every=1,
                             checkpoint_every=0, seq_len=32, tensorboard=False)
  plain = run(dataclasses.replace(base, out_dir=str(tmp_path / "plain")))
  varied = run(dataclasses.replace(
      base, out_dir=str(tmp_path / "varied"), micro_batches=2, eval=EvalConfig(every=2, batches=1),
      runtime=dataclasses.replace(base.runtime, remat=("layer", "attention", "all_but_attention", "none"))))
  losses = [r["loss"] for r in varied if "loss" in r]
  np.testing.assert_allclose(losses, [r["loss"] for r in plain], rtol=1e-5)
  logged = [json.loads(line) for line in (tmp_path / "varied" / "metrics.jsonl").read_text().splitlines()]
  assert [np.isfinite(r["eval_loss"]) for r in logged if "eval_loss" in r] == [True, True]
