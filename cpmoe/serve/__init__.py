"""OpenAI-compatible serving: `cpmoe serve` (HTTP in the parent process, the engine on the ranks).

server.py (startup and exit), options.py (its flags), app.py (HTTP routes), protocol.py
(the request schema and its validation), jobs.py (a request -> its engine jobs),
responses.py (response bodies), engine_client.py (the parent's side of the engine;
the task every rank runs is engine/serving.py), detokenize.py, logprobs.py, metrics.py.
"""
