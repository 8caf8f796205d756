#!/usr/bin/env bash
# Quick start, part 1: build everything and run the end-to-end demo on the host backend.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cmake -S . -B build
cmake --build build -j2 --target demo
