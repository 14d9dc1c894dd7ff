"""The TensorFlow op, compiled on first use for the TensorFlow of the process that trains.

The op's sources (``tf_op.cpp`` and ``tnt/c_api.h``) ship with the package. At the first ``fit``
or ``evaluate`` of a process, the library for that process's TensorFlow is looked up in a cache
under a key of everything that makes two builds incompatible (TensorFlow's version, git version
and C++ ABI flag, the Python tag, the machine, the sources' hash) and, where missing, compiled
with one compiler command from ``tf.sysconfig``'s flags, as ``torch.utils.cpp_extension`` and
DeepSpeed's op builder do. So ``pip install`` needs no TensorFlow at build time, and upgrading
TensorFlow later gets a library of its own.

Ranks of a node, or of nodes sharing the cache's filesystem, build once: the builder holds an
``flock`` (which the kernel releases if it dies, so a killed builder never blocks the next),
compiles into a temporary file of its own and renames it into place; the others wait, bounded,
and load the result. Where the filesystem has no locks, each process builds into its own
temporary file and the renames replace one good library by another. A failed build is recorded
with its log, so that no other process retries it with the same compiler.

From a shell (``mpiexec -ppn 1`` to build once per node ahead of time)::

    python -m tnt_notebook.keras.op_cache          # TensorFlow, compiler, cache entry, status
    python -m tnt_notebook.keras.op_cache build    # build now (retries a failed build)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tnt_notebook import settings
from tnt_notebook.rank import tf_logs

LIBRARY = "libtnt_tf_op.so"
SOURCE = "tf_op.cpp"
WAIT_S = 300.0  # the longest wait for another process's build
BUILD_TIMEOUT_S = 300.0  # a compile taking longer is killed and counts as failed (it takes ~6 s)
LONGEST_S = 2 * (WAIT_S + BUILD_TIMEOUT_S)  # a lookup at worst: wait, build, twice if corrupt
COMPILERS = ("c++", "g++", "clang++")
# flock's answers on filesystems without locks (NFS without lockd, some FUSE filesystems)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OpUnavailable(RuntimeError):
    """The op cannot be used in this process; the message names the cause and the remedy."""


def sources_dir() -> Path:
    """The op's sources as installed with the package, beside the compiled ``_native`` module."""
    spec = importlib.util.find_spec("tnt_notebook._native")
    if spec is None or spec.origin is None:
        raise OpUnavailable("tnt_notebook's compiled module is missing: reinstall tnt_notebook")
    return Path(spec.origin).parent / "tf_op"


def source_hash(sources: Path) -> str:
    """sha256 over the names and contents of the op's sources."""
    files = sorted(p for p in sources.rglob("*") if p.is_file() and p.suffix in (".cpp", ".h"))
    if not (sources / SOURCE).is_file():
        raise OpUnavailable(f"the op's sources are missing from {sources}: reinstall tnt_notebook")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(sources).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


@dataclass(frozen=True)
class BuildKey:
    """Everything a library built for one process must share with another that loads it."""

    tensorflow: str
    git_version: str
    cxx11_abi: int
    python: str
    machine: str
    sources: str

    @classmethod
    def of_this_process(cls, sources: Path) -> BuildKey:
        import tensorflow as tf

        return cls(
            tensorflow=tf.__version__,
            git_version=tf.version.GIT_VERSION,
            cxx11_abi=int(tf.sysconfig.CXX11_ABI_FLAG),
            python=sys.implementation.cache_tag,
            machine=platform.machine(),
            sources=source_hash(sources),
        )

    @property
    def name(self) -> str:
        """The cache entry's directory name: readable prefix, hash of the whole key."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"tf{self.tensorflow}-{self.python}-{digest[:16]}"


def _usable_directory(path: Path, private: bool = False) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
    except OSError:
        return False
    if private and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return False  # in a shared temporary directory, only our own, unwritable by others
    return os.access(path, os.W_OK | os.X_OK)


def cache_root() -> Path:
    """``$TNT_NOTEBOOK_CACHE``, else ``$XDG_CACHE_HOME/tnt_notebook`` (``~/.cache/tnt_notebook``);
    a directory of this user's in the temporary directory where that one is not writable."""
    chosen = settings.NOTEBOOK_CACHE.read()
    if chosen:
        preferred = Path(chosen).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
        base = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
        preferred = base / "tnt_notebook"
    if _usable_directory(preferred):
        return preferred
    fallback = Path(tempfile.gettempdir()) / f"tnt_notebook-cache-{os.getuid()}"
    if _usable_directory(fallback, private=True):
        return fallback
    raise OpUnavailable(
        f"no writable cache directory ({preferred}, {fallback}): set TNT_NOTEBOOK_CACHE to one"
    )


@dataclass(frozen=True)
class Entry:
    """One cache entry: the library for one build key, its build log and its state."""

    key: BuildKey
    sources: Path
    directory: Path

    @classmethod
    def for_this_process(cls, sources: Path | str | None = None) -> Entry:
        sources = Path(sources) if sources else sources_dir()
        key = BuildKey.of_this_process(sources)
        return cls(key, sources, cache_root() / "tf_op" / key.name)

    @property
    def library(self) -> Path:
        return self.directory / LIBRARY

    @property
    def log(self) -> Path:
        return self.directory / "build.log"

    @property
    def failure_record(self) -> Path:
        return self.directory / "failed.json"

    def recorded_failure(self, cxx: list[str]) -> str | None:
        """Why the last build with this compiler failed; None if none did."""
        try:
            record = json.loads(self.failure_record.read_text())
        except (OSError, ValueError):
            return None
        return record.get("reason") if record.get("compiler") == cxx else None

    def failure_message(self, reason: str) -> str:
        return (
            f"building the TensorFlow op failed ({reason}; the compiler's output is in "
            f"{self.log}). Fix the cause, then run `{sys.executable} -m tnt_notebook.keras.op_cache"
            " build` (or set CXX to another compiler)"
        )


def compiler() -> list[str]:
    """The compiler command: ``$CXX`` (may carry arguments), else c++, g++ or clang++."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        command = shlex.split(cxx)
        if shutil.which(command[0]) is None:
            raise OpUnavailable(f"CXX={cxx!r} is not an executable: set CXX to a C++17 compiler")
        return command
    for name in COMPILERS:
        path = shutil.which(name)
        if path is not None:
            return [path]
    names = ", ".join(COMPILERS)
    raise OpUnavailable(
        f"no C++ compiler to build the TensorFlow op (CXX is unset and none of {names} is on "
        "PATH): install one (Debian, Ubuntu: apt-get install g++) or set CXX; the next fit "
        "builds the op"
    )


def compile_command(entry: Entry, output: Path, cxx: list[str]) -> list[str]:
    """The one command that builds the library (TensorFlow's flags come last and win)."""
    import tensorflow as tf

    return [
        *cxx,
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-O2",
        "-w",  # TensorFlow's headers warn by the hundred; errors still show in the log
        f"-I{entry.sources}",
        *tf.sysconfig.get_compile_flags(),
        str(entry.sources / SOURCE),
        "-o",
        str(output),
        *tf.sysconfig.get_link_flags(),
    ]


@contextlib.contextmanager
def _exclusive(path: Path, wait: float) -> Iterator[bool]:
    """Holds an flock on ``path`` (True), or yields False where the filesystem has no locks."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise OpUnavailable(
                        f"another process has been building the TensorFlow op in {path.parent} "
                        f"for over {wait:g} s; `{sys.executable} -m tnt_notebook.keras.op_cache` "
                        "shows its state"
                    ) from None
                time.sleep(0.1)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                locked = False
                break
        yield locked
    finally:
        os.close(fd)


def _temporary(entry: Entry, name: str) -> Path:
    """A file of this process only (host and pid in its name, for shared filesystems)."""
    return entry.directory / f".{name}.{socket.gethostname()}.{os.getpid()}.tmp"


def _remove_stale_temporaries(entry: Entry) -> None:
    """Temporary files of builders on this host that died (killed mid-compile)."""
    host = socket.gethostname()
    for path in entry.directory.glob(f".*.{host}.*.tmp"):
        try:
            pid = int(path.name.rsplit(".", 2)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            continue


def _write_atomically(path: Path, text: str, entry: Entry) -> None:
    temporary = _temporary(entry, path.name)
    temporary.write_text(text)
    os.replace(temporary, path)


def _compile(entry: Entry, cxx: list[str]) -> None:
    """Compile into a temporary file, then rename it into place (or record the failure)."""
    output = _temporary(entry, LIBRARY)
    log_path = _temporary(entry, entry.log.name)
    command = compile_command(entry, output, cxx)
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=entry.directory,
                start_new_session=True,  # so that a timeout ends the compiler's children too
            )
        except OSError as exc:
            log.write(f"{exc}\n")
            code: int | None = -1
        else:
            try:
                code = proc.wait(timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                if proc.returncode is None:  # timed out or interrupted: end it, then reap it
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    os.replace(log_path, entry.log)
    if code != 0 or not output.is_file():
        output.unlink(missing_ok=True)
        reason = (
            f"the compile took longer than {BUILD_TIMEOUT_S:g} s"
            if code is None
            else f"{shlex.join(cxx)} exited with code {code}"
        )
        _write_atomically(
            entry.failure_record,
            json.dumps({"compiler": cxx, "reason": reason, "log": str(entry.log)}),
            entry,
        )
        raise OpUnavailable(entry.failure_message(reason))
    os.replace(output, entry.library)
    entry.failure_record.unlink(missing_ok=True)
    _write_atomically(entry.directory / "key.json", json.dumps(asdict(entry.key), indent=1), entry)


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def ensure(
    entry: Entry,
    wait: float = WAIT_S,
    *,
    replace: tuple[int, int, int] | None = None,
    retry_failed: bool = False,
    rebuild: bool = False,
) -> None:
    """Make ``entry.library`` exist: present already, built by another process meanwhile, or
    built here. ``replace``: the identity of a library that did not load, rebuilt unless another
    process replaced it already; ``rebuild``: build even where one exists. A build that failed
    with this compiler is not retried unless ``retry_failed``. Raises OpUnavailable."""
    if replace is None and not rebuild and entry.library.is_file():
        return  # the common case: no lock, no compiler needed
    cxx = compiler()
    if not retry_failed and (reason := entry.recorded_failure(cxx)):
        raise OpUnavailable(entry.failure_message(reason))
    entry.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _exclusive(entry.directory / "lock", wait):
        current = _identity(entry.library)
        if current is not None and current != replace and not rebuild:
            return
        if not retry_failed and (reason := entry.recorded_failure(cxx)):
            raise OpUnavailable(entry.failure_message(reason))
        _remove_stale_temporaries(entry)
        _compile(entry, cxx)


def load(sources: Path | str | None = None, wait: float = WAIT_S) -> tuple[Any, Path]:
    """TensorFlow's module of the op and the library's path, for the TensorFlow of this process;
    built where missing, rebuilt once where the cached file does not load. Raises OpUnavailable."""
    import tensorflow as tf

    entry = Entry.for_this_process(sources)
    try:
        ensure(entry, wait)
    except OSError as exc:  # another user's entry, a full disk, ...
        raise OpUnavailable(
            f"the op's cache entry {entry.directory} is not usable ({exc}): set "
            "TNT_NOTEBOOK_CACHE to a writable directory of your own"
        ) from None
    try:
        return tf.load_op_library(str(entry.library)), entry.library
    except Exception as exc:  # noqa: BLE001 - a corrupt or truncated file: rebuild it once
        try:
            ensure(entry, wait, replace=_identity(entry.library))
        except (OpUnavailable, OSError) as cause:
            raise OpUnavailable(
                f"the cached TensorFlow op {entry.library} does not load "
                f"({type(exc).__name__}: {exc}) and cannot be rebuilt: {cause}"
            ) from None
    try:
        return tf.load_op_library(str(entry.library)), entry.library
    except Exception as exc:  # noqa: BLE001
        reason = f"the library built does not load: {type(exc).__name__}: {exc}"
        _write_atomically(
            entry.failure_record,
            json.dumps({"compiler": compiler(), "reason": reason, "log": str(entry.log)}),
            entry,
        )
        raise OpUnavailable(entry.failure_message(reason)) from None


# -- the command line ---------------------------------------------------------------------------
def _compiler_version(cxx: list[str]) -> str:
    try:
        out = subprocess.run(
            [*cxx, "--version"], capture_output=True, text=True, timeout=30,
            stdin=subprocess.DEVNULL,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({exc})"
    return out.splitlines()[0] if out else "(no version)"


def report(entry: Entry, check_load: bool = True) -> dict[str, Any]:
    """What the op's lookup finds for this process, for people and for tests."""
    info: dict[str, Any] = {"key": asdict(entry.key), "sources": str(entry.sources)}
    info["cache"] = str(entry.directory.parent.parent)
    info["entry"] = str(entry.directory)
    try:
        cxx = compiler()
        info["compiler"] = f"{shlex.join(cxx)} ({_compiler_version(cxx)})"
    except OpUnavailable as exc:
        cxx = None
        info["compiler"] = f"none: {exc}"
    reason = entry.recorded_failure(cxx) if cxx is not None else None
    if entry.library.is_file():
        info["status"] = "built"
        if check_load:
            import tensorflow as tf

            try:
                tf.load_op_library(str(entry.library))
                info["status"] = "built, loads"
            except Exception as exc:  # noqa: BLE001
                info["status"] = f"does not load ({type(exc).__name__}: {exc}): run build"
    elif reason is not None:
        info["status"] = f"failed: {reason} (log: {entry.log}); run build to retry"
    else:
        info["status"] = "missing: built at the first fit or evaluate, or now by `build`"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tnt_notebook.keras.op_cache",
        description="The TensorFlow op of tnt_notebook, built for this Python's TensorFlow.",
    )
    parser.add_argument(
        "command", nargs="?", choices=["status", "build"], default="status",
        help="status (default): what is found; build: build now (a failed build is retried)",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="build: rebuild an existing library")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's errors only, and
    tf_logs.quiet_import()  # none of the lines it writes while it loads
    try:
        entry = Entry.for_this_process()
        if args.command == "build":
            ensure(entry, retry_failed=True, rebuild=args.force)
        info = report(entry)
    except OpUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        key = info["key"]
        print(
            f"TensorFlow: {key['tensorflow']} ({key['git_version']}, C++11 ABI "
            f"{key['cxx11_abi']}), Python {key['python']}, {key['machine']}\n"
            f"sources:    {info['sources']} (sha256 {key['sources'][:16]}...)\n"
            f"compiler:   {info['compiler']}\n"
            f"cache:      {info['cache']}\n"
            f"entry:      {info['entry']}\n"
            f"status:     {info['status']}"
        )
    return 0 if info["status"].startswith("built, loads") or args.command == "status" else 1


if __name__ == "__main__":
    sys.exit(main())
