"""The whole model in bf16 on CUDA against the float32 path, and one request served on CUDA
through HTTP (skipped without CUDA; run on the GPU machine: `python3 -m pytest tests/gpu`).

bf16 paths covered end to end: cuDNN/flash attention (one GPU: causal SDPA; two GPUs, zigzag
CP 2: each query run's causal + unmasked cuDNN calls merged by the Triton LSE merge),
grouped-GEMM experts, the Triton kernels (q/k norm + RoPE, SwiGLU, router softmax + top-k,
MoE combine) and, on two GPUs, the MoE dispatch.

Tolerance, derived from bf16 rounding. bf16 keeps 8 significant bits: one rounding adds a
relative error of at most u = 2^-8. A decoder layer's bf16 path rounds its values at least
R = 8 times in sequence (layer input, q/k/v, attention output, o-projection, router weights,
expert gate/up, SwiGLU, down + combine). Over L layers:
- worst case, every error adding up: a token's logits are off by at most R*L*u relative
  (L = 4: 0.125), asserted per token row;
- rounding errors of random data are independent with mean zero and add in quadrature:
  all rows together are off by about sqrt(R*L)*u relative (L = 4: 0.022), asserted over the
  whole logit matrix (on CPU, the same model and prompts in bf16 measure 0.0086 overall and
  0.019 for the worst row);
- and where float32's top-1/top-2 gap exceeds twice a row's measured max |difference|, no
  rounding of that size can flip the argmax: bf16 must pick float32's token there.

What that can catch: at these random weights (std 0.02) attention carries most of the
residual stream and the experts little of it. On CPU in float32, dropping the experts' output
moves the logits by 0.051 relative and doubling it by 0.052, beyond the 0.022 bound (a bf16
run with the experts' SwiGLU zeroed fails at 0.060), but scaling it by 1.1 moves them only
0.0056. So an expert path that is broken (wrong rows, wrong experts, no combine) fails here;
errors of a few percent inside one kernel are left to the kernel tests in test_cuda_paths.
"""

from __future__ import annotations

import math

import pytest
import torch

from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups
from tests.gpu.test_engine_cuda import CONFIG

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

U = 2.0**-8  # bf16 unit roundoff
R = 8  # bf16 roundings in sequence per decoder layer (module docstring)
L = CONFIG["num_hidden_layers"]
ROW_BOUND = R * L * U
ALL_BOUND = math.sqrt(R * L) * U
LENGTHS = (300, 7, 1, 1029)  # a long prompt, short ones, a single token, one past a 1K block


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist()
            for n in LENGTHS]


def float32_logits(seqs: list[list[int]]) -> torch.Tensor:
    """The reference: the same random weights in float32 on CPU (every token's logits).
    Seeded weights are drawn on the device they live on, and CUDA's generator is not CPU's:
    the weights are drawn on CUDA (as the bf16 runs draw them) and copied to the CPU model."""
    drawn = ModelRunner.from_config(CONFIG, ProcessGroups.single("cuda"), torch.float32, seed=3)
    ref = ModelRunner.from_config(CONFIG, ProcessGroups.single("cpu"), torch.float32, seed=3)
    ref.model.load_state_dict({k: v.cpu() for k, v in drawn.model.state_dict().items()})
    del drawn
    return ref.prefill(seqs).float()


def assert_within_bf16_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    d = got - want
    row = d.norm(dim=-1) / want.norm(dim=-1)
    assert row.max() < ROW_BOUND, f"worst row off by {row.max():.4f} (bound {ROW_BOUND:.3f})"
    overall = d.norm() / want.norm()
    assert overall < ALL_BOUND, f"logits off by {overall:.4f} (bound {ALL_BOUND:.4f})"
    d_max = d.abs().max(dim=-1).values
    top2 = want.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * d_max
    flips = decisive & (got.argmax(-1) != want.argmax(-1))
    assert not flips.any(), f"{int(flips.sum())} decisive rows pick another token"
    assert decisive.float().mean() > 0.5, "too few decisive rows: the test would have no teeth"


@cuda
def test_bf16_prefill_on_one_gpu_matches_float32_within_bf16_rounding():
    seqs = prompts()
    bf = ModelRunner.from_config(CONFIG, ProcessGroups.single("cuda"), torch.bfloat16, seed=3)
    got = bf.prefill(seqs).float().cpu()
    assert got.shape == (sum(LENGTHS), CONFIG["vocab_size"])
    assert_within_bf16_rounding(got, float32_logits(seqs))


@cuda
@two_gpus
def test_bf16_cp_prefill_on_two_gpus_matches_float32_within_bf16_rounding():
    """Zigzag CP 2 puts the 300-token prompt's second half-chunk on rank 0 at position 225:
    the run path (causal cuDNN on its own keys, unmasked on the keys before, LSE merge)."""
    from cpmoe.parallel.launch import RankPool
    from tests.gpu._bf16_tasks import cp_prefill_task
    seqs = prompts()
    with RankPool(2, "cuda", collective_timeout_s=300) as pool:
        got = pool.run(cp_prefill_task, CONFIG, seqs)[0]
    assert got.shape == (sum(LENGTHS), CONFIG["vocab_size"])
    assert_within_bf16_rounding(got, float32_logits(seqs))


@cuda
def test_bf16_decode_matches_float32_within_bf16_rounding():
    """bf16 decode on CUDA (paged attention, graphs off) with float32's tokens fed to both
    runs; each step's logits against a float32 CPU prefill of the same token sequence."""
    from cpmoe.engine.runner import Segment
    seqs = prompts()[:3]
    feed = [torch.randint(0, CONFIG["vocab_size"], (12,),
                          generator=torch.Generator().manual_seed(9 + i)).tolist()
            for i in range(len(seqs))]
    bf = ModelRunner.from_config(CONFIG, ProcessGroups.single("cuda"), torch.bfloat16, seed=3)
    bf.allocate_kv(4096)
    keys = list(range(len(seqs)))
    steps = [bf.extend([Segment(k, s) for k, s in zip(keys, seqs)], True).float().cpu()]
    for i in range(len(feed[0])):
        steps.append(bf.decode(keys, [f[i] for f in feed]).float().cpu())
    got = torch.stack(steps, dim=1).reshape(-1, CONFIG["vocab_size"])  # [seq, step] rows
    full = [s + f for s, f in zip(seqs, feed)]
    ref = float32_logits(full)
    ends = torch.tensor([len(s) for s in full]).cumsum(0)
    want = torch.cat([ref[e - len(f) - 1:e] for e, f in zip(ends.tolist(), feed)])
    assert_within_bf16_rounding(got, want)


# ---- serving on CUDA ---------------------------------------------------------------------

@cuda
def test_one_request_served_on_cuda_over_http_follows_the_float32_reference(tmp_path):
    """`cpmoe serve --device cuda` (CUDA graphs on, the default) in float32 on the built-in
    model, one greedy completion of token ids over HTTP. The reference is a float32 CPU
    prefill of prompt + served tokens: at each step the served token must be its argmax
    wherever the CPU top-1/top-2 gap exceeds 2e-3 (twice the 1e-3 that float32 CUDA and CPU
    logits are held to in test_cuda_paths). bf16 tokens are not compared: on this tiny model
    (hidden 128) bf16 rounding moves logits by about 0.2 (CPU, measured), more than most
    top-2 gaps, so no step would be decisive."""
    for package in ("fastapi", "uvicorn", "httpx"):  # the serving extra (device README)
        pytest.importorskip(package)
    import httpx

    from cpmoe.default_model import ensure_default_model
    from tests.e2e._serve_helpers import Server
    cache = tmp_path / "cache"
    server = Server(tmp_path, cache, "--device", "cuda", "--dtype", "float32")
    try:
        server.wait_ready(timeout_s=600)
        prompt = torch.randint(0, 259, (40,), generator=torch.Generator().manual_seed(7))
        body = {"model": server.model, "prompt": prompt.tolist(), "max_tokens": 24,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        served = choice["token_ids"]
        assert len(served) == 24 and resp.json()["usage"]["completion_tokens"] == 24
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CPMOE_CACHE_DIR", str(cache))
        model_dir = ensure_default_model()
    ref = ModelRunner(model_dir, ProcessGroups.single("cpu"), torch.float32,
                      show_progress=False)
    seq = prompt.tolist() + served[:-1]
    logits = ref.prefill([seq])[len(prompt) - 1:]
    top2 = logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2e-3
    wrong = decisive & (logits.argmax(-1) != torch.tensor(served))
    assert not wrong.any(), f"steps {wrong.nonzero().flatten().tolist()} took another token"
    assert decisive.float().mean() > 0.5
