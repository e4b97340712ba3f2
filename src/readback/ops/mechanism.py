"""What a biased D-term does inside attention, measured where it happens (log steps only).

Forward: the largest and the mean causal logit, and the attention entropy. Backward: the cosine
between dQ's D-term component and the mean attended key. Since ``dS = P * (dP - D)``, dQ's
D-term part is ``-c * D_i * kbar_i`` with ``kbar_i = sum_j P_ij K_j``, the direction a biased D
pushes every query along; its cosine with ``kbar`` over a whole layer (flattened) is near 0 when
D's errors have no sign, and goes to -1 or +1 when they do. Per row it would be just -sign(D_i).
"""

from __future__ import annotations

import torch


def observe_logits(numerics, name: str, scores: torch.Tensor, causal: torch.Tensor, probs: torch.Tensor) -> None:
    visible = ~causal.expand_as(scores)
    logits = scores.detach()[visible]
    numerics.observe_max(f"attn_logit/{name}", logits.max())
    numerics.observe(f"attn_logit/{name}", logits)
    p = probs.detach()
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    numerics.observe(f"attn_entropy/{name}", entropy)


def observe_dterm(numerics, name: str, probs: torch.Tensor, row_term: torch.Tensor, keys: torch.Tensor) -> None:
    mean_key = probs.detach() @ keys.detach()  # (B, H, T, hd)
    d_term = -row_term.detach() * mean_key
    cosine = torch.nn.functional.cosine_similarity(d_term.flatten(), mean_key.flatten(), dim=0, eps=1e-30)
    numerics.observe(f"attn_dq_dterm_cos/{name}", cosine)
