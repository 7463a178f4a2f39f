#!/usr/bin/env bash
# The test command: set up (scripts/setup.sh), then the whole suite. Without a GPU
# the GPU tests are skipped (each skip is listed); pytest's "no tests" exit (5) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The sources live in python/, so `import primemoe` here is the installed package.
python -m pytest tests -q -rs "$@"
