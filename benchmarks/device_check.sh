#!/usr/bin/env bash
# Everything kvflow proves on a CUDA GPU, in one go (about 5 minutes; give it 10):
#   1. every CUDA test (tests/test_cuda.py and the CUDA event tests);
#   2. the staged demo on CUDA caches, verified bit-exact;
#   3. the device benchmark: staged device-to-host and host-to-device GB/s against a plain copy_;
#   4. vLLM end to end on the GPU with a tiny model: a first engine stores, a fresh one loads
#      (external hits, tokens identical to an engine without the connector).
# It needs a Python whose torch is a CUDA build (PYTHON=..., default .venv/bin/python, else python3)
# and, for step 4, vLLM built for CUDA in that Python; step 4 is skipped with a message otherwise.
# Results go to $OUT (default ./device-check) as logs and JSON; the script exits non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-device-check}
mkdir -p "$OUT"
status=0
step() { echo "== $1"; shift; if ! "$@"; then echo "!! failed: $*"; status=1; fi; }

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
  echo "no CUDA device visible to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)'))"; exit 2; }
"$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__)' | tee "$OUT/gpu.txt"

step "CUDA tests" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_events.py -m cuda \
  --junitxml="$OUT/cuda-tests.xml"
step "staged demo on CUDA caches" bash -c "\"$PY\" -m kvflow.cli demo --device cuda --json > \"$OUT/demo-cuda.json\""
step "device benchmark" bash -c "\"$PY\" -m kvflow.cli bench --staged --device cuda --json > \"$OUT/bench-staged-cuda.json\""
cat "$OUT/bench-staged-cuda.json" 2>/dev/null; echo

if "$PY" -c 'import vllm' 2>/dev/null; then
  step "vLLM on CUDA: store, then load in a fresh engine" env KVFLOW_REQUIRE_VLLM=1 "$PY" -m pytest -q \
    -p no:cacheprovider tests/integrations/vllm/test_connector.py \
    -k "first_engine or second_engine or loaded_kv_is_what" --junitxml="$OUT/vllm-cuda.xml"
else
  echo "== vLLM is not installed in $PY: the vLLM end-to-end step is skipped"
fi
exit $status
