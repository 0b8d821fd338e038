#!/bin/bash
# 04's GPU tests, then 05's step at BERT-base's shape (04 unchanged at s = 512), with the torch path.
# Run from the repository root on a GPU, OUT set.
set -o pipefail
export PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00')
hdr() {
  echo "# $1"; echo "# device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python3 -c "import torch, triton, transformers, sys; print(f'# torch {torch.__version__} triton {triton.__version__} transformers {transformers.__version__} python {sys.version.split()[0]}')"
  echo "# date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "# md5: $(for f in 0[1-5]_*.py; do echo -n "$f $(md5sum $f | cut -c1-8) "; done)"
}
C="python3 -m pytest tests/test_04_rope_attention.py -q -n 8 -p no:cacheprovider -rfs"
{ hdr "$C"; timeout 150 $C; echo "# exit $?"; } > $OUT/pytest_04_gpu_$G.log 2>&1; tail -2 $OUT/pytest_04_gpu_$G.log
C="python3 05_train_roformer_mlm.py --bench --bench-steps 10 --bench-rounds 2 --bench-paths fused+compile+graphs,hf+compile,torch,torch+compile+graphs"
{ hdr "$C"; timeout 420 $C; echo "# exit $?"; } 2>&1 | tee $OUT/05_bench_step_$G.log | grep -v "^ \|Warn\|warn"
