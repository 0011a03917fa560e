"""How a `local` sandbox gets its private, writable view of the cached checkout (`CowMethod`): kernel
overlayfs, else `fuse-overlayfs`, else a plain `cp -a`. `detect_cow_method` finds the first that works here
(once per backend); `mount_cow` makes one sandbox's `testbed/`, whose writes never reach the checkout."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal

from swe_grpo.sandbox.base import SandboxError
from swe_grpo.sandbox.local.host import PREFIX, mount, mounts_under, run_host, umount, wait_or_kill

log = logging.getLogger(__name__)

#: How a sandbox gets its private, writable view of the cached checkout.
CowMethod = Literal["overlay", "fuse-overlayfs", "copy"]


async def mount_cow(method: CowMethod, lower: Path, host_dir: Path) -> asyncio.subprocess.Process | None:
    """Make `host_dir/testbed` a private, writable view of `lower` (upper/work dirs in `host_dir`);
    returns the fuse-overlayfs daemon, which runs until the mount is gone."""
    testbed = host_dir / "testbed"
    if method == "copy":
        await run_host("cp", "-a", "--reflink=auto", f"{lower}/.", str(testbed))
        return None
    upper, work = host_dir / "upper", host_dir / "work"
    upper.mkdir()
    work.mkdir()
    # The overlay's root directory takes its owner and mode from the upper dir.
    st = lower.stat()
    os.chown(upper, st.st_uid, st.st_gid)
    upper.chmod(st.st_mode & 0o7777)
    if any(c in str(p) for p in (lower, upper, work) for c in ",:\\"):
        raise SandboxError(f"overlay paths must not contain ',', ':' or '\\': {lower}, {upper}")
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if method == "overlay":
        mount("overlay", "overlay", testbed, opts)
        return None
    # In the foreground, so the daemon is our child and teardown can wait for it. allow_other: the
    # sandbox user must see a mount made by root.
    fuse = await asyncio.create_subprocess_exec(
        "fuse-overlayfs", "-f", "-o", f"{opts},allow_other", str(testbed),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not mounts_under(testbed):
        if fuse.returncode is not None or time.monotonic() > deadline:
            await wait_or_kill(fuse, timeout_s=0)
            assert fuse.stderr is not None
            err = (await fuse.stderr.read()).decode(errors="replace").strip()
            raise SandboxError(f"fuse-overlayfs did not mount {testbed}: {err}")
        await asyncio.sleep(0.002)
    return fuse


async def detect_cow_method(run_dir: Path) -> CowMethod:
    """The first method that mounts a tiny overlay here: kernel overlayfs, then fuse-overlayfs, else copy."""
    probe = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-probe-", dir=run_dir))
    try:
        (probe / "lower").mkdir()
        (probe / "testbed").mkdir()
        methods: tuple[CowMethod, ...] = ("overlay", "fuse-overlayfs")
        for method in methods:
            try:
                fuse = await mount_cow(method, probe / "lower", probe)
                await umount(probe / "testbed")
                if fuse is not None:
                    await wait_or_kill(fuse)
                return method
            except (SandboxError, OSError) as e:
                log.info("copy-on-write by %s is not available: %s", method, e)
            shutil.rmtree(probe / "upper", ignore_errors=True)
            shutil.rmtree(probe / "work", ignore_errors=True)
        return "copy"
    finally:
        if not mounts_under(probe):
            shutil.rmtree(probe, ignore_errors=True)
