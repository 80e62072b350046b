"""Stage logic on typed dataclasses, without Triton Python-backend imports: the orchestrator (orchestrator.py,
run by the `llm` model) and the decode server's request logic (decode.py, run by `decode`). The models in
hetserve/triton/ are thin bindings that convert tensors <-> the dataclasses of types.py."""
