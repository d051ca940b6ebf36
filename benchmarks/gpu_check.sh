#!/usr/bin/env bash
# The GPU checks, for a machine with one CUDA GPU (under 8 minutes on one H200-class GPU):
# the CUDA tests (NaN origins in fp16, scheduler holding with fused AdamW and real 16-mixed Lightning fits,
# syncs per step, peak memory, checkpointing, inductor, DDP on NCCL), then the GPT-2-small fp16
# autocast + GradScaler step, plain vs default, and one replay's time; then the parameter-heavy
# workloads (wide MLP 12.6M, conv net 7.8M), the small ones and the peak memory of a dropped-logits step.
# Each part runs even when one before it failed; the script's status is the first failure's.
cd "$(dirname "$0")/.."
status=0
run() { "$@" || { rc=$?; echo "FAILED ($rc): $*"; [ "$status" -ne 0 ] || status=$rc; }; }
run "${PYTHON:-python}" -m pytest -q -p no:cacheprovider tests/test_cuda.py
run "${PYTHON:-python}" benchmarks/overhead.py --only gpt2-small --reps "${REPS:-5}"
run "${PYTHON:-python}" benchmarks/overhead.py --only mlp,conv,tiny,encoder,gpt2,memory --reps "${REPS:-5}"
exit "$status"
