"""Where a train step's device time goes, by part of the model: each profiled kernel (GPU) or op (CPU) is mapped
to the HLO instruction it ran (the trace's `hlo_op`), and that instruction to a part by the JAX name scopes in its
`op_name` metadata (`models/qwen3/model.py`'s `lm_head`, `attention`, `moe`, `router`, `projection`, `norm`, `rope`;
`models/qwen35/deltanet.py`'s `deltanet`; `train/step.py`'s `optimizer`), read from the compiled executable's HLO text. Its opcode decides the rest:
collectives are communication wherever they sit, copies are copies, and inside `moe` the matmuls (outside
`router`) are the grouped matmuls. In a CUDA graph, where XLA names kernels after their fusions only, a Pallas
(Triton) kernel is found by the name its custom call gives it, and the libraries' kernels by their library.

Needs op_name metadata with the full name stack: compile with `full_op_names()`.
"""

import collections
import contextlib
import functools
import re
from typing import NamedTuple

import jax

from train.profile.trace_events import union_us
from train.xla_cache import compiled_afresh

PARTS = {  # part: its row in the table, in order
    "lm_head": "LM head and loss", "attention": "attention", "deltanet": "Gated DeltaNet (conv, gates, delta rule)",
    "moe_matmul": "MoE grouped matmuls",
    "moe_other": "MoE other (routing, gathers, SwiGLU, combine)", "projection": "dense projections",
    "other": "norms, RoPE, other elementwise", "optimizer": "optimizer", "copy": "copies",
    "communication": "communication", "unattributed": "not in the step's HLO"}
SCOPES = ("optimizer", "lm_head", "moe", "deltanet", "attention", "projection")  # the first found names the part
COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "ragged-all-to-all",
               "collective-broadcast", "send", "recv"}
MATMULS = {"dot", "ragged-dot", "convolution"}
MATMUL_CUSTOM_CALLS = ("gemm", "matmul", "mosaic")  # cuBLAS, cuBLASLt and Mosaic GPU kernels (ours, JAX's)
COPIES = {"copy", "copy-start", "copy-done"}
CONTAINERS = {"while", "conditional", "call"}  # XLA:CPU traces them as events holding their body's
_MATMUL_PARTS = ("lm_head", "moe_other", "moe_matmul", "projection", "attention", "deltanet")
PLUMBING = {"parameter", "bitcast", "tuple", "get-tuple-element", "copy"}  # a fusion of only these is a copy


class Instruction(NamedTuple):
  opcode: str
  op_name: str  # the metadata's: "jit(train_step)/transpose(jvp(...))/.../moe/..."
  contains: frozenset  # opcodes inside the computations it calls (fusions, async wrappers), recursively
  target: str = ""  # a custom call's custom_call_target
  kernel: str = ""  # a Triton custom call's kernel name (a Pallas kernel's `name`), from its backend_config


@contextlib.contextmanager
def full_op_names(on=True):
  """Steps compiled inside get each instruction's whole name stack in its op_name metadata (with `on`; else it
  changes nothing). `train.compile` turns full tracebacks off for cache keys that do not depend on the stack, and
  without them the ops in a loop body or a shard_map keep only their innermost name (`mul`), no scope. Nor is a
  step read back from JAX's persistent cache inside: its key leaves the names out, and a GPU step compiled by a
  run that did not profile came back with none (the whole all-to-all step counted as "other")."""
  before = jax.config.jax_include_full_tracebacks_in_locations
  jax.config.update("jax_include_full_tracebacks_in_locations", on or before)
  try:
    with compiled_afresh(on):
      yield
  finally:
    jax.config.update("jax_include_full_tracebacks_in_locations", before)


_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_KERNEL = re.compile(r'\bname = "([^"]+)"')  # in a Triton custom call's backend_config (op_name="..." has no spaces)


def _opcode(rest):
  """The opcode of an instruction's text after ` = `: past its shape (a tuple in parentheses, or one token)."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        rest = rest[i + 1:]
        break
  else:
    rest = rest.split(" ", 1)[1]
  return re.match(r"\s*([\w\-]+)", rest).group(1)


def parse_hlo(text):
  """{instruction name: Instruction} of every instruction in an HLO module's text (`compiled.as_text()`)."""
  raw, computation, members = {}, None, collections.defaultdict(list)
  for line in text.splitlines():
    name = _NAME.match(line)
    if not name:
      header = _HEADER.match(line)
      computation = header.group(1) if header else computation
      continue
    opcode = _opcode(line[name.end():])
    target = _TARGET.search(line)
    if opcode == "custom-call" and target and any(k in target.group(1).lower() for k in MATMUL_CUSTOM_CALLS):
      opcode = "dot"  # a matmul kernel: counts as one
    calls = [c.strip(" {}%") for m in _CALLS.finditer(line) for c in m.group(1).split(",")]
    op_name = _OP_NAME.search(line)
    kernel = _KERNEL.search(line) if opcode == "custom-call" else None
    raw[name.group(1)] = (opcode, op_name.group(1) if op_name else "", calls, target.group(1) if target else "",
                          kernel.group(1) if kernel else "")
    members[computation].append(name.group(1))

  @functools.cache
  def contained(computation):
    found = set()
    for member in members.get(computation, ()):
      opcode, _, calls, *_ = raw[member]
      found.add(opcode)
      for called in calls:
        found |= contained(called)
    return frozenset(found)

  return {name: Instruction(opcode, op_name, frozenset().union(*map(contained, calls)), target, kernel)
          for name, (opcode, op_name, calls, target, kernel) in raw.items()}


def _base(opcode):
  return opcode.removesuffix("-start").removesuffix("-done")


def part_of(instruction, event_name=""):
  """The part (a key of PARTS) an instruction's time goes to; None for a container whose body is counted."""
  if instruction is None:
    lower = event_name.lower()
    return "copy" if "memcpy" in lower or "memset" in lower else "communication" if "nccl" in lower else (
        "unattributed")
  opcode, op_name, contains, *_ = instruction
  if opcode in CONTAINERS:
    return None
  if _base(opcode) in COLLECTIVES or (opcode.startswith("async") and {_base(o) for o in contains} & COLLECTIVES):
    return "communication"
  if opcode in COPIES or (opcode == "fusion" and contains <= PLUMBING):
    return "copy"
  scopes = set(re.findall(r"[A-Za-z0-9_]+", op_name))
  part = next((s for s in SCOPES if s in scopes), "other")
  if part == "moe":
    matmul = opcode in MATMULS or (opcode == "fusion" and contains & MATMULS)
    return "moe_matmul" if matmul and "router" not in scopes else "moe_other"
  return part


LIBRARIES = ("cudnn", "mosaic")  # kernels named after their library, as are the custom calls that launch them


def _sole_parts(keyed):
  """{key: part} of the (key, instruction) pairs whose instructions under that key all lie in one part."""
  parts = collections.defaultdict(set)
  for key, instruction in keyed:
    parts[key].add(part_of(instruction))
  return {key: part for key, (part, *more) in parts.items() if not more}


def _library_parts(instructions):
  """{library: its custom calls' one part} for each of LIBRARIES whose custom calls in the step all lie in one part
  (cuDNN's attention, the MoE's Mosaic GPU kernels): its kernels in a CUDA graph take that part."""
  return _sole_parts((library, instruction) for instruction in instructions.values()
                     for library in LIBRARIES if library in instruction.target.lower())


def _kernel_parts(instructions):
  """{kernel name: its custom calls' one part} for the Triton kernels (Pallas') named in the step's custom calls whose
  calls all lie in one part (the DeltaNet's): in a CUDA graph their kernels are named so, not after an instruction.
  (XLA adds "__1", "__2" to a second kernel of the same name: `_kernel_name` removes it.)"""
  return _sole_parts((i.kernel, i) for i in instructions.values() if i.kernel)


def _kernel_name(event_name):
  return re.sub(r"__\d+$", "", event_name)


def _unnamed_graph_kernel_part(named_parts):
  """The part of a kernel in a CUDA graph that no HLO instruction is named after. XLA names a graph's fusion
  kernels after their fusions but not the library and custom-call kernels beside them (cuBLAS, cuDNN, Mosaic
  GPU), which are the matmuls and attention: such a kernel takes the part of the graph's named kernels that holds
  the most time among those with matmuls (the LM head, the MoE, where it is a grouped matmul since every other
  MoE kernel there is a named fusion, the dense projections, attention), else among all of them."""
  with_matmuls = collections.Counter({p: t for p, t in named_parts.items() if p in _MATMUL_PARTS})
  part = ((with_matmuls or named_parts).most_common(1) or [("unattributed", 0)])[0][0]
  return "moe_matmul" if part in ("moe_other", "moe_matmul") else part


def module_name(hlo_text):
  return re.match(r"HloModule ([\w.\-]+)", hlo_text).group(1)


def step_parts(events, hlo_text, steps, wall_s):
  """Kernel time per step by part, from the `train.profile.trace_events.op_events` of `steps` steps that took `wall_s`
  seconds: {"parts": {part: {"ms", "launches", "top": [(hlo op, ms, launches, op_name)]}}, "busy_ms" (time any
  kernel ran), "kernel_ms" (their sum: more than busy where kernels overlap), "step_ms", "idle_ms"}. A top entry
  in a CUDA graph names its kernel's instruction (a fusion), or the kernel where none is named after it."""
  instructions = parse_hlo(hlo_text)
  kernel_names = {re.sub(r"[.\-]", "_", name): name for name in instructions}  # a fusion's kernel is named so
  ms, launches = collections.Counter(), collections.Counter()
  by_op = collections.defaultdict(collections.Counter)
  graph_parts = collections.defaultdict(collections.Counter)  # command buffer: ms of its named kernels by part
  spans, unnamed = [], []

  op_launches = collections.Counter()

  def count(event, part, op):
    """`op`: what the top lists name: the HLO instruction, in a CUDA graph the kernel's (else the kernel)."""
    ms[part] += event.dur_us / 1e3 / steps
    launches[part] += 1
    by_op[part][op] += event.dur_us / 1e3 / steps
    op_launches[op] += 1
    spans.append((event.start_us, event.start_us + event.dur_us))

  for event in events:
    instruction = instructions.get(event.hlo_op) if event.hlo_op else None
    in_graph = bool(event.hlo_op) and instruction is None and event.hlo_op.startswith("command_buffer")
    op = event.hlo_op or event.name
    if in_graph:
      op = kernel_names.get(event.name)
      instruction = instructions.get(op)  # a kernel in a CUDA graph (command buffer)
      if instruction is None:
        unnamed.append(event)
        continue
    part = part_of(instruction, event.name)
    if part is not None:
      count(event, part, op)
      if in_graph:
        graph_parts[event.hlo_op][part] += event.dur_us
  library_parts, kernel_parts = _library_parts(instructions), _kernel_parts(instructions)
  for event in unnamed:
    part = part_of(None, event.name)
    if part == "unattributed":
      library = next((lib for lib in LIBRARIES if lib in event.name.lower()), None)
      part = (kernel_parts.get(_kernel_name(event.name)) or library_parts.get(library)
              or _unnamed_graph_kernel_part(graph_parts[event.hlo_op]))
    count(event, part, event.name)
  step_ms = wall_s * 1e3 / steps
  busy_ms = union_us(spans) / 1e3 / steps

  def top(part):
    return [(op, round(t, 3), op_launches[op] // steps, instructions[op].op_name if op in instructions else "")
            for op, t in by_op[part].most_common(8)]

  parts = {p: dict(ms=round(ms[p], 3), launches=launches[p] // steps, top=top(p)) for p in PARTS}
  return dict(parts=parts, busy_ms=round(busy_ms, 3), kernel_ms=round(sum(ms.values()), 3),
              step_ms=round(step_ms, 3), idle_ms=round(step_ms - busy_ms, 3))


def render(profile, title):
  """The part table: ms per step, % of the step and launches per step, then idle, the step and its speed."""
  step = profile["step_ms"]
  lines = [title, "", "| part | ms / step | % of step | launches / step |", "|---|---|---|---|"]
  for part, label in PARTS.items():
    row = profile["parts"][part]
    if part != "unattributed" or row["ms"]:
      lines.append(f"| {label} | {row['ms']:.2f} | {row['ms'] / step:.1%} | {row['launches']} |")
  lines += [f"| idle (step less busy kernel time) | {profile['idle_ms']:.2f} | {profile['idle_ms'] / step:.1%} | |",
            f"| step (wall) | {step:.2f} | 100.0% | |", ""]
  overlap = profile["kernel_ms"] - profile["busy_ms"]
  mfu = f", MFU {profile['mfu']:.1%}" if profile.get("mfu") is not None else ""
  lines.append(f"{profile['tokens_per_s']:.0f} tokens/s, {profile['tflops_per_device']:.3g} TFLOP/s per device{mfu}; "
               f"kernels overlapped for {overlap:.2f} ms a step (counted in each part)")
  return "\n".join(lines)
