"""Synthetic tokens for fast tests: a seeded order-2 Markov chain a tiny model can learn.

Every token ``b`` has ``branching`` possible successors, and the token before it, ``a``,
picks which one (with probability ``1 - noise``; otherwise a random one of the ``branching``).
The loss of a model that learns it falls from ``ln(vocab_size)`` (5.5 nats for 256 tokens)
to well under 1 nat (about 0.66 from bigram statistics alone, 0.35 with the previous token
too, at the defaults) — a signal a training test can see within seconds on a CPU,
with no tokenizer and no files. The chain is a function of ``data_seed`` alone; the ``seed``
given to ``build_data`` only shuffles the order of the packed sequences.
"""

from __future__ import annotations

import numpy as np

from readback.data.settings import SyntheticData


def markov_tokens(vocab_size: int, n_tokens: int, *, seed: int, branching: int = 4, noise: float = 0.1) -> np.ndarray:
    """``n_tokens`` tokens of the chain described in the module docstring, as ``int64``."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, branching)).tolist()
    preferred = rng.integers(0, branching, size=vocab_size).tolist()
    random_branch = rng.integers(0, branching, size=n_tokens)
    branch_rule = np.where(rng.random(n_tokens) < noise, random_branch, -1).tolist()
    out = rng.integers(0, vocab_size, size=n_tokens).tolist()  # the first two are the start state
    if n_tokens < 3:
        return np.asarray(out, dtype=np.int64)
    a, b = out[0], out[1]
    for t in range(2, n_tokens):
        k = branch_rule[t]
        c = successors[b][preferred[a] if k < 0 else k]
        out[t] = c
        a, b = b, c
    return np.asarray(out, dtype=np.int64)


def synthetic_split(cfg: SyntheticData) -> tuple[np.ndarray, np.ndarray, int, str]:
    """``(train, val, vocab_size, fingerprint)``: one chain, its last ``val_fraction`` held out."""
    vocab_size, n_tokens, val_fraction = cfg.vocab_size, cfg.n_tokens, cfg.val_fraction
    data_seed, branching, noise = cfg.data_seed, cfg.branching, cfg.noise
    tokens = markov_tokens(vocab_size, n_tokens, seed=data_seed, branching=branching, noise=noise)
    cut = n_tokens - int(n_tokens * val_fraction)
    fingerprint = f"synthetic:v{vocab_size}:n{n_tokens}:s{data_seed}:b{branching}:p{noise}:f{val_fraction}"
    return tokens[:cut], tokens[cut:], vocab_size, fingerprint
