"""What every engine's inputs share, below the engines: the additive causal mask over a right-padded past and new
tokens, its -inf stand-in, and EngineError (an engine called the wrong way: our bug, never the client's).
runtime.py re-exports them; native.py, decode_batch.py and quality.py import them from here, so no engine module
imports runtime (which loads them)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InternalError

NEG_INF = np.float32(-1e9)


class EngineError(InternalError, RuntimeError):
    """An engine call with inputs of the wrong form (internal: the stages build them)."""


def causal_mask(past_lens: Sequence[int], new_lens: Sequence[int], P: int, T: int) -> np.ndarray:
    """Additive mask [B,1,T,P+T] for right-padded past (valid prefix of length past_lens[b]) and new tokens."""
    B = len(past_lens)
    m = np.full((B, 1, T, P + T), NEG_INF, dtype=np.float32)
    tri = np.tril(np.ones((T, T), dtype=bool))
    for b in range(B):
        pl, nl = int(past_lens[b]), int(new_lens[b])
        m[b, 0, :, :pl] = 0.0
        blk = m[b, 0, :, P:P + T]
        blk[tri] = 0.0
        if nl < T:  # padded query rows: attend to themselves only (output discarded)
            blk[nl:, :] = NEG_INF
            blk[np.arange(nl, T), np.arange(nl, T)] = 0.0
            blk[:, nl:] = np.where(np.eye(T, dtype=bool)[:, nl:], blk[:, nl:], NEG_INF)
    return m
