#!/bin/bash
# Issue 41 on one GPU (H100 or H200), from the repository root: 04's test suite, then the A/B of its forward on
# tensor descriptors against pointer loads and RoPE + cuDNN (results/04_tools/tma_ab.py), then the descriptor
# forward under other tile configs, then the eager calls' host cost. Logs go to $OUT (./out41 if unset).
# About 9 minutes at most: each step has its own timeout.
set -o pipefail
cd "$(dirname "$0")"; while [ ! -f 04_rope_attention.py ] && [ "$PWD" != / ]; do cd ..; done
OUT=${OUT:-$PWD/out41}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o '[ABHL][0-9]\+' | head -1)
G=${G:-gpu}
hdr() {
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python3 -c "import torch, triton; print(f'# torch {torch.__version__}; triton {triton.__version__}')"
  echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a); 04 md5 $(md5sum 04_rope_attention.py | cut -c1-8)"
}
N=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")

{ hdr; echo "# timeout 210 python3 -m pytest tests/test_04_rope_attention.py -q $N -p no:cacheprovider"
  timeout 210 python3 -m pytest tests/test_04_rope_attention.py -q $N -p no:cacheprovider; echo "# exit $?"
} > "$OUT/pytest_04_gpu_$G.log" 2>&1
tail -3 "$OUT/pytest_04_gpu_$G.log"

{ hdr; echo "# timeout 150 python3 results/04_tools/tma_ab.py"
  timeout 150 python3 results/04_tools/tma_ab.py; echo "# exit $?"
} 2>&1 | tee "$OUT/04_tma_ab_$G.log"

{ hdr; echo "# timeout 110 python3 results/04_tools/tma_ab.py --configs"
  timeout 110 python3 results/04_tools/tma_ab.py --configs; echo "# exit $?"
} > "$OUT/04_tma_configs_$G.log" 2>&1
grep "descriptors\|pointer\|exit" "$OUT/04_tma_configs_$G.log"

{ hdr; echo "# timeout 45 python3 results/04_tools/host_cost.py"
  timeout 45 python3 results/04_tools/host_cost.py; echo "# exit $?"
} 2>&1 | tee "$OUT/04_host_cost_$G.log"
