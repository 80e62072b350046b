"""Reference oracle: Hugging Face transformers loading the same GGUF (dequantised to fp32), greedy decoding.

Test/benchmark use only (needs torch + transformers + accelerate, the `reference` extra).
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import List


@lru_cache(maxsize=2)
def load(checkpoint: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    if checkpoint.endswith(".gguf"):
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(checkpoint),
                                                 gguf_file=os.path.basename(checkpoint), dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return m.eval()


def greedy(checkpoint: str, prompt_ids: List[int], n: int) -> List[int]:
    import torch

    m = load(checkpoint)
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt_ids):]]
