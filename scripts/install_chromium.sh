#!/usr/bin/env bash
# Install Debian's headless-capable Chromium for the browser test (tests/test_browser.py).
# Prints the path of the chromium binary on success.
# Exit codes: 0 installed (or already there), 3 apt-get unavailable / not permitted, other: apt failed.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
  command -v chromium
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-get not found: install Chromium yourself (a 'chromium' binary on PATH)" >&2
  exit 3
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "not root and no password-less sudo: cannot apt-get install chromium" >&2
    exit 3
  fi
fi

export DEBIAN_FRONTEND=noninteractive
# -o DPkg::Lock::Timeout waits for another apt run instead of failing at once.
$SUDO apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
$SUDO apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends chromium >&2
command -v chromium
