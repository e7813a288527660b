#!/usr/bin/env bash
# System packages ckptfs needs on Debian: FUSE 3 (mount + headers for pyfuse3),
# PostgreSQL (the scale-out metadata engine and its tests), rclone (a peer the
# FUSE benchmark compares against), openssl (test certificates for the service's
# TLS), iproute2 (`ip netns`, `tc`: the `ckptfs bench --topology netns` fleet), and what
# building the project's virtual environment needs (python3-venv; gcc, libc6-dev and the
# Python headers: pyfuse3 compiles). Idempotent; skips apt when all are present.
set -euo pipefail
pkgs=(fuse3 libfuse3-dev pkg-config postgresql rclone rsync openssl iproute2
      python3-venv python3-dev gcc libc6-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
