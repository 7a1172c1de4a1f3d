"""DeepSeek-V4 (DeepseekV4ForCausalLM), one room per concern. Reading order:

- `config.py`: `DeepseekV4Config` from HF's config.json, its layer kinds (CSA, HCA,
  sliding) and the layouts it accepts (`check_v4_layout`).
- `model.py`: MoE, hyper-connections, decoder layer, model, causal-LM head; the decoder layer
  picks the prefill or the decode path for attention.
- `attention.py`: queries, the K side, compressor and indexer modules and the output
  projection (types the two paths use; it imports neither).
- `prefill.py` (extend, exact under any CP split; `extend.py`: what a chunk reads of its
  cached prefix) and `decode.py` (every row at once over the static cache), over `cache.py` (`V4Cache`: per-sequence slots, CP-sharded compressed
  entries) and `state.py` (its static tensors and `DecodeStep`).
- Kernels: `indexer.py` (lightning-indexer scores and top-k), `sparse.py` (sparse sink
  attention), `rope.py` (query norm + RoPE), `hyper_connection.py`; `graph.py` captures the
  decode step as CUDA graphs.
"""
