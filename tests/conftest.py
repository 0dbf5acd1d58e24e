"""Shared fixtures: an isolated Jupyter/IPython environment, real kernels, an in-process shell."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import kernels


@pytest.fixture(scope="session", autouse=True)
def isolated_jupyter(tmp_path_factory):
    """Kernels started by the tests run this interpreter, with a fresh IPython profile."""
    with kernels.isolated_jupyter(tmp_path_factory.mktemp("jupyter")) as root:
        yield root


@pytest.fixture
def kernel():
    """A real kernel, started by jupyter_client, with a blocking client."""
    from kernels import Kernel

    k = Kernel()
    try:
        yield k
    finally:
        k.shutdown()


@pytest.fixture
def ip():
    """An in-process IPython shell with the extension loaded (for parsing and messages)."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "colab_resilience")
    yield shell
    shell.run_line_magic("unload_ext", "colab_resilience")
    # `%config ResilienceMagics.x = ...` lands in the shared shell's config, and a later load of
    # the extension would read it: every test starts from the defaults.
    shell.config.pop("ResilienceMagics", None)
    for name in [n for n in shell.user_ns if not n.startswith("_") and n not in shell.user_ns_hidden]:
        shell.user_ns.pop(name, None)


def pytest_configure(config):
    sys.path.insert(0, str(Path(__file__).parent))
