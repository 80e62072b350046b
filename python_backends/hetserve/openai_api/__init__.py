"""OpenAI-compatible HTTP frontend over the prefill server's `llm` model (`hetserve serve --role openai`)."""
from .app import FrontendConfig, create_app, serve

__all__ = ["FrontendConfig", "create_app", "serve"]
