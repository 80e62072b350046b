"""hetserve: prefill/decode-disaggregated LLM serving on Triton Inference Server."""
__version__ = "0.1.0"
