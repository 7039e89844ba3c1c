"""Frozen, keyword-only config dataclasses loaded from YAML (unknown keys rejected by name), and a Hugging Face
checkpoint's `config.json` read as a mapping."""

import dataclasses
import json
import pathlib
import types
import typing

import yaml

from relaymoe_jax.errors import UserError

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


def from_mapping(cls, data, where="", prefix=""):
  """cls(**data), each value checked and coerced by its field's type (`coerce`), nested dataclasses built
  recursively; an unknown key or a value of the wrong type is named (`prefix` + key) in a ValueError."""
  where = where or cls.__name__
  if not isinstance(data, dict):
    raise UserError(f"{where}: {prefix.rstrip('.') or 'the config'} must be a mapping, got {data!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise UserError(f"{where}: unknown key(s) {[prefix + k for k in unknown]}; known keys: {sorted(fields)}")
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for key, value in data.items():
    hint = hints[key]
    if dataclasses.is_dataclass(hint):
      kwargs[key] = from_mapping(hint, value or {}, where, f"{prefix}{key}.")
      continue
    try:
      kwargs[key] = coerce(value, hint)
    except TypeError:
      raise UserError(f"{where}: {prefix}{key}={value!r} is not {describe(hint)}") from None
  return cls(**kwargs)


def coerce(value, hint):
  """value as a field of type `hint` holds it: YAML's strings for numbers ("1e-3") read as numbers, lists as tuples.

  Raises TypeError where value is not of that type: an int from 2.5, a bool from anything but true/false.
  """
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    for option in args:
      try:
        return coerce(value, option)
      except TypeError:
        pass
    raise TypeError(value)
  if hint is tuple or origin is tuple:
    return _as_tuple(value, args)
  return _SCALARS.get(hint, lambda v: v)(value)


def describe(hint):
  """'a float', 'true or false, or a list of bool': what a field of type `hint` takes, for error messages."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return ", or ".join(describe(a) for a in args)
  if hint is tuple:
    return "a list or a mapping"
  if origin is tuple:
    return f"a list of {args[0].__name__}"
  return _DESCRIPTIONS.get(hint, getattr(hint, "__name__", str(hint)))


def _as_tuple(value, args):
  if isinstance(value, dict) and not args:  # a mapping field stored as pairs (the dataclass sorts them)
    return value
  if not isinstance(value, (list, tuple)):
    raise TypeError(value)
  if args and args[-1] is Ellipsis:
    return tuple(coerce(v, args[0]) for v in value)
  if args and len(args) != len(value):
    raise TypeError(value)
  return tuple(coerce(v, a) for v, a in zip(value, args)) if args else tuple(value)


def _as_int(value):
  if isinstance(value, str):
    value = _number(value)
  if isinstance(value, float) and value.is_integer():  # 1.0e4 steps
    return int(value)
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  raise TypeError(value)


def _as_float(value):
  if isinstance(value, str):
    value = _number(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  raise TypeError(value)


def _number(text):
  try:
    return int(text)
  except ValueError:
    pass
  try:
    return float(text)
  except ValueError:
    raise TypeError(text) from None


def _as_bool(value):
  if isinstance(value, bool):
    return value
  if isinstance(value, str) and value.lower() in ("true", "false"):
    return value.lower() == "true"
  raise TypeError(value)


def _as_str(value):
  if value is None:  # `key=` and YAML's `key:` with nothing after it: the empty string
    return ""
  return _of_type(str)(value)


def _of_type(kind):
  def check(value):
    if not isinstance(value, kind):
      raise TypeError(value)
    return value
  return check


_SCALARS = {int: _as_int, float: _as_float, bool: _as_bool, str: _as_str, dict: _of_type(dict)}
_DESCRIPTIONS = {int: "an int", float: "a float", bool: "true or false", str: "a string (quote it)",
                 dict: "a mapping"}


def override(config, assignments):
  """A copy of config with `a.b=value` strings applied (values parsed as YAML), unknown keys rejected by name."""
  data = dataclasses.asdict(config)
  for assignment in assignments:
    path, value = parse_assignment(assignment)
    node, keys = data, path.split(".")
    for key in keys[:-1]:
      if not isinstance(node.get(key), dict):
        raise UserError(f"override {assignment!r}: {key!r} is not a config section")
      node = node[key]
    if keys[-1] not in node:
      raise UserError(f"override {assignment!r}: unknown key {path!r}")
    node[keys[-1]] = value
  return from_mapping(type(config), data, "override")


def parse_assignment(assignment):
  """'a.b=value' → ('a.b', value parsed as YAML)."""
  if "=" not in assignment:
    raise UserError(f"override {assignment!r} is not of the form key=value")
  key, raw = assignment.split("=", 1)
  try:
    return key, yaml.safe_load(raw)
  except yaml.YAMLError as err:
    raise UserError(f"override {assignment!r}: the value is not YAML ({_yaml_problem(err)})") from None


def read_yaml(path_or_name, subdir):
  """A YAML mapping from a file path, or from configs/<subdir>/<name>.yaml."""
  path = pathlib.Path(path_or_name)
  if path.suffix not in (".yaml", ".yml"):  # a name ("qwen3.5-35b-a3b" has a dot too)
    path = CONFIG_DIR / subdir / f"{path_or_name}.yaml"
  if not path.exists():
    known = sorted(p.stem for p in (CONFIG_DIR / subdir).glob("*.yaml"))
    kind = {"runs": "run", "models": "model"}.get(subdir, subdir)
    is_model = subdir == "runs" and (CONFIG_DIR / "models" / path.name).exists()
    hint = " (a model config: use model=NAME)" if is_model else ""
    raise UserError(f"no {kind} config {str(path_or_name)!r}{hint}; known {kind} configs: {known}")
  if not path.is_file():
    raise UserError(f"config {str(path)!r} is not a file")
  try:
    return yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as err:
    raise UserError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
  except UnicodeDecodeError:
    raise UserError(f"{path} is not a text file (not UTF-8)") from None


def _yaml_problem(err):
  """'mapping values are not allowed here (line 3, column 8)': PyYAML's message in one line."""
  mark = getattr(err, "problem_mark", None)
  where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
  return f"{getattr(err, 'problem', None) or str(err).splitlines()[0]}{where}"


def read_hf_config(hf_dir):
  """(parsed config.json, its path), or a UserError naming what is wrong with it."""
  path = pathlib.Path(hf_dir) / "config.json"
  try:
    hf = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise UserError(f"{path} is not valid JSON ({err})") from None
  if not isinstance(hf, dict):
    raise UserError(f"{path} holds a JSON {type(hf).__name__}, not an object of config keys")
  return hf, path
