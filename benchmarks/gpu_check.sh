#!/usr/bin/env bash
# The GPU checks, for a machine with one CUDA GPU (under 8 minutes on one H200-class GPU):
# the CUDA tests (NaN origin in fp16, scheduler holding with fused AdamW, syncs per step), then
# the GPT-2-small fp16 autocast + GradScaler step, plain vs default, and one replay's time; then the
# parameter-heavy workloads (wide MLP 12.6M, conv net 7.8M) and the small ones.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q tests/test_cuda.py
python benchmarks/overhead.py --only gpt2-small --reps "${REPS:-5}"
python benchmarks/overhead.py --only mlp,conv,tiny,encoder,gpt2 --reps "${REPS:-5}"
