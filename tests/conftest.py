"""Shared fixtures: an isolated Jupyter/IPython environment, real kernels, an in-process shell."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kernels import KERNEL_NAME


@pytest.fixture(scope="session", autouse=True)
def isolated_jupyter(tmp_path_factory):
    """Kernels started by the tests run this interpreter, with a fresh IPython profile.

    A kernelspec of our own (pointing at ``sys.executable``) keeps a system-wide ``python3``
    kernelspec from sending the tests to another Python; a private ``IPYTHONDIR`` keeps the
    user's startup files and configuration out.
    """
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "data" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "colab_resilience tests",
                "language": "python",
            }
        )
    )
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "IPYTHONDIR", "COLAB_RESILIENCE_HOME", "COLAB_RESILIENCE_RUN_DIR", "PYDEVD_DISABLE_FILE_VALIDATION")}
    os.environ["JUPYTER_PATH"] = str(root / "data")
    os.environ["IPYTHONDIR"] = str(root / "ipython")
    os.environ["COLAB_RESILIENCE_HOME"] = str(root / "home")
    os.environ["COLAB_RESILIENCE_RUN_DIR"] = str(root / "runs")
    os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
