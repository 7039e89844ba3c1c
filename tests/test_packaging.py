"""The built package, not only the editable checkout, carries what `relaymoe-train` reads: every model and run
config, beside `models/` where `models.config` looks for them."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from models.config import CONFIG_DIR

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[1])


@pytest.mark.slow  # builds a wheel with pip (build isolation fetches setuptools from the package index)
def test_wheel_ships_every_config(tmp_path):
  repo, source = CONFIG_DIR.parent, tmp_path / "source"  # a copy: no build/ of an earlier build supplies files

  def skip(folder, names):  # the checkout's outputs and environments, not the package
    top = {"build", "runs"} if folder == str(repo) else set()
    return {n for n in names if n in top or n.startswith(".") or n == "__pycache__" or n.endswith(".egg-info")}

  shutil.copytree(repo, source, ignore=skip)
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(source)],
                 check=True)
  names = set(zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist())
  configs = {f"configs/{p.relative_to(CONFIG_DIR).as_posix()}" for p in CONFIG_DIR.rglob("*.yaml")}
  assert configs and configs <= names, sorted(configs - names)
  assert "relaymoe_jax/kernels/mosaic_gpu_tiles.json" in names


def test_the_functional_api_imports_no_flax():
  """`route` / `moe_ffn` users (and `relaymoe_jax.testing`'s) pay no Flax import: the Flax layers load on first use
  of `relaymoe_jax.nnx`/`.linen`; `python -X importtime -c "import relaymoe_jax"` lists no Flax module."""
  env = dict(os.environ, PYTHONPATH=REPO_ROOT)
  code = ("import sys, relaymoe_jax as rm, relaymoe_jax.testing;"
          " assert not [m for m in sys.modules if m.split('.')[0] == 'flax'], 'flax';"
          " rm.route, rm.moe_ffn; rm.nnx.MoE; assert 'flax' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=env)
  timed = subprocess.run([sys.executable, "-X", "importtime", "-c", "import relaymoe_jax"], check=True, cwd=REPO_ROOT,
                         env=env, capture_output=True, text=True)
  assert "relaymoe_jax.moe" in timed.stderr and "flax" not in timed.stderr
