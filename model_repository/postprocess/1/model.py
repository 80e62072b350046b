"""Thin shim: the implementation lives in the hetserve package."""
from hetserve.triton.postprocess import TritonPythonModel  # noqa: F401
