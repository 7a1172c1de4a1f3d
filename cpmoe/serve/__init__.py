"""OpenAI-compatible serving: `cpmoe serve` (HTTP in the parent process, the engine on the ranks).

server.py (startup and exit), options.py (its flags), app.py (HTTP routes), protocol.py
(request validation and response bodies), engine_client.py (the parent's side of the engine;
the task every rank runs is engine/serving.py), detokenize.py, logprobs.py, metrics.py.
"""
