#!/bin/bash
# One GPU: 04's test suite, then the A/B of its forward on tensor descriptors (tma_ab.py: descriptors, pointer
# loads, warp-specialized, tile configs, RoPE + cuDNN) with a per-kernel profile. Run from the repository root of a
# copy, OUT set, with 04 and its tests as at 8d8f457 (md5 77b0d811):
#   git show 8d8f457:04_rope_attention.py > 04_rope_attention.py
#   git show 8d8f457:tests/test_04_rope_attention.py > tests/test_04_rope_attention.py
set -o pipefail
export PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00')
hdr() {
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python3 -c "import torch, triton; print(f'# torch {torch.__version__}; triton {triton.__version__}')"
  echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a); 04 md5 $(md5sum 04_rope_attention.py | cut -c1-8)"
  echo "# $1"
}
C="python3 -m pytest tests/test_04_rope_attention.py -q -n 8 -p no:cacheprovider -rfs"
{ hdr "$C"; timeout 200 $C; echo "# exit $?"; } > $OUT/04_hopper_pytest_descriptors_$G.log 2>&1; tail -3 $OUT/04_hopper_pytest_descriptors_$G.log
C="python3 results/04_tools/tma_ab.py --configs --profile"
{ hdr "$C"; timeout 330 $C; echo "# exit $?"; } 2>&1 | tee $OUT/04_hopper_tma_ab_$G.log
