#!/bin/bash
# A/B: 04 at 3d8d14f against causal query blocks longest first. (04_hopper_longest_first_ab_H100.log has a third
# row, "lf_fwd128": the longest-first code once more, under another name.)
# Run from the repository root on a GPU, OUT set. The versions of 04 it names, made beforehand:
#   git show 3d8d14f:04_rope_attention.py > .dev/04_head.py   (pointer loads; md5 4d452694)
#   git show 8d8f457:04_rope_attention.py > .dev/04_desc.py   (forward on tensor descriptors; md5 77b0d811)
#   .dev/04_head.py patched with results/04_tools/variants/{longest_first,pipelined}.patch ->
#   .dev/04_longest.py (md5 67ea8e3f), .dev/04_pipelined.py (md5 a2ec3d16)
set -o pipefail
export PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00')
C="python3 results/04_tools/ab_files.py before=.dev/04_head.py longest_first=.dev/04_longest.py"
{ echo "# $(date -u '+%Y-%m-%d %H:%M UTC'); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"; echo "# $C"; timeout 400 $C; echo "# exit $?"; } 2>&1 | tee $OUT/04_hopper_longest_first_ab_$G.log
