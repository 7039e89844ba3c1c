"""The documentation against the tree: every relative link in README.md and docs/*.md names a file (and a heading,
where it names an anchor) that exists, README.md stays a front door of at most 200 lines, and every source path or
module name written in backticks exists, so a moved or renamed file is caught. Reads files only (no JAX)."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200
PACKAGES = ("relaymoe_jax", "models", "train", "benchmarks")

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w/.-]*\.py)\b" % "|".join(PACKAGES))
MODULE_NAME = re.compile(r"(?<![\w/.-])((?:%s)(?:\.\w+)+)" % "|".join(PACKAGES))


def _prose(text):
  """The text with fenced code blocks and inline code removed: where links are links."""
  return INLINE_CODE.sub("", FENCE.sub("", text))


def _code(text):
  """Everything written in backticks: fenced blocks and inline spans (which may wrap across a line)."""
  fences = FENCE.findall(text)
  return fences + INLINE_CODE.findall(FENCE.sub("", text))


def _slug(heading):
  """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
  text = text.replace("`", "").strip().lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def _anchors(path):
  slugs, seen = set(), {}
  for line in FENCE.sub("", path.read_text()).splitlines():
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m:
      slug = _slug(m.group(1))
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      slugs.add(slug if n == 0 else f"{slug}-{n}")
  return slugs


def _links(page):
  for target in LINK.findall(_prose(page.read_text())):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
      continue
    yield target


def _page_id(page):
  return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_resolve(page):
  broken = []
  for target in _links(page):
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      broken.append(f"{target}: no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
    elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
      broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
  assert not broken, f"{_page_id(page)} links to what does not exist:\n  " + "\n  ".join(broken)


def test_readme_is_a_front_door():
  lines = len((ROOT / "README.md").read_text().splitlines())
  assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_source_paths_in_backticks_exist(page):
  missing = sorted({p for code in _code(page.read_text()) for p in SOURCE_PATH.findall(code)
                    if not (ROOT / p).is_file()})
  assert not missing, f"{_page_id(page)} names files that do not exist: {missing}"


def _module_file(parts):
  base = ROOT.joinpath(*parts)
  if (base / "__init__.py").is_file():
    return base / "__init__.py"
  if base.with_suffix(".py").is_file():
    return base.with_suffix(".py")
  return None


def _top_level_names(file):
  names = set()
  for node in ast.parse(file.read_text()).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
  return names


def _resolves(dotted):
  """`pkg.module` or `pkg.module.name`: the longest prefix that is a module, then (if any) one name it defines."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    file = _module_file(parts[:i])
    if file is None:
      continue
    if i == len(parts):
      return True
    names = _top_level_names(file)
    return parts[i] in names or "__getattr__" in names  # a module-level __getattr__ (lazy imports) may supply it
  return False


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_module_names_in_backticks_exist(page):
  missing = sorted({name for code in _code(page.read_text()) for name in MODULE_NAME.findall(code)
                    if not _resolves(name)})
  assert not missing, f"{_page_id(page)} names modules or attributes that do not exist: {missing}"


def test_layout_maps_every_package_folder():
  layout = (ROOT / "docs" / "layout.md").read_text()
  folders = sorted(str(init.parent.relative_to(ROOT)) + "/" for package in PACKAGES
                   for init in (ROOT / package).rglob("__init__.py"))
  missing = [f for f in folders if f"`{f}`" not in layout]
  assert not missing, f"docs/layout.md has no line for {missing}"
