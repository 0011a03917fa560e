"""Where swe_grpo keeps things on the host: built artefacts (cache) and the Pi bundle."""

from __future__ import annotations

import os
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def cache_root() -> Path:
    """Built artefacts (tiny models, vLLM compile cache): `$SWE_GRPO_CACHE`, else `~/.cache/swe_grpo`."""
    return Path(os.environ.get("SWE_GRPO_CACHE", Path.home() / ".cache" / "swe_grpo"))


def pi_bundle_dir() -> Path:
    """The portable Node + Pi install made by `scripts/setup.sh`: `$SWE_GRPO_PI_DIR`, else `.deps/pi`
    in this checkout."""
    return Path(os.environ.get("SWE_GRPO_PI_DIR", _CHECKOUT / ".deps" / "pi"))
