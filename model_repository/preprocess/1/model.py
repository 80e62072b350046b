"""Thin shim: the implementation lives in the hetserve package."""
from hetserve.triton.preprocess import TritonPythonModel  # noqa: F401
