#!/usr/bin/env bash
# Wheels for the packages the device image lacks (msgspec, pyzmq, llguidance;
# KINDS.md lists what it has), at the versions the project's venv pins, into
# .whl/ (ignored by git). Run here, with network; the device run installs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
ex="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx "/.whl/" "$ex" 2>/dev/null || echo "/.whl/" >> "$ex"
plats=""
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  plats="$plats --platform $p"
done
for pkg in msgspec==0.23.0 pyzmq==27.3.0 llguidance==1.9.1; do
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plats -d .whl "$pkg"
done
ls -la .whl
