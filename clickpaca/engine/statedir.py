"""Where `save` and `load` may touch the file system: names inside one state directory.

A client names a state file; it never gives a path. A name is one path component (letters,
digits, '.', '_', '-', not starting with '.') resolved relative to a namespace directory's
descriptor opened with O_NOFOLLOW, so no name reaches outside it; only regular files are
read or replaced (lstat, then open with O_NOFOLLOW | O_NONBLOCK and fstat again: a FIFO
never blocks the engine), and an existing file only if it is a clickpaca state file.
Namespaces: stdio's names live in the directory itself; a socket client's in
`clients/<id>/`, removed when it disconnects; `shared: true` in `shared/`, replaced only
with `replace: true`. Server-picked names (captures) hold the run id and use O_EXCL.
Writes go to `.clickpaca-tmp-<pid>-<random>` renamed into place; `sweep()` at start removes
dead processes' leftovers. Absolute paths only with `--allow-any-path` (stdio), same checks.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterable

TEMP_PREFIX = ".clickpaca-tmp-"
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_TEMP_RE = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-[0-9a-f]+")
_CLIENT_RE = re.compile(r"(\d+)-\d+-[0-9a-f]+")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StatePathError(ValueError):
    """A name or path that cannot be used; the message is safe to show the client."""


def default_root() -> Path:
    """$CLICKPACA_STATE_DIR, else <XDG cache>/clickpaca/state."""
    env = os.environ.get("CLICKPACA_STATE_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "clickpaca" / "state"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------ file primitives


def open_dir(path: Path, create: bool = False) -> int:
    """A descriptor of the directory; refuses a symlink in its last component."""
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    return os.open(path, _DIR_FLAGS)


def _regular_or_none(dir_fd: int, name: str, label: str) -> os.stat_result | None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise StatePathError(f"{label} is not a regular file (a directory, symlink, FIFO or "
                             "device is never opened)")
    return st


def read_file(dir_fd: int, name: str, label: str) -> bytes:
    """The bytes of a regular file in the directory (never opens anything else)."""
    if _regular_or_none(dir_fd, name, label) is None:
        raise StatePathError(f"no state file named {label}")
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise StatePathError(f"{label} cannot be opened ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the lstat and the open
            raise StatePathError(f"{label} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def starts_with(dir_fd: int, name: str, magic: bytes) -> bool:
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        return os.read(fd, len(magic)) == magic
    finally:
        os.close(fd)


def write_file(dir_fd: int, name: str, chunks: Iterable[bytes], label: str,
               may_replace: Callable[[int, str], None]) -> int:
    """Write atomically (temp file + rename); `may_replace(dir_fd, name)` raises to refuse
    an existing file. Returns the new file's size."""
    if _regular_or_none(dir_fd, name, label) is not None:
        may_replace(dir_fd, name)
    tmp = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    create_file(dir_fd, tmp, chunks)  # removed again if writing fails
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size


def create_file(dir_fd: int, name: str, chunks: Iterable[bytes]) -> int:
    """Create a new file (O_EXCL: FileExistsError when the name exists; never replaces
    anything, never follows a link) and write it; removed again if writing fails.
    Returns its size. For names the server picks itself (capture files)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            return f.tell()
    except BaseException:
        os.unlink(name, dir_fd=dir_fd)
        raise


def sweep(root: Path) -> list[str]:
    """Remove temp files of dead processes and private namespaces of dead servers."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinks
        for fn in filenames:
            m = _TEMP_RE.fullmatch(fn)
            if m and not _pid_alive(int(m.group(1))):
                Path(dirpath, fn).unlink(missing_ok=True)
                removed.append(os.path.join(dirpath, fn))
    clients = root / "clients"
    if clients.is_dir() and not clients.is_symlink():
        for d in clients.iterdir():
            m = _CLIENT_RE.fullmatch(d.name)
            if m and d.is_dir() and not d.is_symlink() and not _pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
    return removed


# ------------------------------------------------------------------ the directory


class StateDir:
    """One server's state directory and its namespaces."""

    def __init__(self, root: str | os.PathLike, allow_any_path: bool = False) -> None:
        self.root = Path(root).expanduser().absolute()
        self.allow_any_path = allow_any_path
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        if self.root.is_symlink() or not self.root.is_dir():
            raise StatePathError(f"stateDir: {self.root} is not a directory")
        self.swept = sweep(self.root)
        # in the names this server picks itself (capture files): unique among the servers
        # and runs that share the directory (a counter alone restarts at 0 in each)
        self.run_id = f"{os.getpid()}-{secrets.token_hex(4)}"

    def new_client_namespace(self, n: int) -> str:
        """A private namespace for one socket connection (unguessable, pid-tagged)."""
        return f"clients/{os.getpid()}-{n}-{secrets.token_hex(6)}"

    def drop_namespace(self, namespace: str | None) -> None:
        if namespace and namespace.startswith("clients/"):
            shutil.rmtree(self.root / namespace, ignore_errors=True)

    def locate(self, name: str, namespace: str | None, shared: bool) -> tuple[int, str, str]:
        """(directory descriptor, file name, label for messages); the caller closes the fd."""
        if "\x00" in name:
            raise StatePathError("path: must not contain a NUL character")
        if name.startswith("/") and self.allow_any_path and not shared:
            p = Path(name)
            if ".." in p.parts or p.name in ("", ".", ".."):
                raise StatePathError("path: '..' components are not allowed")
            try:
                return open_dir(p.parent), p.name, repr(name)
            except OSError as e:
                raise StatePathError(f"path: directory of {name!r} cannot be used ({e.strerror})") from None
        if not NAME_RE.fullmatch(name) or name.startswith(TEMP_PREFIX):
            why = "absolute paths need --allow-any-path (stdio only); " if name.startswith("/") else ""
            raise StatePathError(f"path: must be a state file name ({why}letters, digits, '.', '_', '-', "
                                 f"at most 128, not starting with '.'), got {name[:60]!r}")
        return self.namespace_dir("shared" if shared else namespace), name, repr(name)

    def namespace_dir(self, namespace: str | None) -> int:
        """A descriptor of the namespace's directory (None: the root), created if missing;
        the caller closes it."""
        d = self.root / namespace if namespace else self.root
        try:
            return open_dir(d, create=True)
        except OSError as e:
            raise StatePathError(f"path: the state namespace cannot be opened ({e.strerror})") from None
