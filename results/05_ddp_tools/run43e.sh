#!/bin/bash
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source <(sed -n '/^hdr()/,/^}/p' .dev/run43b.sh)
B="--bench --bench-steps 20 --bench-rounds 2 --bench-paths fused+compile+graphs"
F="^W1\|OMP_NUM_THREADS\|^\*\*\*\*\|Profiler record\|UserWarning\|return func"
{ hdr
  for v in chunks1 chunks4; do
    echo "# one GPU: VARIANT=$v CUDA_VISIBLE_DEVICES=0 python3 .dev/ddp_variants3.py $B"
    VARIANT=$v CUDA_VISIBLE_DEVICES=0 timeout 80 python3 .dev/ddp_variants3.py $B
  done
  for v in chunks1 chunks2 chunks4 chunks12 chunks4:50 chunks4:10; do
    echo "# two GPUs: VARIANT=$v torchrun --standalone --nproc_per_node=2 .dev/ddp_variants3.py $B"
    VARIANT=$v timeout 75 torchrun --standalone --nproc_per_node=2 .dev/ddp_variants3.py $B
  done
} 2>&1 | grep -v "$F" | tee $OUT/05_ddp_variants3_H200x2.log | grep "ms/step\|variant\|#\|rror"
