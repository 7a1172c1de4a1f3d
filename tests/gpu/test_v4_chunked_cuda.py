"""DeepSeek-V4 chunked prefill on CUDA in bf16 (the Triton kernel paths: indexer top-k,
sparse sink attention) against the float32 whole prefill (skipped without a GPU; on the GPU
machine: `python3 -m pytest tests/gpu/test_v4_chunked_cuda.py -q`).

test_deepseek_v4_cuda's SMALL_V4 and prompts (700, 33 and 1 tokens), prefilled 96 tokens
a step, all prompts' next chunks in one extend (chunk edges cross the window of 64, the CSA
rate 4 and the HCA rate 128 at many offsets), then 8 decode steps fed the float32 greedy
tokens: every position's logits and every step's within the relative Frobenius error TOL
(5e-2) of the float32 whole prefill and its decode, the bound the whole bf16 prefill is held
to there (chunking changes only which rows share a kernel launch, and the cached prefix's
entries come back as stored, in bf16).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_deepseek_v4_cuda import LENGTHS, SMALL_V4, STEPS, TOL, _rel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CHUNK = 96


def _run(dtype: torch.dtype, chunk: int | None, tokens: list[list[int]] | None):
    """-> (per-sequence prefill logits, per-step decode logits, greedy tokens fed)."""
    from cpmoe.engine.runner import ModelRunner, Segment
    from cpmoe.parallel.groups import ProcessGroups

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, SMALL_V4["vocab_size"], (n,), generator=gen).tolist()
            for n in LENGTHS]
    keys = list(range(len(seqs)))
    runner = ModelRunner.from_config(SMALL_V4, ProcessGroups.single("cuda"), dtype, seed=0)
    runner.allocate_kv(sum(LENGTHS) + len(LENGTHS) * (STEPS + 1))
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    step = chunk or max(LENGTHS)
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        segs = [Segment(i, seqs[i][done[i]:done[i] + step], done[i], len(seqs[i]))
                for i in live]
        out = runner.extend(segs, last_only=False).float().cpu()
        for i, part in zip(live, out.split([len(s.ids) for s in segs])):
            rows[i].append(part)
            done[i] += part.shape[0]
    prefill = [torch.cat(r) for r in rows]
    fed = tokens or [[int(p[-1].argmax()) for p in prefill]]
    logits = []
    for s in range(STEPS):
        logits.append(runner.decode(keys, fed[s]).float().cpu())
        if tokens is None:
            fed.append(logits[-1].argmax(-1).tolist())
    return prefill, logits, fed


@cuda
def test_v4_bf16_chunked_prefill_and_decode_match_float32_whole():
    pre32, dec32, tokens = _run(torch.float32, None, None)
    pre16, dec16, _ = _run(torch.bfloat16, CHUNK, tokens)
    for n, a, b in zip(LENGTHS, pre16, pre32):
        assert _rel(a, b) <= TOL, f"chunked prefill of {n} tokens: bf16 vs float32 whole " \
                                  f"{_rel(a, b):.3e}"
    for s, (a, b) in enumerate(zip(dec16, dec32)):
        assert _rel(a, b) <= TOL, f"decode step {s} after chunks: {_rel(a, b):.3e}"
