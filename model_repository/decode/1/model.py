"""Thin shim: the implementation lives in the hetserve package next to this repository (python_backends/), which
wins over an installed copy: the 2.51 stub ignores PYTHONPATH, and a checkout must serve its own code."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "python_backends"))  # absent in images: harmless
from hetserve.logs import setup  # noqa: E402

setup(pathlib.Path(__file__).resolve().parents[1].name, announce=True)  # our log lines in tritonserver's output
from hetserve.triton.decode import TritonPythonModel  # noqa: E402,F401
