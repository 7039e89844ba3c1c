"""Frozen, keyword-only config dataclasses loaded from YAML; unknown keys are rejected by name."""

import dataclasses
import pathlib
import typing

import yaml

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


def from_mapping(cls, data, where=""):
  """cls(**data) with nested dataclasses built recursively, lists made tuples, and unknown keys named."""
  where = where or cls.__name__
  if not isinstance(data, dict):
    raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ValueError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for key, value in data.items():
    hint = hints[key]
    if dataclasses.is_dataclass(hint):
      value = from_mapping(hint, value or {}, f"{where}.{key}")
    elif isinstance(value, list):
      value = tuple(value)
    kwargs[key] = value
  return cls(**kwargs)


def override(config, assignments):
  """A copy of config with `a.b=value` strings applied (values parsed as YAML), unknown keys rejected by name."""
  data = dataclasses.asdict(config)
  for assignment in assignments:
    path, value = parse_assignment(assignment)
    node, keys = data, path.split(".")
    for key in keys[:-1]:
      if not isinstance(node.get(key), dict):
        raise ValueError(f"override {assignment!r}: {key!r} is not a config section")
      node = node[key]
    if keys[-1] not in node:
      raise ValueError(f"override {assignment!r}: unknown key {path!r}")
    node[keys[-1]] = value
  return from_mapping(type(config), data)


def parse_assignment(assignment):
  """'a.b=value' → ('a.b', value parsed as YAML)."""
  if "=" not in assignment:
    raise ValueError(f"override {assignment!r} is not of the form key=value")
  key, raw = assignment.split("=", 1)
  return key, yaml.safe_load(raw)


def read_yaml(path_or_name, subdir):
  """A YAML mapping from a file path, or from configs/<subdir>/<name>.yaml."""
  path = pathlib.Path(path_or_name)
  if not path.suffix:
    path = CONFIG_DIR / subdir / f"{path_or_name}.yaml"
  if not path.exists():
    known = sorted(p.stem for p in (CONFIG_DIR / subdir).glob("*.yaml"))
    raise ValueError(f"no config {str(path_or_name)!r}; known {subdir} configs: {known}")
  return yaml.safe_load(path.read_text()) or {}
