"""Dispatch + combine effective bandwidth of each cpmoe rank-local dispatch backend on 2 GPUs
(Qwen3-30B-A3B-like routing: hidden 2048 bf16, 128 experts top-8, 4K..64K tokens per rank)
against NCCL all_to_all_single bus bandwidth for the same bytes; JSON to bench/results/.

    python3 bench/dispatch.py                        # 2 GPUs
    python3 bench/dispatch.py --device cpu --smoke   # tiny sizes on gloo (tests)

The code lives in cpmoe/bench/dispatch.py (spawned ranks import it from there).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cpmoe without an install
    from cpmoe.bench.dispatch import main
    sys.exit(main())
