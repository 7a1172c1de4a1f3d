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


@torch.no_grad()
def hf_greedy_run(hf_model, seqs: list[list[int]], new_tokens: int) -> dict:
    """Each prompt alone through HF: prefill logits of every position (concatenated over the
    prompts), then greedy `generate` (its cached decode): the tokens per prompt and each
    step's logits [prompts, V] (step 0: the prefill's last position) -- the shape of
    `tests.distributed._v4_tasks.greedy_run`'s result."""
    prefill, steps, tokens = [], [], []
    for seq in seqs:
        ids = torch.tensor([seq])
        prefill.append(hf_model(input_ids=ids).logits[0].float())
        out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(seq):].tolist())
        steps.append(torch.cat(out.logits).float())  # [new_tokens, V]
    return {"prefill": torch.cat(prefill), "steps": list(torch.stack(steps, dim=1)),
            "tokens": tokens}
