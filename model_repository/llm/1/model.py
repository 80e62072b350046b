"""Thin shim: the implementation lives in the hetserve package."""
from hetserve.triton.llm import TritonPythonModel  # noqa: F401
