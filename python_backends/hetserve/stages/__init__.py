"""Stage logic on typed dataclasses, without Triton Python-backend imports: the orchestrator (orchestrator.py,
run by the `llm` model), the prefill server's request logic (prefill.py, with the batch planner in
prefill_batch.py, run by `prefill`) and the decode server's (decode.py, run by `decode`). The models in
hetserve/triton/ are thin bindings that convert tensors <-> the dataclasses of types.py and prefill.py."""
