"""cpmoe: Mixture-of-Experts inference with attention context parallelism (a long prompt split
over GPUs) and the MoE layers under their own layout (expert, MoE tensor and MoE data
parallel), with SGLang's flags and an OpenAI-compatible server.

A newcomer's reading order, from where a request enters down to the collectives:

1. Entry. `cli/main.py:build_parser` names every command; `cli/flags.py:resolve` checks a
   layout, a model and a device before any rank exists; `parallel/launch.py:launch` starts
   the ranks. `cpmoe serve` is `serve/server.py:serve` (uvicorn) over `serve/app.py:build_app`
   (the OpenAI routes); a request becomes `serve/jobs.py:Job`s and reaches the engine through
   `serve/engine_client.py:EngineClient`.
2. The step loop, one for generate and serve. `engine/engine.py:engine_loop` runs
   `engine/engine.py:Driver` steps; `engine/scheduler.py:Scheduler.plan` picks each step's
   prefill chunks and decode rows (`engine/request.py:StepPlan`) over the paged KV cache
   `cp/kv_cache.py:PagedKVCache` (its pages sharded over CP ranks) and the prefix cache
   `engine/radix.py`; `engine/runner.py:ModelRunner` runs a step (`ModelRunner.prefill`,
   `ModelRunner.decode`; CUDA graphs in `engine/cuda_graph.py`).
3. The model. `models/registry.py:load_model_config` maps config.json to a model:
   `models/qwen_moe/model.py:QwenMoeForCausalLM` (Qwen3-MoE, Qwen2-MoE) or
   `models/deepseek_v4/model.py:DeepseekV4ForCausalLM`, read top to bottom with HF names;
   `loader.py:load_checkpoint` fills this rank's shards; `models/base.py:CausalLMHead` is
   the interface the runner uses.
4. The parallel layer. `parallel/layout.py:ParallelLayout` (pure sizes and validation) and
   `parallel/groups.py:ProcessGroups` (built once, passed explicitly);
   `communicator.py:LayerCommunicator` moves tokens between the attention and MoE layouts;
   `cp/attention.py:prefill_attention` attends a CP chunk;
   `moe/dispatch/__init__.py:create_dispatcher` picks the expert dispatch backend and
   `moe/experts.py:LocalExperts` runs this rank's experts; every collective is in
   `parallel/comm.py`, the kernels in `ops/`.
"""
