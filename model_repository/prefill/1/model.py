"""Thin shim: the implementation lives in the hetserve package."""
from hetserve.triton.prefill import TritonPythonModel  # noqa: F401
