"""CP attention alone at 64K and 128K tokens: cpmoe's CP path vs PyTorch's ring
`context_parallel`, each against one-GPU SDPA in the same run; JSON to bench/results/.

    python3 bench/attention_cp.py                      # 2 GPUs, 65536,131072 tokens
    python3 bench/attention_cp.py --device cpu --smoke # tiny sizes on gloo (tests)

The code lives in cpmoe/bench/attention_cp.py (spawned ranks import it from there).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cpmoe without an install
    from cpmoe.bench.attention_cp import main
    sys.exit(main())
