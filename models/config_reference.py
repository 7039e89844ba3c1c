"""Every key of a config dataclass with its default and meaning, read from the class itself: a field's meaning is the
comment on its line or the comment lines right above it, so `relaymoe-train --help` cannot drift from the code."""

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import typing


class Key(typing.NamedTuple):
  name: str  # dotted, as `key=value` takes it
  default: object
  meaning: str


def reference(cls, prefix=""):
  """The keys of `cls`, nested dataclasses' keys dotted under their field's name, in declaration order."""
  hints = typing.get_type_hints(cls)
  meanings = field_meanings(cls)
  keys = []
  for field in dataclasses.fields(cls):
    if dataclasses.is_dataclass(hints[field.name]):
      keys += reference(hints[field.name], f"{prefix}{field.name}.")
    else:
      keys.append(Key(prefix + field.name, _default(field), meanings.get(field.name, "")))
  return keys


def _default(field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return None


@functools.cache
def field_meanings(cls):
  """{field: its comment} for the fields of `cls` that have one."""
  source = textwrap.dedent(inspect.getsource(cls))
  comments = _comments_by_line(source)
  body = ast.parse(source).body[0].body
  meanings = {}
  for node in body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    above = []
    line = node.lineno - 1
    while line in comments and comments[line][1]:  # whole-line comments right above the field
      above.insert(0, comments[line][0])
      line -= 1
    trailing = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1)
                if n in comments and not comments[n][1]]
    text = " ".join(above + trailing)
    if text:
      meanings[node.target.id] = text
  return meanings


def _comments_by_line(source):
  """{line number: (comment text, whether the comment is the whole line)}."""
  lines = source.splitlines()
  found = {}
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      row, col = token.start
      whole = not lines[row - 1][:col].strip()
      found[row] = (token.string.lstrip("#").strip(), whole)
  return found


def render(keys, width=118):
  """The keys as `--help` prints them: `name = default` and the meaning indented beneath."""
  out = []
  for key in keys:
    out.append(f"  {key.name} = {_shown(key.default)}")
    if key.meaning:
      out += textwrap.wrap(key.meaning, width, initial_indent="      ", subsequent_indent="      ")
  return "\n".join(out)


def _shown(value):
  if value == "":
    return '""'
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, (tuple, dict)) and not value:
    return "{}" if isinstance(value, dict) else "[]"
  return str(value)
