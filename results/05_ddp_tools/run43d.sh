#!/bin/bash
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
  echo "# two GPUs, DDP's wrapper (05 at 1290b29, md5 $(md5sum _05_ddp.py | cut -c1-8)): torchrun --standalone --nproc_per_node=2 _05_ddp.py $A"
  timeout 150 torchrun --standalone --nproc_per_node=2 _05_ddp.py $A
} 2>&1 | grep -v "$F" | tee $OUT/05_ddp_bench_H200x2.log | grep "ms/step\|#\|rror"
B="--bench --bench-steps 14 --bench-rounds 1 --bench-paths fused+compile+graphs"
{ hdr
  echo "# two GPUs: torchrun --standalone --nproc_per_node=2 .dev/ddp_prof.py $B"
  timeout 120 torchrun --standalone --nproc_per_node=2 .dev/ddp_prof.py $B
} 2>&1 | grep -v "$F" | tee $OUT/05_ddp_profile_H200x2.log | grep "rank\|ms/step\|rror"
