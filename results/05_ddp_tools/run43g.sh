#!/bin/bash
# 05 under torchrun on nvidia-h200-x2: bench (one GPU, then two), losses (one GPU x2 accumulation against two), 05's GPU tests.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source <(sed -n '/^hdr()/,/^}/p' .dev/run43b.sh)
A="--bench --bench-steps 20 --bench-rounds 3 --bench-paths fused+compile+graphs,fused+compile"
F="^W1\|OMP_NUM_THREADS\|^\*\*\*\*\|Profiler record\|UserWarning\|return func"
{ hdr; nvidia-smi topo -m | head -3
  echo "# one GPU: CUDA_VISIBLE_DEVICES=0 python3 05_train_roformer_mlm.py $A"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 05_train_roformer_mlm.py $A
  echo "# two GPUs: torchrun --standalone --nproc_per_node=2 05_train_roformer_mlm.py $A"
  timeout 150 torchrun --standalone --nproc_per_node=2 05_train_roformer_mlm.py $A
} 2>&1 | grep -v "$F" | tee $OUT/05_ddp_bench_H200x2.log | grep "ms/step\|#\|rror"
L="--max-steps 60 --dropout 0 --log-interval 5 --eval-interval 30"
{ hdr
  echo "# one GPU, twice the accumulation: CUDA_VISIBLE_DEVICES=0 python3 05_train_roformer_mlm.py $L --grad-accum 2 --out /tmp/one"
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 05_train_roformer_mlm.py $L --grad-accum 2 --out /tmp/one
  echo "# two GPUs: torchrun --standalone --nproc_per_node=2 05_train_roformer_mlm.py $L --out /tmp/two"
  timeout 100 torchrun --standalone --nproc_per_node=2 05_train_roformer_mlm.py $L --out /tmp/two
  echo "# python3 compare_losses.py"; python3 .dev/compare_losses.py
} 2>&1 | grep -v "$F" | tee $OUT/05_ddp_losses_H200x2.log | tail -17
C="python3 -m pytest tests/test_05_train_roformer_mlm.py -q -p no:cacheprovider -rfs"
{ echo "# $C"; hdr; timeout 240 $C; } 2>&1 | tail -30 > $OUT/pytest_05_gpu_H200x2.log
tail -3 $OUT/pytest_05_gpu_H200x2.log
