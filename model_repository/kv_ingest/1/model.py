"""Thin shim: the implementation lives in the hetserve package."""
from hetserve.triton.kv_ingest import TritonPythonModel  # noqa: F401
