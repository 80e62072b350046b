import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backends"))

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning Python.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="session")
def engine_dir():
    from hetserve.engines.builder import build_engines

    d = os.environ.get("HETSERVE_ENGINE_DIR") or str(ROOT / ".hetserve" / "engines")
    build_engines(None, d)
    return d


@pytest.fixture(scope="session")
def tokenizer(engine_dir):
    from hetserve.engines.builder import load_tokenizer

    return load_tokenizer(engine_dir)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer):
    return {p: tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS}


@pytest.fixture(scope="session")
def reference_tokens(prompt_ids):
    """transformers greedy tokens on the same GGUF, 32 per prompt (the oracle)."""
    pytest.importorskip("transformers")
    from hetserve.model import default_checkpoint_path
    from hetserve.reference import greedy

    ck = default_checkpoint_path()
    return {p: greedy(ck, ids, 32) for p, ids in prompt_ids.items()}


@pytest.fixture(scope="session")
def topology(engine_dir):
    """Real prefill + decode tritonservers on separate cores (ports 18000-18002 / 19000-19002)."""
    from hetserve.topology import Topology

    base = int(os.environ.get("HETSERVE_TEST_BASE_PORT", "18000"))
    topo = Topology(engine_dir, base_port=base, env={"HETSERVE_KV_TIMEOUT_MS": "100"})
    topo.start()
    yield topo
    topo.stop()
