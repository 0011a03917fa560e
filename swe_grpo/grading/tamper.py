"""Defences against a patch whose code, running inside the test runner's process, fakes a pass.

Witnesses the grader adds to a graded run (see `swe_grpo.grading` for how they combine), and the gate that
needs no run:

- The canaries (`swe_grpo.grading.canaries`): tests shaped like the project's own, in its test files,
  shuffled in among the task's ids, handed to the runner off its command line (`swe_grpo.grading.selection`):
  one must pass, one must fail, and copies of the FAIL_TO_PASS tests with an expected value changed must
  fail. pytest-style runners only (the probe checks that the task's
  runner reports them).
- The boot (`boot_source`): a `sitecustomize.py` in a grader-owned directory, put on the path of every
  `python`/`python3` the test command starts (a PATH shim appends the directory to PYTHONPATH, so a
  `PYTHONPATH=src` in `test_cmd` keeps it), runs before any repository code. It installs a PEP 578
  audit hook that records events a fix has no business raising (a trace or profile function, exec of
  the runner, a pytest run started from inside the run, a function's code object replaced, another
  audit hook, the interpreter's C API reached through ctypes), and at interpreter exit a scan for
  functions defined in the patch's files (or outside the interpreter's own directories) inside pytest,
  pluggy, unittest, doctest and the other runner modules, or registered as pytest hook implementations.
  Everything goes into an append-only report opened before repository code runs, each line carrying a
  per-grade nonce that only the hook holds (read from a file it deletes); a run whose report lacks the
  start or the exit record of its runner process was ended or replaced behind the grader's back.
- `gate_patch`: the capability gate (`swe_grpo.grading.capability`), the primary layer, on the files the
  filtered patch touches, read out of the grading sandbox before anything of the patch runs; a task may
  allow capabilities (`Task.tamper_allow`), for projects that are themselves test tools.

The boot is a tripwire: what it sees counts (`grading_tampered`), but no grade depends on it alone. It runs
inside the process the patch's code runs in, so a patch written against it can turn it off or hide from it;
each class of tampering it names is also refused by the gate, which needs no run.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from swe_grpo.grading.capability import BINARY_SUFFIXES, CAPABILITIES, FileChange, GateResult, gate
from swe_grpo.grading.steps import BrokenTask, failure, step
from swe_grpo.sandbox.base import Sandbox
from swe_grpo.sandbox.bounded import BoundExceeded, run_bounded

#: The capability gate's bounds on one patch (its files before and after: within `MAX_PATCH_BYTES` of change,
#: the gate's parse took seconds and hundreds of MiB at most; these leave a loaded host room).
GATE_TIMEOUT_S = 120.0
GATE_MEMORY_BYTES = 2 << 30

# --- the boot: an audit hook and an exit scan, before any repository code ------------------------------

BOOT_ENV = "SWE_GRPO_AUDIT"

# Runs in every Python process the test command starts. Only the first one (the runner, in practice:
# the probe checks it) finds the secret; the others chain to the next sitecustomize and do nothing else.
_BOOT = r'''
def _swe_grpo_boot():
    import os, sys

    secret_path = os.environ.pop("SWE_GRPO_AUDIT", "")
    try:
        with open(secret_path, encoding="utf-8") as f:
            nonce, report, workdir, allow, *patch_files = f.read().split("\n")
        os.unlink(secret_path)
        fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except (OSError, ValueError):
        return
    write, getpid, allowed = os.write, os.getpid, frozenset(allow.split(","))
    getframe_now = sys._getframe
    patch_files = frozenset(os.path.join(workdir, p) for p in patch_files if p)

    def note(kind, detail=""):
        text = f"{nonce} {getpid()} {kind} {detail}".replace("\n", " ")[:2000]
        write(fd, (text + "\n").encode("utf-8", "replace"))

    note("start")
    own = getframe_now().f_code.co_filename  # the grader's sitecustomize.py (its selection plugin's hooks)
    roots = [p for p in sys.path if p and not p.startswith((workdir, "/tmp"))]
    FunctionType, MethodType, getframe = type(note), type(note.__get__(0)), sys._getframe

    def untrusted(name, pseudo_ok):
        """`name` (a code object's file) when it is one of the patch's files, a pseudo-file (unless
        pseudo_ok: dataclasses make those) or a file outside the interpreter's directories and the
        repository; else None."""
        if name in patch_files:
            return name
        if name == own:
            return None
        if not name.startswith("/"):
            return None if pseudo_ok else name
        if name.startswith(workdir + "/") or any(name.startswith(root) for root in roots):
            return None
        return name

    def foreign(value, pseudo_ok):
        """Where a function comes from, when `untrusted` says so."""
        if type(value) in (staticmethod, classmethod):
            value = value.__func__
        if type(value) is MethodType:
            value = value.__func__
        if type(value) is not FunctionType:
            return None
        return untrusted(value.__code__.co_filename, pseudo_ok)

    # The standard library and installed tools raise some of these for good reasons (types.coroutine
    # replaces a code object, doctest restores the trace function): they count only when raised by
    # code that `untrusted` names.
    by_caller = {"sys.settrace", "sys.setprofile", "code.__new__", "sys._current_frames", "ctypes.dlsym"}
    by_caller |= {"sys.monitoring.register_callback", "sys.monitoring.use_tool_id"}
    spawns = {"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.system"}

    def text_of(value):  # never calls code the patch defined: only str, bytes, and lists/tuples of them
        if type(value) is str:
            return value
        if type(value) is bytes:
            return value.decode("utf-8", "replace")
        if type(value) in (list, tuple):
            return " ".join(text_of(item) for item in value)
        return ""

    def hook(event, args):
        if event in allowed:
            return
        if event == "object.__setattr__" and len(args) > 1 and args[1] == "__code__":
            event = "object.__setattr__ __code__"
        elif event == "ctypes.dlsym" and not (len(args) > 1 and text_of(args[1]).startswith(("Py", "_Py"))):
            return
        elif event not in by_caller:
            if event == "sys.addaudithook":
                note("event", event)
                raise RuntimeError("the grader's audit hook is the only one")
            if event == "os.exec":
                note("event", "os.exec " + text_of(args[1] if len(args) > 1 else "")[:300])
            elif event in spawns and "pytest" in text_of(args[:2]):
                note("event", event + " " + text_of(args[:2])[:300])
            return
        # A pseudo-file frame (a doctest example, code made by exec) is judged by the first real file
        # that called it.
        frame = getframe(1)
        while frame.f_back is not None and not frame.f_code.co_filename.startswith("/"):
            frame = frame.f_back
        caller = untrusted(frame.f_code.co_filename, False)
        if caller:
            note("event", f"{event} from {caller}")

    sys.addaudithook(hook)
    modules = ("_pytest", "pytest", "pluggy", "unittest", "doctest", "xml", "builtins", "atexit", "os", "sys")
    modules += ("threading", "io", "subprocess")

    ModuleType, class_dict, class_module = type(sys), type.__dict__["__dict__"], type.__dict__["__module__"]

    def scan():
        # Only exact types are looked into (type(), issubclass on types, the type slots' own descriptors):
        # an isinstance() or an attribute read on an object of the patch's could run its code here.
        found = []
        for mod_name, module in list(sys.modules.items()):
            if type(module) is not ModuleType or mod_name.split(".")[0] not in modules:
                continue
            for attr, value in list(module.__dict__.items()):
                where = foreign_value(value)
                if where:
                    found.append(f"{mod_name}.{attr} from {where}")
                elif issubclass(type(value), type) and class_module.__get__(value) == mod_name:
                    for name, member in list(class_dict.__get__(value).items()):
                        where = foreign(member, True)
                        if where:
                            found.append(f"{mod_name}.{attr}.{name} from {where}")
        pluggy = sys.modules.get("pluggy")
        if type(pluggy) is ModuleType and issubclass(type(pluggy.__dict__.get("PluginManager")), type):
            import gc

            manager_type = pluggy.__dict__["PluginManager"]
            for manager in [o for o in gc.get_objects() if issubclass(type(o), manager_type)]:
                for hook_name in list(vars(manager.hook)):
                    caller = getattr(manager.hook, hook_name)
                    for impl in getattr(caller, "get_hookimpls", lambda: [])():
                        where = foreign(impl.function, False)
                        if where:
                            found.append(f"hook {hook_name} from {where}")
                # What the plugin objects hold, two levels down (the terminal reporter's writer's file).
                for plugin in list(manager.get_plugins()):
                    if type(plugin) is ModuleType:
                        continue  # a conftest module imports the code under test: that is no tampering
                    for name, value in attributes(plugin):
                        held = [(name, foreign_value(value))]
                        held += [(f"{name}.{inner}", foreign_value(v)) for inner, v in attributes(value)]
                        found += [f"{type(plugin).__name__}.{path} from {where}" for path, where in held if where]
        return found

    # id(type) -> (foreign of its methods, the type: held so that its id is not reused). Ids, because
    # hashing a type of the patch's could run its code.
    by_type = {}

    def foreign_value(value):
        """`foreign` for a function, or for the methods of the type of any other object."""
        where = foreign(value, True)
        kind = type(value)
        if where or issubclass(kind, type):
            return where
        if id(kind) not in by_type:
            members = list(class_dict.__get__(kind).values())
            by_type[id(kind)] = next((w for w in (foreign(m, True) for m in members) if w), None), kind
        return by_type[id(kind)][0]

    def attributes(obj):
        """An object's instance attributes, when its type is not the patch's (reading them then runs
        only the interpreter's code)."""
        if type(obj) is ModuleType or issubclass(type(obj), type) or foreign_value(obj):
            return []
        try:
            held = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return []
        return list(held.items()) if type(held) is dict else []

    def at_exit():
        started = perf_counter()
        found = scan() if "foreign" not in allowed else []
        for item in found[:20]:
            note("event", "foreign " + item)
        note("end", f"{'pytest' if '_pytest' in sys.modules else 'other'} {perf_counter() - started:.4f}")

    import atexit
    from time import perf_counter

    atexit.register(at_exit)  # the first registered runs last, after every handler the run registers


_swe_grpo_boot()
del _swe_grpo_boot


def _swe_grpo_chain():
    # The sitecustomize this one shadows (a distribution's own), if any, runs as it would have.
    import importlib.machinery, importlib.util, os, sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_swe_grpo_chain()
del _swe_grpo_chain
'''


def boot_source() -> str:
    """The `sitecustomize.py` of the boot directory."""
    return _BOOT


def boot_secret(nonce: str, report: str, workdir: str, allow: Iterable[str], patch_files: Iterable[str]) -> str:
    """The secret file's text: what the boot reads once and deletes."""
    return "\n".join([nonce, report, workdir, ",".join(allow), *patch_files])


def shim_script(boot_dir: str, bin_dir: str) -> str:
    """Shell that writes, for each of python3 and python found on PATH, a shim into `bin_dir` that runs it
    with `boot_dir` appended to PYTHONPATH."""
    return (
        f"mkdir -p {bin_dir} && for name in python3 python; do"
        f' real=$(command -v "$name") || continue;'
        f' printf \'#!/bin/sh\\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}%s" exec %s "$@"\\n\' {boot_dir} "$real"'
        f' > {bin_dir}/"$name" && chmod 755 {bin_dir}/"$name"; done'
    )


@dataclass(frozen=True)
class AuditReport:
    """What the boot recorded: `started` / `ended` whether the first process that read the secret wrote
    its start and its exit record, `pytest` whether that process ran pytest, `events` what it flagged,
    `forged` lines without the nonce, `exit_scan_s` how long its exit scan took."""

    started: bool = False
    ended: bool = False
    pytest: bool = False
    events: tuple[str, ...] = ()
    forged: int = 0
    exit_scan_s: float = 0.0

    @classmethod
    def parse(cls, text: str, nonce: str) -> AuditReport:
        runner: str | None = None
        ended = pytest = False
        exit_scan_s = 0.0
        events: list[str] = []
        forged = 0
        for line in text.splitlines():
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[0] != nonce:
                forged += bool(line.strip())
                continue
            _, pid, kind, *rest = parts
            if kind == "start" and runner is None:
                runner = pid
            elif kind == "end" and pid == runner:
                what, _, took = (rest[0] if rest else "").partition(" ")
                ended, pytest, exit_scan_s = True, what == "pytest", float(took) if _is_number(took) else 0.0
            elif kind == "event":
                events.append(rest[0] if rest else "")
        return cls(runner is not None, ended, pytest, tuple(dict.fromkeys(events)), forged, exit_scan_s)

    def tampering(self) -> str | None:
        """Why this report shows tampering, when it does (for a run whose boot worked without the patch)."""
        if self.forged:
            return f"{self.forged} line(s) of the audit report were written by someone else"
        if not self.started:
            return "the audit hook never started (the runner was not the one the grader started)"
        if self.events:
            return "the audit hook saw " + "; ".join(self.events[:5])
        if not self.ended:
            return "the runner never reached its interpreter's exit (os._exit, a signal, or an exec)"
        return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# --- the capability gate, on the files read out of the grading sandbox -----------------------------------

#: Every name that, in `Task.tamper_allow`, switches the static layer off: all of the gate's capabilities.
SCAN_RULES: tuple[str, ...] = tuple(CAPABILITIES)


def _may_be_code(path: str) -> bool:
    """Whether the gate needs to see a path: Python by suffix, binary code, or a name without a suffix (a
    script, which `is_python` judges by its first line)."""
    name = path.rpartition("/")[2]
    return path.endswith((".py", ".pyw", *BINARY_SUFFIXES)) or "." not in name


def _batch_blobs(data: bytes, count: int) -> list[bytes | None]:
    """The objects `git cat-file --batch` wrote for `count` requests, in order (None: missing)."""
    blobs: list[bytes | None] = []
    pos = 0
    for _ in range(count):
        end = data.index(b"\n", pos)
        header = data[pos:end].split(b" ")
        if header[-1] == b"missing" or len(header) != 3:
            blobs.append(None)
            pos = end + 1
            continue
        size = int(header[2])
        blobs.append(data[end + 1 : end + 1 + size] if header[1] == b"blob" else None)
        pos = end + 1 + size + 1
    return blobs


def _links(raw: str) -> set[str]:
    """The paths `git diff --raw -z` shows as symbolic links (mode 120000) after the change."""
    items = raw.split("\0")
    return {path for meta, path in zip(items[::2], items[1::2], strict=False) if meta.split(" ")[1:2] == ["120000"]}


async def gate_patch(
    sandbox: Sandbox, scratch: str, base: str, index: str, paths: Iterable[str], allow: Collection[str]
) -> GateResult:
    """The capability gate (`swe_grpo.grading.capability`) on the files of `paths`: each as `base` has it and
    as the git index `index` (the filtered patch staged over `base`) has it, read with git before anything
    of the patch has run. The parse runs in a process of its own (`run_bounded`: it holds the GIL, and the
    files are the agent's), within `GATE_TIMEOUT_S` and `GATE_MEMORY_BYTES`: files too large to check in them
    are a finding (the policy's: reward 0), the gate's own failure `BrokenTask`."""
    wanted = [path for path in paths if _may_be_code(path)]
    odd = [path for path in wanted if not path.isprintable()]  # cat-file --batch reads names by line
    named = [path for path in wanted if path not in odd]
    changes = [FileChange(path, None, b"") for path in odd]
    if named:
        requests = "".join(f"{base}:{path}\n:{path}\n" for path in named)
        await sandbox.put_file(f"{scratch}/gate.in", requests.encode())
        q = shlex.quote
        read = await step(
            sandbox,
            f"export GIT_INDEX_FILE={q(index)} && git cat-file --batch < {q(scratch)}/gate.in > {q(scratch)}/gate.out"
            f" && git diff --cached --raw -z --no-renames {q(base)}",
            "reading the patched files",
        )
        if read.exit_code != 0:
            raise BrokenTask(failure("reading the patched files", read))
        blobs = _batch_blobs(await sandbox.get_file(f"{scratch}/gate.out"), 2 * len(named))
        links = _links(read.stdout)
        changes += [
            FileChange(path, blobs[2 * i], blobs[2 * i + 1], link=path in links) for i, path in enumerate(named)
        ]
    try:
        return await run_bounded(gate, changes, allow, timeout_s=GATE_TIMEOUT_S, memory_bytes=GATE_MEMORY_BYTES)
    except BoundExceeded as e:
        if e.bound == "error":  # the gate's own failure, not the patch's
            raise BrokenTask(f"the capability gate failed: {e}") from e
        return GateResult(findings=[f"the patch's files are too large to check ({e})"])
