#!/usr/bin/env bash
# Runs a command as a fresh box's CI runs it, whatever terminal it is typed in: no terminal width
# (COLUMNS, LINES), a dumb terminal, LANG=C.UTF-8 (no LC_ALL/LC_CTYPE overriding it), nothing on stdin.
# `make test` runs the suite through it and `.ci/run` runs `make test` through it, so a test that passes
# only at a developer's terminal width or with a terminal on stdin fails where it is written.
set -euo pipefail
exec env -u COLUMNS -u LINES -u LC_ALL -u LC_CTYPE TERM=dumb LANG=C.UTF-8 "$@" </dev/null
