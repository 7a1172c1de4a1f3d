"""The server's batch log (SGLang's "Prefill batch." / "Decode batch." lines) from step stats."""

from __future__ import annotations

import re

import pytest

from cpmoe.serve.metrics import BatchLog


def _stats(kind: str, prefill: int = 0, cached: int = 0, seqs: int = 0, running: int = 4,
           waiting: int = 2, step_s: float = 0.0125) -> dict:
    return {"kind": kind, "step_s": step_s, "running": running, "waiting": waiting,
            "kv_used": [300, 100], "kv_cached": [0, 0], "preemptions": 0,
            "new_seqs": seqs, "prefill_tokens": prefill, "cached_tokens": cached}


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_every_prefilling_step_logs_its_sequences_tokens_usage_and_time():
    lines: list[str] = []
    log = BatchLog(decode_interval=40, write=lines.append)
    log.on_step(_stats("prefill", prefill=6528, cached=0, seqs=3), tokens=3, kv_capacity=1000)
    log.on_step(_stats("mixed", prefill=128, cached=2048, seqs=1), tokens=4, kv_capacity=1000)
    assert len(lines) == 2
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\.\d{3}\] Prefill batch\. #new-seq: 3, "
                        r"#new-token: 6528, #cached-token: 0, token usage: 0\.20, "
                        r"#running-req: 4, #queue-req: 2, step: 12\.5 ms", lines[0]), lines[0]
    assert "#new-seq: 1, #new-token: 128, #cached-token: 2048," in lines[1]


@pytest.mark.parametrize("interval", [0, 3])
def test_decode_steps_log_every_interval_with_the_throughput_since_the_last_line(interval):
    lines: list[str] = []
    clock = _Clock()
    log = BatchLog(decode_interval=interval, write=lines.append, clock=clock)
    for _ in range(7):  # 7 decode steps of 8 tokens, 10 ms apart
        clock.now += 0.01
        log.on_step(_stats("decode"), tokens=8, kv_capacity=1000)
    if interval == 0:
        assert lines == []
        return
    assert len(lines) == 2  # after steps 3 and 6
    for line in lines:  # 24 tokens in 30 ms
        assert "Decode batch. #running-req: 4, token usage: 0.20, " \
               "gen throughput (token/s): 800.0, #queue-req: 2, step: 12.5 ms" in line, line


def test_a_mixed_step_counts_its_tokens_but_not_as_a_decode_step():
    lines: list[str] = []
    clock = _Clock()
    log = BatchLog(decode_interval=2, write=lines.append, clock=clock)
    clock.now += 0.1
    log.on_step(_stats("mixed", prefill=10, seqs=1), tokens=5, kv_capacity=1000)
    clock.now += 0.1
    log.on_step(_stats("decode"), tokens=5, kv_capacity=1000)
    clock.now += 0.1
    log.on_step(_stats("decode"), tokens=5, kv_capacity=1000)
    assert len(lines) == 2 and lines[0].endswith("step: 12.5 ms")
    assert "gen throughput (token/s): 50.0," in lines[1]  # 15 tokens in 0.3 s
