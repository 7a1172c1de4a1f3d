"""What the HF-comparison tests share."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            pad_token_id=0)
    return out[0, len(prompt):].tolist()
