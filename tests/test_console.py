"""What `relaymoe-train` tells a person: every run key in `--help` (from the config dataclasses), the run as resolved
(`--print-config`), and the lines of a run (the dispatcher, documents, held-out losses, the closing line)."""

import dataclasses
import math

import pytest

from models.config_reference import field_meanings, reference
from relaymoe_jax.ring.volume import plan_dispatch
from train import cli, loop
from train.config import DataConfig, EvalConfig, MeshConfig, OptimConfig, RunConfig, load_run_config
from train.metrics import MetricsLog
from models.runtime import RuntimeConfig


def _help(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  return capsys.readouterr().out


def test_help_lists_every_run_key_with_its_default_and_meaning(capsys):
  """Mutants killed: a new field without a comment; a nested config's keys left out (`mesh.*`); a default that is
  not the dataclass's."""
  text = _help(capsys)
  keys = reference(RunConfig)
  assert len(keys) > 50 and {"optim.learning_rate", "mesh.expert", "runtime.remat", "eval.every"} <= {
      k.name for k in keys}
  for key in keys:
    assert key.meaning, f"{key.name} has no comment in its dataclass, so --help cannot say what it means"
    assert f"  {key.name} = " in text, key.name
  assert "  optim.learning_rate = 0.003\n      the peak, reached after warmup_steps" in text
  assert "  out_dir = runs/default\n" in text and "  data.document_masking = auto\n" in text
  assert "  model.KEY = " in text
  for config in (MeshConfig, DataConfig, EvalConfig, OptimConfig, RuntimeConfig):  # one comment per field
    assert set(field_meanings(config)) == {f.name for f in dataclasses.fields(config)}, config


def test_print_config_is_a_run_config_that_trains_the_same_run(tmp_path, capsys):
  cli.main(["--print-config", "--config", "cpu", "model.num_hidden_layers=3", "optim.learning_rate=1e-4",
            "runtime.dispatcher_options={chunk_rows: 64}"])
  printed = capsys.readouterr().out
  (tmp_path / "run.yaml").write_text(printed)
  again = load_run_config(str(tmp_path / "run.yaml"))
  assert again.optim.learning_rate == 1e-4 and again.model_overrides["num_hidden_layers"] == 3
  assert dict(again.runtime.dispatcher_options) == {"chunk_rows": 64} and again.out_dir == "runs/cpu"
  cli.main(["--print-config", "--config", str(tmp_path / "run.yaml")])
  assert capsys.readouterr().out == printed


def _plan(ring_size=4):
  return plan_dispatch(tokens_per_device=128, d_model=64, d_ff=64, num_experts=8, top_k=2, ring_size=ring_size,
                       dtype="float32")


def test_the_dispatcher_line_says_what_each_ring_sends_and_how_to_switch():
  plan = _plan()  # ring_token sends less at these shapes
  token, expert = (f"{v.bytes_per_hop / 2**20:.2f} MiB" for v in (plan.token_routing, plan.expert_routing))
  assert plan.mode == "ring_token"
  assert loop.dispatcher_line("ring_expert", plan) == (
      f"MoE dispatcher: ring_expert, sending {expert} per hop (forward + backward); ring_token would send {token} "
      "(runtime.dispatcher=ring_token or auto)")
  assert loop.dispatcher_line("ring_token", plan) == (
      f"MoE dispatcher: ring_token, sending {token} per hop (forward + backward)")
  assert loop.dispatcher_line("auto", plan) == (
      f"MoE dispatcher: auto runs ring_token, which sends {token} per hop (forward + backward) against {expert} "
      "for ring_expert")
  assert loop.dispatcher_line("all_to_all", plan) == "MoE dispatcher: all_to_all"
  assert loop.dispatcher_line("ring_expert", None) == "MoE dispatcher: ring_expert"


def test_the_closing_line_counts_steps_as_the_checkpoints_do_and_carries_the_held_out_loss(tmp_path):
  last = dict(step=299, loss=1.42412, tokens_per_s=27185.2)
  assert loop._closing_line(last, dict(eval_loss=1.44981), tmp_path) == (
      f"done: 300 steps, loss 1.4241 (27185 tokens/s); held-out loss 1.4498; metrics in {tmp_path}/metrics.jsonl")
  assert "held-out" not in loop._closing_line(last, None, tmp_path)


def test_each_held_out_loss_is_a_line_on_the_console(tmp_path, capsys):
  log = MetricsLog(tmp_path, total_steps=10, start_step=0, tensorboard=False)
  log.write(dict(step=4, eval_loss=2.5, eval_ppl=math.exp(2.5), eval_tokens=256, eval_s=0.25))
  log.close()
  assert "after step 5: held-out loss 2.5000 (perplexity 12.18 over 256 tokens, 0.2 s)" in capsys.readouterr().out


def test_a_run_with_documents_says_whether_it_masks_them_and_their_end(capsys):
  class Source:
    eos = 7
  loop._say_how_documents_are_read(DataConfig(kind="tokens", path="x.bin", eos_token=7), Source())
  loop._say_how_documents_are_read(DataConfig(kind="tokens", path="x.bin", eos_token=7, document_masking=False),
                                   Source())
  loop._say_how_documents_are_read(DataConfig(), Source())  # the synthetic language has no documents: no line
  assert capsys.readouterr().out.splitlines() == [
      "documents: masked: none attends to another; each ends at token id 7",
      "documents: not masked (data.document_masking=false); each ends at token id 7"]
