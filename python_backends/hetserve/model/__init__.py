"""Checkpoint loading (GGUF / HF safetensors) for Llama-family decoders."""
from .checkpoint import LlamaConfig, Checkpoint, load_checkpoint, default_checkpoint_path

__all__ = ["LlamaConfig", "Checkpoint", "load_checkpoint", "default_checkpoint_path"]
