"""Thin shim: the implementation lives in the hetserve package."""
from hetserve.triton.aggregated import TritonPythonModel  # noqa: F401
