"""$CPMOE_DECODE_KERNELS_CONFIG (cpmoe.ops.launch.tuned): a JSON file of decode kernel tiles
that replace the built-in choices of the experts' W8A8 GEMMs, decode attention's stage 1
and the skinny FP8 GEMM; a bad file, kernel, field or value exits in one line naming it."""

import json

import pytest

from cpmoe.cp import paged_attention
from cpmoe.moe import fused_moe
from cpmoe.ops import fp8_gemm, launch


@pytest.fixture
def tuned_file(tmp_path, monkeypatch):
    def write(spec) -> str:
        path = tmp_path / "tuned.json"
        path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
        monkeypatch.setenv(launch.TUNED_ENV, str(path))
        launch._tuned_file.cache_clear()
        return str(path)
    yield write
    launch._tuned_file.cache_clear()  # the next test reads its own environment


def test_tuned_tiles_replace_the_built_in_ones_where_they_apply(tuned_file, monkeypatch):
    monkeypatch.delenv(launch.TUNED_ENV, raising=False)
    launch._tuned_file.cache_clear()
    base_down = fused_moe.gemm_config(512, 128, 768, True, "w8a8", gated=False)
    base_attention = paged_attention.stage1_config(True, 128)
    assert fp8_gemm.skinny_config(64, 5120, 2048) == {"BLOCK_N": 64, "num_warps": 4,
                                                      "num_stages": 3, "SPLIT_K": 2}
    tuned_file({"down": {"TILES": 4, "num_stages": 4},
                "gate_up": {"BLOCK_N": 128, "QUANT_OUT": True},
                "attention_fp8": {"PAGE_IDS": 64, "num_stages": 3},
                "skinny": {"BLOCK_N": 32, "num_stages": 4}})
    # the skinny GEMM's tiles, its K split still the rule's (2 ranges for q/k/v, 4 for o_proj)
    assert fp8_gemm.skinny_config(64, 5120, 2048) == {"BLOCK_N": 32, "num_warps": 4,
                                                      "num_stages": 4, "SPLIT_K": 2}
    assert fp8_gemm.skinny_config(64, 2048, 4096)["SPLIT_K"] == 4
    down = fused_moe.gemm_config(512, 128, 768, True, "w8a8", gated=False)
    assert down == dict(base_down, TILES=4, num_stages=4)
    gate_up = fused_moe.gemm_config(512, 128, 2048, True, "w8a8")
    assert gate_up["BLOCK_N"] == 128 and gate_up["QUANT_OUT"]
    # W8A8 with at least as many slots as experts only: batch 1's compact grid and
    # weights-only FP8 keep theirs
    assert not fused_moe.gemm_config(8, 128, 2048, True, "w8a8")["QUANT_OUT"]
    assert not fused_moe.gemm_config(512, 128, 2048, True, "weights")["QUANT_OUT"]
    assert paged_attention.stage1_config(True, 128) == dict(base_attention, PAGE_IDS=64,
                                                            num_stages=3)
    assert paged_attention.stage1_config(False, 128)["PAGE_IDS"] == 0  # 16-bit pools: not set


@pytest.mark.parametrize("spec, says", [
    ("{not json", "expected a JSON file"),
    ({"experts": {"TILES": 2}}, "expected an object with keys among"),
    ({"down": {"TILE": 2}}, "down: expected fields of"),
    ({"attention_fp8": {"PAGE_IDS": "64"}}, "attention_fp8: expected fields of"),
    ({"gate_up": {"QUANT_OUT": 1}}, "gate_up: expected fields of"),
    # values Triton would fail on at compile time, deep in a step
    ({"skinny": {"BLOCK_N": 48}}, "skinny.BLOCK_N: expected a power of two of at least 16, "
                                  "got 48"),
    ({"attention_fp8": {"BLOCK_N": 8}}, "attention_fp8.BLOCK_N: expected a power of two of "
                                        "at least 16, got 8"),  # tl.dot's least side
    # the experts' column tiles divide the weights' 128-column scale blocks
    ({"gate_up": {"BLOCK_N": 256}}, "gate_up.BLOCK_N: expected a power of two of at least 16 "
                                    "and at most 128, got 256"),
    ({"down": {"num_warps": 6}}, "down.num_warps: expected a power of two, got 6"),
    ({"attention_fp8": {"PAGE_IDS": 24}}, "PAGE_IDS: expected 0 or a power of two, got 24"),
    ({"attention_16bit": {"PROGRAMS_PER_SM": 0}}, "expected a positive integer, got 0"),
    ({"gate_up": {"num_stages": -1}}, "gate_up.num_stages: expected a positive integer"),
])
def test_a_bad_tuned_file_exits_in_one_line_naming_it(tuned_file, spec, says):
    path = tuned_file(spec)
    with pytest.raises(SystemExit) as e:
        launch.tuned("down")
    msg = str(e.value)
    assert msg.startswith(f"{launch.TUNED_ENV}={path}: ") and says in msg and "\n" not in msg
