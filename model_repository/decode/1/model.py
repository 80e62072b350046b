"""Thin shim: the implementation lives in the hetserve package."""
from hetserve.triton.decode import TritonPythonModel  # noqa: F401
