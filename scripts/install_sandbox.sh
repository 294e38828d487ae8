#!/usr/bin/env bash
# Installs what the code-reward sandbox needs (bubblewrap, libseccomp) when it can: as root with apt.
# Elsewhere it only warns; it never fails the install (code rewards then refuse to run, saying why).
set -uo pipefail
if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2) >/dev/null 2>&1 \
      && command -v bwrap >/dev/null 2>&1; then
    echo "installed bubblewrap for the code-reward sandbox"
    exit 0
  fi
  echo "warning: apt-get could not install bubblewrap; code rewards will refuse to run (see docs/rewards.md)" >&2
else
  echo "warning: bubblewrap (bwrap) is not installed; code rewards will refuse to run until it is" \
       "(Debian/Ubuntu: sudo apt-get install bubblewrap; see docs/rewards.md)" >&2
fi
exit 0
