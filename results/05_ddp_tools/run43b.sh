#!/bin/bash
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
hdr() {
  echo "# device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | paste -sd ';')"
  python3 -c "import torch,triton,transformers,sys;print('# torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__,'python',sys.version.split()[0])"
  echo "# date: $(date -u '+%Y-%m-%d %H:%M UTC'); md5: $(md5sum 0*.py | awk '{printf "%s %s ", $2, substr($1,1,8)}')"
}
B="--bench --bench-steps 14 --bench-rounds 1 --bench-paths fused+compile+graphs"
F="grep -v ^W1\|OMP_NUM_THREADS\|^\*\*\*\*\|Profiler"
{ hdr
  echo "# one GPU: CUDA_VISIBLE_DEVICES=0 python3 .dev/ddp_prof.py $B"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 .dev/ddp_prof.py $B
  for v in base static; do
    echo "# two GPUs: VARIANT=$v torchrun --standalone --nproc_per_node=2 .dev/ddp_prof.py $B"
    VARIANT=$v timeout 120 torchrun --standalone --nproc_per_node=2 .dev/ddp_prof.py $B
  done
} 2>&1 | grep -v "^W1\|OMP_NUM_THREADS\|^\*\*\*\*\|Profiler record" | tee $OUT/05_ddp_profile_H200x2.log | grep "rank\|ms/step"
[ -n "$1" ] && { export PYTHONPATH=$PWD/.bench_deps; echo "# python3 04_rope_attention.py --results results (GPU 0 of nvidia-h200-x2)"; hdr; CUDA_VISIBLE_DEVICES=0 timeout 200 python3 04_rope_attention.py --results $OUT; } 2>&1 | tee $OUT/04_rope_attention_H200.log | tail -3
