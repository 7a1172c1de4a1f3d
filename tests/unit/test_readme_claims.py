"""README's claims about what is tested and what is slow, held to the code: a claim that
goes stale (the layout matrix changes, a flag loses its warning) fails here."""

from __future__ import annotations

from pathlib import Path

from cpmoe.cli import build_parser
from tests.distributed.test_layouts import MATRIX, layout_id, valid_layouts

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
_README_FLAT = " ".join(README.split())


def _coverage(tp: int) -> dict:
    valid = {layout_id(lay).rsplit("-", 1)[0] for lay in valid_layouts(tp)}
    cases = [layout_id(lay) for lay in MATRIX if lay.tp_size == tp]
    layouts = {c.rsplit("-", 1)[0] for c in cases}
    both = {c for c in layouts
            if all(f"{c}-{s}" in cases for s in ("zigzag", "interleave"))}
    with_cp = {c for c in valid if "-cp1-" not in c}
    return {"valid": len(valid), "run": len(layouts & valid), "with_cp": len(with_cp),
            "both": len(both), "all_run": layouts == valid}


def test_readme_states_the_layout_matrix_as_it_is():
    two, four, eight = _coverage(2), _coverage(4), _coverage(8)
    assert two["all_run"] and two["both"] == 0
    assert f"2 ranks: all {two['valid']} valid layouts, one CP strategy each" in _README_FLAT
    assert four["all_run"]
    assert (f"4 ranks: all {four['valid']} valid layouts, both CP strategies on "
            f"{four['both']} of the {four['with_cp']} with CP > 1") in _README_FLAT
    assert not eight["all_run"] and eight["both"] == 0
    assert (f"8 ranks: {eight['run']} of the {eight['valid']} valid layouts") in _README_FLAT
    assert "every valid layout of 2, 4 and 8" not in _README_FLAT


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command" or hasattr(a, "choices")
               and isinstance(a.choices, dict))
    return " ".join(sub.choices[command].format_help().split())


def test_help_and_readme_say_which_paths_are_slow_on_cuda():
    for command in ("generate", "check", "serve"):
        text = _help(command)
        assert "interleave (exact, but on CUDA a slow fallback" in text, command
        assert "On CUDA only bfloat16 takes the fast paths" in text, command
    assert "takes the slow masked fallback" in _README_FLAT
    assert "`--dtype float16` runs the experts as a loop" in _README_FLAT
