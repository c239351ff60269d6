#!/usr/bin/env bash
# Install Debian's headless-capable Chromium for the browser tests (tests/test_browser.py).
# Prints the path of the browser binary on success. Works on a clean Debian machine or container
# (runs apt-get update first; as root, or through password-less sudo).
# Exit codes: 0 installed (or already there), 3 no apt-get on this machine (the tests skip),
#             4 apt-get is there but this user may not run it (the tests fail and say how to fix it),
#             other: apt-get or the installed browser failed.
set -euo pipefail

BROWSERS="chromium chromium-browser google-chrome google-chrome-stable"

working_browser() {
  local name path
  for name in $BROWSERS; do
    path=$(command -v "$name" 2>/dev/null) || continue
    # Ubuntu's "chromium" is a snap shim that fails in containers: insist on a binary that runs.
    if "$path" --version >/dev/null 2>&1; then
      echo "$path"
      return 0
    fi
  done
  return 1
}

if working_browser; then
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
    echo "not root and no password-less sudo: run 'sudo $0' once (it installs Debian's chromium)" >&2
    exit 4
  fi
fi

export DEBIAN_FRONTEND=noninteractive
# -o DPkg::Lock::Timeout waits for another apt run instead of failing at once.
$SUDO apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
# fonts-dejavu-core: the report's fallback font, so text renders the same on a bare machine.
$SUDO apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2

if ! working_browser; then
  echo "chromium was installed but does not run ('chromium --version' failed)" >&2
  exit 1
fi
