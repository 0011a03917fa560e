#!/usr/bin/env bash
# Deploys the GRPO trainer as a Hugging Face Docker Space; see space_app/README.md.
#   space_app/deploy_hf_space.sh --space USER/NAME --hardware a100x4 [--config FILE] [--dry-run]
# Every argument goes to space_app/deploy.py (`--help` lists them). Secrets are read from the environment or
# --secrets-file, never from arguments. Runs with the checkout's .venv, else $PYTHON, else python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
[[ -x $python ]] || python=python3
exec "$python" "$root/space_app/deploy.py" "$@"
