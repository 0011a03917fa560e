# The two commands in the README. Both run setup first (idempotent; ~1 s when nothing changed); the demo's
# setup skips what only the tests need (docker, Pi 0.73.1, mini-swe-agent).
.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

# `SEED=1 make demo`: another seed; each seed's curve, result.json and adapter go to runs/demo/seedN/.
SEED ?= 0
demo:
	bash scripts/setup.sh --demo
	.venv/bin/swe-grpo demo --seed $(SEED)

# The suite sees what a fresh box's CI gives it, whatever terminal this is typed in (scripts/as_ci.sh); every log
# ends with its 30 slowest tests and fixtures (--durations), so a run that grows shows where.
test: setup
	.venv/bin/ruff check swe_grpo tests benchmarks examples space_app
	bash scripts/as_ci.sh .venv/bin/python -m pytest -v -rs --durations=30 -n 2

lint: setup
	.venv/bin/ruff check swe_grpo tests benchmarks examples space_app
	.venv/bin/ruff format --check swe_grpo tests benchmarks examples space_app

bench: setup
	.venv/bin/python benchmarks/p1_host_overhead.py
	.venv/bin/python benchmarks/p2_concurrency.py
