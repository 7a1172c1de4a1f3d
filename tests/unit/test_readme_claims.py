"""README's claims about what is tested and docs/flags.md's about what is slow, held to the
code: a claim that goes stale (the layout matrix changes, a flag loses its warning) fails here."""

from __future__ import annotations

from pathlib import Path

from cpmoe.cli import build_parser
from cpmoe.parallel.layout import LayoutError, ParallelLayout
from tests.distributed.test_layouts import MATRIX, layout_id

_ROOT = Path(__file__).resolve().parents[2]
README = (_ROOT / "README.md").read_text()
_README_FLAT = " ".join(README.split())
# the flag reference moved out of the README into docs/flags.md (issue 46)
_FLAGS_FLAT = " ".join((_ROOT / "docs" / "flags.md").read_text().split())


def _valid(tp: int) -> set[str]:
    """Every layout ParallelLayout accepts at tp ranks (sizes over all divisors of tp, every
    backend), found here by trying them rather than by the matrix's own enumeration."""
    divisors = [d for d in range(1, tp + 1) if tp % d == 0]
    out = set()
    for cp in divisors:
        for dp in divisors:
            for ep in divisors:
                for backend in ("none", "alltoall", "alltoall_padded"):
                    try:
                        lay = ParallelLayout(tp_size=tp, attn_cp_size=cp, moe_dp_size=dp,
                                             ep_size=ep, moe_a2a_backend=backend)
                    except LayoutError:
                        continue
                    out.add(layout_id(lay).rsplit("-", 1)[0])
    return out


def _coverage(tp: int) -> dict:
    valid = _valid(tp)
    cases = [layout_id(lay) for lay in MATRIX if lay.tp_size == tp]
    layouts = {c.rsplit("-", 1)[0] for c in cases}
    assert layouts <= valid
    both = {c for c in layouts
            if all(f"{c}-{s}" in cases for s in ("zigzag", "interleave"))}
    with_cp = {c for c in valid if "-cp1-" not in c}
    return {"valid": len(valid), "run": len(layouts), "with_cp": len(with_cp),
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
    assert (two["valid"], four["valid"], eight["valid"]) == (9, 18, 29)  # as of issue 17


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command" or hasattr(a, "choices")
               and isinstance(a.choices, dict))
    return " ".join(sub.choices[command].format_help().split())


def test_help_and_flag_reference_say_which_paths_are_slow_on_cuda():
    for command in ("generate", "check", "serve"):
        text = _help(command)
        assert "interleave (exact, but on CUDA a slow fallback" in text, command
        assert "On CUDA only bfloat16 takes the fast paths" in text, command
    assert "takes the slow masked fallback" in _FLAGS_FLAT
    assert "`--dtype float16` runs the experts as a loop" in _FLAGS_FLAT
