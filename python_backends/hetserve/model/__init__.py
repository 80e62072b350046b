"""Checkpoint loading (GGUF / HF safetensors) for Llama-family decoders."""
from .checkpoint import Checkpoint, LlamaConfig, default_checkpoint_path, load_checkpoint

__all__ = ["LlamaConfig", "Checkpoint", "load_checkpoint", "default_checkpoint_path"]
