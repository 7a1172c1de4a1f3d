"""The decode kernel sweeps' winners as a $CPMOE_DECODE_KERNELS_CONFIG file.

    python3 -m bench.tuned_tiles EXPERTS.json ATTENTION.json [--skinny SKINNY.json]
        --out tuned.json [--margin 0.015]

EXPERTS.json: `bench.decode_kernels --fp8` at one row count; ATTENTION.json:
`bench.decode_attention` (either may be missing: its kernels keep their tiles).
For each kernel of `cpmoe.ops.launch.TUNABLE` the sweep timed, the fastest tile replaces the
built-in one when it is more than --margin faster: gate/up with QUANT_OUT is credited the
`quantize_act` launch it saves down (the sweep's quantize_act line), and attention tiles
are compared at the sweep's fewest rows (its first shape, the batch the file is for) over
every split count: a winner at another count than `default_num_splits`' also sets
PROGRAMS_PER_SM, the least that makes the rule give that count at those rows (so a larger
batch splits less, as under the built-in 4), and a tile more than --margin slower than the
built-in one at another row count swept, at the split count the rule gives it there, is not
a choice (on an H100 at 8c0b059 the fastest at 64 rows, one split, was 15% slower at 128
rows). SKINNY.json (`bench.fp8_linear`, a finished
sweep): the skinny GEMM's tiles are compared by their time summed over the sweep's shapes
(q/k/v and o_proj, each at the K split `skinny_split` gives it) at the sweep's most rows,
and a tile more than --margin slower than the built-in one at any other row count swept is
not a choice (the file's tiles serve every batch). Writes the file, {} where every kernel keeps
its tiles (the engine reads it with `CPMOE_DECODE_KERNELS_CONFIG=FILE`); prints one line a
kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cpmoe.cp.paged_attention import default_num_splits
from cpmoe.ops.fp8_gemm import skinny_split
from cpmoe.ops.launch import TUNABLE


def _results(path: Path, finished: bool = False) -> list[dict]:
    """The sweep's result rows; [] for a missing file, or with `finished` for a sweep that
    did not write `complete` (cut off before every shape and row count was timed)."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        sys.exit(f"{path}: expected a bench.decode_kernels, bench.decode_attention or "
                 f"bench.fp8_linear JSON with 'results'")
    if finished and data["results"] and not data.get("complete"):
        print(f"{path}: the sweep did not finish (not every shape and row count): "
              f"the skinny GEMM keeps its tiles")
        return []
    return data["results"]


def winners(experts: list[dict], attention: list[dict], margin: float,
            skinny: list[dict] = ()) -> tuple[dict[str, dict], list[str]]:
    """-> ({kernel: its TUNABLE fields from the winning row}, one line a kernel timed)."""
    choice, lines = {}, []
    saved = [r["us"] for r in experts if r.get("gemm") == "quantize_act"]
    groups = [(g, [r for r in experts if r.get("gemm") == g and "us" in r])
              for g in ("gate_up", "down")]
    for dtype, kernel in (("fp8", "attention_fp8"), ("bf16", "attention_16bit")):
        groups.append((kernel, _attention_rows([r for r in attention
                                                 if r.get("dtype") == dtype], margin)))
    groups.append(("skinny", _skinny_rows(list(skinny), margin)))
    for kernel, rows in groups:
        default = [r for r in rows if r.get("default")]
        # QUANT_OUT rows count only where the launch they save was timed
        tiles = [r for r in rows if not r.get("default")
                 and (saved or not r.get("QUANT_OUT"))]
        if not default or not tiles:
            continue

        def cost(r: dict) -> float:
            return r["us"] - (saved[0] if r.get("QUANT_OUT") else 0.0)

        best = min(tiles, key=cost)
        fields = {k: best[k] for k in TUNABLE[kernel] if k in best}
        won = cost(best) < (1.0 - margin) * default[0]["us"]
        lines.append(f"{kernel}: built-in {default[0]['us']:.1f} us, best {cost(best):.1f} us "
                     f"{fields}: {'tuned' if won else 'kept'}")
        if won:
            choice[kernel] = fields
    return choice, lines


def _attention_rows(rows: list[dict], margin: float) -> list[dict]:
    """The sweep's rows at its fewest rows a batch whose split count the rule can give: at
    the built-in count as they are, at another with the PROGRAMS_PER_SM that gives it. A
    tile that is more than `margin` slower than the built-in one at another row count
    swept, at the split count the rule gives it there, or not timed at that count, is left
    out (the file's tiles serve every batch)."""
    if not rows:
        return []
    counts = sorted({r.get("rows", 0) for r in rows})
    at_fewest = [r for r in rows if r.get("rows", 0) == counts[0]]
    built_in = next((r["splits"] for r in at_fewest if r.get("default")), None)
    kept = []
    for r in at_fewest:
        if r.get("default"):
            kept.append(r)
            continue
        if r["splits"] == built_in:
            per_sm = None
        elif (per_sm := _per_sm(r)) is None:
            continue
        if all(_holds(rows, r, per_sm, m, margin) for m in counts[1:]):
            kept.append(r if per_sm is None else dict(r, PROGRAMS_PER_SM=per_sm))
    return kept


def _holds(rows: list[dict], tile: dict, per_sm: int | None, m: int, margin: float) -> bool:
    """Whether the tile's row, under per_sm (None: the rule's built-in count), is at most
    `margin` slower than the built-in tiles at m rows."""
    default = next((r for r in rows if r.get("rows") == m and r.get("default")), None)
    if default is None or not _SHAPE <= set(default):
        return False
    shape = _shape(default)
    splits = (default_num_splits(*shape) if per_sm is None
              else default_num_splits(*shape, programs_per_sm=per_sm))
    same = [r for r in rows if r.get("rows") == m and not r.get("default")
            and r["splits"] == splits and all(r.get(f) == tile.get(f) for f in _TILE)]
    return bool(same) and same[0]["us"] <= (1.0 + margin) * default["us"]


_SHAPE = {"rows", "keys", "kv_heads", "sms", "page"}  # what `default_num_splits` reads
_TILE = ("BLOCK_N", "num_warps", "num_stages", "PAGE_IDS")  # a stage-1 tile, splits aside


def _shape(row: dict) -> tuple[int, int, int, int, int]:
    """`default_num_splits`' arguments for a sweep row's shape."""
    return (row["rows"], row["kv_heads"], -(-row["keys"] // row["page"]), row["page"],
            row["sms"])


def _skinny_rows(rows: list[dict], margin: float) -> list[dict]:
    """One row a skinny tile (BLOCK_N, warps, stages) and one for the built-in tiles: the
    time summed over the sweep's shapes at its most rows, each shape at `skinny_split`'s K
    ranges. A tile missing a shape, or more than `margin` slower than the built-in tiles at
    another row count, is left out."""
    fields = tuple(TUNABLE["skinny"])

    def sums(m: int) -> tuple[float | None, dict[tuple, float]]:
        """(the built-in tiles' sum, {tile: its sum}) at m rows"""
        shapes = {(r["N"], r["K"]) for r in rows if r.get("rows") == m and "N" in r}
        per: dict[tuple, dict] = {}
        for r in rows:
            if r.get("rows") != m or "us" not in r:
                continue
            if r.get("path") == "skinny default":
                per.setdefault("default", {})[(r["N"], r["K"])] = r["us"]
            elif (r.get("path") == "skinny"
                  and r.get("SPLIT_K") == skinny_split(m, r["N"], r["K"])):
                per.setdefault(tuple(r[f] for f in fields), {})[(r["N"], r["K"])] = r["us"]
        whole = {t: sum(us.values()) for t, us in per.items() if set(us) == shapes}
        return whole.pop("default", None), whole

    counts = sorted({r["rows"] for r in rows if r.get("path") == "skinny default"})
    if not counts:
        return []
    at = {m: sums(m) for m in counts}
    default, tiles = at[counts[-1]]
    built_in = _built_in_skinny(rows, counts[-1])
    if default is None or built_in is None:
        return []
    out = [{"default": True, "us": default, **dict(zip(fields, built_in))}]
    for tile, us in tiles.items():
        if all(at[m][0] is not None and at[m][1].get(tile, float("inf"))
               <= (1.0 + margin) * at[m][0] for m in counts[:-1]):
            out.append({"us": us, **dict(zip(fields, tile))})
    return out


def _built_in_skinny(rows: list[dict], m: int) -> tuple | None:
    """The built-in tile as the sweep recorded it at m rows (its "skinny default" rows)."""
    for r in rows:
        if r.get("path") == "skinny default" and r.get("rows") == m and "BLOCK_N" in r:
            return tuple(r[f] for f in TUNABLE["skinny"])
    return None


def _per_sm(row: dict) -> int | None:
    """The least PROGRAMS_PER_SM for which `default_num_splits` gives the row's split count
    at its shape; None for a row without its shape or a count the rule never gives."""
    if not _SHAPE <= set(row):
        return None
    return next((n for n in range(1, 65)
                 if default_num_splits(*_shape(row), programs_per_sm=n) == row["splits"]),
                None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("experts", type=Path)
    p.add_argument("attention", type=Path)
    p.add_argument("--skinny", type=Path,
                   help="a bench.fp8_linear JSON: the skinny FP8 GEMM's tiles too")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--margin", type=float, default=0.015,
                   help="how much faster a tile must be to replace the built-in one")
    args = p.parse_args(argv)
    skinny = _results(args.skinny, finished=True) if args.skinny else []
    choice, lines = winners(_results(args.experts), _results(args.attention), args.margin,
                            skinny)
    print("\n".join(lines) if lines else "no sweep results: every kernel keeps its tiles")
    args.out.write_text(json.dumps(choice, indent=1) + "\n")
    print(f"wrote {args.out} ({', '.join(choice) or 'no kernel tuned'}): "
          f"CPMOE_DECODE_KERNELS_CONFIG={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
