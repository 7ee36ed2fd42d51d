"""Files that are either whole or absent: write a temporary file beside the target, then rename."""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from dsgpt2.errors import DsGpt2Error, NoRoomError

log = logging.getLogger(__name__)
# Less free space than this where a write failed: a full disk (a library's error need not say so:
# torch.save's is "unexpected pos").
FULL_DISK_BYTES = 32 * 2**20
# What the writers of checkpoints and exports say when a write failed without naming why (torch.save's
# zip writer, its C++ streams; safetensors').
_WRITE_FAILED = ("unexpected pos", "iostream error", "PytorchStreamWriter failed", "I/O error")
# Less free space than this where a command is about to write its output (a report, a plot, a run's
# records): a full disk, refused before the work rather than found after it.
ROOM_TO_START = 2**20


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike[str], mode: str = "w", prefix: str | None = None
) -> Iterator[IO[Any]]:
    """Open a temporary file in ``path``'s directory; on a clean exit it replaces ``path``.

    The data is flushed to disk before the rename, so a crash leaves either the old file or the new
    one, never a part. On an error the temporary file is removed and ``path`` is left as it was.

    Args:
        path: the file to write.
        mode: ``"w"`` (UTF-8 text) or ``"wb"``.
        prefix: name prefix of the temporary file (default ``.NAME.``), for whoever cleans up
            after a killed writer.
    """
    path = Path(path)
    # By default the temporary file's name carries this process's id: one a killed writer left (a
    # SIGKILL between the write and the rename) is removed by the next write of ``path``.
    own = f".{path.name}.{os.getpid()}."
    fd, tmp = tempfile.mkstemp(prefix=prefix or own, suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # as open() makes a file, not mkstemp's 0600
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if prefix is None:
        _clear_left_writes(path)


def _clear_left_writes(path: Path) -> None:
    """The temporary files of ``path`` (``.NAME.PID.XXXXXXXX.tmp``) whose writer no longer runs."""
    head = f".{path.name}."
    with contextlib.suppress(OSError):
        for tmp in path.parent.glob(f"{glob.escape(head)}*.tmp"):
            pid, *rest = tmp.name[len(head) : -len(".tmp")].split(".")
            writer = int(pid) if pid.isdigit() and len(rest) == 1 else os.getpid()
            if writer != os.getpid() and not process_alive(writer):
                tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def output_writer(
    path: str | os.PathLike[str], mode: str = "w", prefix: str | None = None
) -> Iterator[IO[Any]]:
    """:func:`atomic_writer` for a command's output (a report, a plot): its directory made, and a disk
    that fills while it is written told in one line.

    Raises:
        NoRoomError: the disk filled; no temporary file is left and what was at ``path`` is kept.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_writer(path, mode, prefix) as f:
            yield f
    except Exception as exc:
        room = None if isinstance(exc, DsGpt2Error) else out_of_room(path.parent, exc)
        if room is None:
            raise
        raise NoRoomError(
            f"{path}: not written, {room}; what was there is kept: free space there (or name another place) "
            "and re-run"
        ) from None


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one step."""
    with atomic_writer(path) as f:
        f.write(text)


def open_records(path: Path) -> IO[str]:
    """``path``, a file of one JSON record per line, opened to append records. Where a killed run left
    its last record cut short, that part stays a line of its own (a warning says so) and the new
    records start on the next."""
    torn = False
    if path.is_file() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    f = open(path, "a", encoding="utf-8")  # noqa: SIM115  (the caller's, for its run)
    if torn:
        log.warning("%s ends mid-record (a run stopped while writing it): this run's records start on the "
                    "next line", path)  # fmt: skip
        f.write("\n")
    return f


def umask() -> int:
    """This process's umask: read where /proc tells it (setting it to read it is not thread-safe)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def out_of_room(where: Path, exc: BaseException) -> str | None:
    """Why writing under ``where`` failed where its disk is full, in words: ``exc`` (or an exception it
    came from) is ENOSPC or EDQUOT, or is a write that failed (an OSError, torch's and safetensors'
    writers' errors) with less than FULL_DISK_BYTES left there. None otherwise: any other error keeps
    its own message, however full the disk."""
    said = a_write = False
    seen = [exc]
    while len(seen) < 10 and not said:
        e = seen[-1]
        said = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
            words in str(e) for words in ("No space left on device", "os error 28", "Disk quota exceeded")
        )
        a_write = a_write or isinstance(e, OSError) or any(words in str(e) for words in _WRITE_FAILED)
        if (e.__cause__ or e.__context__) is None:
            break
        seen.append(e.__cause__ or e.__context__)  # type: ignore[arg-type]
    free = _free_bytes(where)
    if not said and (not a_write or free is None or free >= FULL_DISK_BYTES):
        return None
    return f"the disk holding {where} is full" + ("" if free is None else f" ({free / 2**20:.0f} MB free)")


def _free_bytes(where: Path) -> int | None:
    """The free bytes of the disk that holds ``where`` (made or not); None where it does not say."""
    existing = next((p for p in (where, *where.parents) if p.exists()), None)
    try:
        return shutil.disk_usage(existing).free if existing is not None else None
    except OSError:
        return None


def no_room(where: Path, needed: int = ROOM_TO_START) -> str | None:
    """Why the disk holding ``where`` (made or not) has no room for a command's output, in words: less
    than ``needed`` bytes free. None where it has room, or its disk does not say."""
    free = _free_bytes(where)
    return (
        None
        if free is None or free >= needed
        else f"the disk holding {where} is full ({free / 2**20:.0f} MB free)"
    )


def check_room(path: str | os.PathLike[str], flag: str, needed: int = ROOM_TO_START) -> None:
    """Refuse, before the work, an output whose disk is full (:func:`no_room`: ``needed`` bytes).

    Raises:
        NoRoomError: naming ``flag`` and the disk.
    """
    room = no_room(Path(path), needed)
    if room is not None:
        raise NoRoomError(
            f"{flag} {path}: {room}; nothing was done: free space there (or name another place) and re-run"
        )


def parses_as_toml(path: Path) -> bool:
    import tomllib

    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return True


# What a path is, by the type its metadata gives, where a regular file or a directory was wanted.
_KINDS = (
    (stat.S_ISREG, "a file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is in words ("a named pipe"); None where nothing is there. Only its metadata is read:
    opening a named pipe would wait for a writer.

    Raises:
        OSError: its metadata cannot be read (a directory on the way that cannot be searched).
    """
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a file, in words ("file not found", "a named pipe, not a regular
    file"); None where it is a regular file (a link to one included)."""
    try:
        kind = _kind(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if kind is None:
        return "file not found"
    if kind == "a directory":
        return "a directory, not a file"
    return None if kind == "a file" else f"{kind}, not a regular file"


def not_a_directory(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a directory, in words ("directory not found", "a file, not a
    directory"); None where it is one."""
    try:
        kind = _kind(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if kind is None:
        return "directory not found"
    return None if kind == "a directory" else f"{kind}, not a directory"


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file ``path``. A named pipe, a device or a directory there raises OSError
    (IsADirectoryError for a directory) rather than being read: it is opened without waiting for a writer
    and its type checked before a byte is read.

    Raises:
        OSError: nothing there, not a regular file, or unreadable.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "a directory, not a file", str(path))
        if not stat.S_ISREG(mode):
            kind = next((kind for test, kind in _KINDS if test(mode)), "not a regular file")
            raise OSError(errno.EINVAL, f"{kind}, not a regular file", str(path))
    except OSError:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read()


def is_occupied(path: Path) -> bool:
    """Whether ``path`` is a file or a directory holding anything."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


# The key under which an artifact's record (an export's, a tokenizer's) lists the files it wrote.
RECORDED_FILES = "files"


def unlisted(directory: Path, listed: object, record: str, marks: tuple[str, ...] = ()) -> list[str]:
    """What ``directory`` holds beside the artifact whose record (the file ``record``) lists its files as
    ``listed``: the names it does not list; a record without the list (an older one): the directory's
    subdirectories and the files named ``marks`` (another artifact's, a checkpoint's ``latest``)."""
    names = sorted(os.listdir(directory))
    if isinstance(listed, list):
        return [n for n in names if n not in listed and n != record]
    return [n for n in names if (directory / n).is_dir() or n in marks]


def unwritable_dir(path: str | os.PathLike[str]) -> str | None:
    """Why files cannot be written in a directory at ``path`` (made if it is not there), or None when they
    can: found by making and removing an empty directory in its nearest existing ancestor, so nothing is
    left behind and nothing is made that the work would not make.
    """
    path = Path(path)
    try:
        str(path).encode()
    except UnicodeEncodeError:  # bytes the file system's encoding could not decode
        return "the path is not UTF-8 text (the tokenizer and the JSON files record it so)"
    there = path
    while not os.path.lexists(there) and there.parent != there:
        there = there.parent
    if not there.is_dir():
        return f"{there} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dsgpt2-probe-", dir=there))
    except OSError as exc:
        # It is there: "no such file" says the file system (/proc, /sys) takes no new entries.
        why = "its file system takes no new files" if exc.errno == errno.ENOENT else exc.strerror
        return f"nothing can be written in {there} ({why})"
    return None


def check_writable_dir(path: str | os.PathLike[str], flag: str) -> None:
    """Refuse, before the work, a directory the work would write in and could not.

    Raises:
        ConfigError: naming ``flag`` and why (:func:`unwritable_dir`).
    """
    from dsgpt2.errors import ConfigError

    problem = unwritable_dir(path)
    if problem is not None:
        raise ConfigError(f"{flag} {path}: {problem}; give a directory that can be written")


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` itself (nothing is left behind to clean up)."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


_STAGING = ".staging-"


def _clear_stale_staging(out: Path) -> None:
    """Remove what writers killed mid-write left beside ``out`` (their process is gone)."""

    for path in out.parent.glob(f".{out.name}{_STAGING}*"):
        pid = path.name[len(f".{out.name}{_STAGING}") :].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            if path.name.endswith("-old") and not out.exists():
                os.replace(path, out)  # killed between the two renames: the earlier artifact returns
            else:
                shutil.rmtree(path, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a writer that left something behind)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def staged_dir(out: Path, check: Callable[[], None] | None = None) -> Iterator[Path]:
    """A fresh directory beside ``out`` to write a whole artifact into; on a clean exit it becomes
    ``out``.

    A crash leaves ``out`` as it was (the staging directory goes with the next writer); a writer that
    finished beside another one never leaves half of each: under a lock on ``out``'s parent,
    ``check`` runs again (it raises to refuse what another writer put at ``out`` meanwhile), then an
    earlier ``out`` is swapped out and removed only once the new one is in place.

    Raises:
        whatever ``check`` raises; the staging directory is then removed and ``out`` left alone.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with _directory_lock(out.parent):
        _clear_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{_STAGING}{os.getpid()}-", dir=out.parent))
    os.chmod(staging, 0o777 & ~umask())  # as mkdir makes a directory, not mkdtemp's 0700
    try:
        yield staging
        with _directory_lock(out.parent):
            if check is not None:
                check()
            old = None
            if out.exists():
                old = staging.with_name(f"{staging.name}-old")
                os.replace(out, old)
            os.replace(staging, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except Exception as exc:
        room = None if isinstance(exc, DsGpt2Error) else out_of_room(out.parent, exc)  # before the rmtree
        shutil.rmtree(staging, ignore_errors=True)
        if room is None:
            raise
        raise NoRoomError(
            f"{out}: not written, {room}; what was there is kept: free space there, or name another place"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def file_digest(path: Path) -> str:
    """A short content hash of a file (16 hex digits of its SHA-256)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def file_sha256(path: Path) -> dict[str, Any]:
    """The size and SHA-256 of the file ``path``."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def file_digests(directory: Path, skip: str | None = None) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file under ``directory`` (those named ``skip`` excepted), by relative
    path."""
    paths = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != skip)
    return {str(p.relative_to(directory)): file_sha256(p) for p in paths}


def reader_cache() -> Path:
    """Where commands keep their copies of what they read from the database (``$XDG_CACHE_HOME/dsgpt2``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "dsgpt2"
