"""OpenAI-compatible serving: `cpmoe serve` (HTTP in the parent process, the engine on the ranks).

server.py (startup and exit), app.py (HTTP routes), protocol.py (request validation and
response bodies), engine_client.py (the parent's side of the engine), engine_loop.py (the
task every rank runs), scheduler.py (continuous batching on rank 0), detokenize.py, metrics.py.
"""
