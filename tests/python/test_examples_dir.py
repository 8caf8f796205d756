"""python -m devshare --examples-dir and devshare._paths.get_examples_dir, from the source
checkout: the checkout's examples/, each example with a README. The wheel's copy is checked by
tests/wheel/run.sh; the examples themselves run as CTest tests (example_*)."""

import os
import pathlib
import subprocess
import sys

import pytest

import devshare
from devshare import _paths

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG_PARENT = str(pathlib.Path(devshare.__file__).resolve().parents[1])
EXAMPLES = ("cpp_stage", "pool_to_python", "reconnect", "weight_sync")


@pytest.mark.skipif(_paths.PREFIX.exists(), reason="a wheel-installed package")
def test_examples_dir_is_the_checkouts():
    assert _paths.get_examples_dir() == str(ROOT / "examples")
    res = subprocess.run([sys.executable, "-m", "devshare", "--examples-dir"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=PKG_PARENT), timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == str(ROOT / "examples"), res
    res = subprocess.run([sys.executable, "-m", "devshare", "--help"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=PKG_PARENT), timeout=120)
    assert res.returncode == 0 and "--examples-dir" in res.stdout, res


def test_each_example_has_a_readme():
    d = pathlib.Path(_paths.get_examples_dir())
    for name in EXAMPLES:
        readme = d / name / "README.md"
        assert readme.is_file(), readme
        assert "python" in readme.read_text(), readme
