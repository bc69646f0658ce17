"""Replace a file atomically: a crash at any point leaves the old file or the new one, whole.

The content goes to a fresh temporary file in the target's own directory (a rename across file
systems would not be atomic), is flushed and fsynced, renamed over the target, and then the
directory is fsynced so the rename itself is durable. The old file's cached pages are released
first, so old and new do not occupy the page cache together. On an error the temporary file is
removed and the target is untouched; only a hard crash can leave a ``.<name>.*.tmp`` file
behind, never a damaged target.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import CheckpointError, ErrorCode

#: Random bytes in a temporary file's name (written as twice as many hex digits).
_TEMPORARY_TOKEN_BYTES = 6


def temporary_sibling(target: Path) -> Path:
    """A fresh hidden name beside ``target`` (same directory, so same file system)."""
    token = secrets.token_hex(_TEMPORARY_TOKEN_BYTES)
    return target.with_name(f".{target.name}.{os.getpid()}.{token}.tmp")


#: The longest file name most file systems take, used where the directory cannot say.
_DEFAULT_NAME_MAX = 255


def name_length_problem(target: str | os.PathLike[str]) -> str | None:
    """Why the directory cannot hold the names replacing ``target`` uses, or ``None``.

    Its temporary sibling is about 24 bytes longer than ``target``'s own name: a name that
    fits could still fail every write, which a caller should find before it starts its work.
    """
    final = Path(target)
    try:
        limit = os.pathconf(final.parent, "PC_NAME_MAX")
    except (OSError, ValueError):  # a missing directory, or a platform that cannot say
        limit = _DEFAULT_NAME_MAX
    longest = len(os.fsencode(temporary_sibling(final).name))
    if longest <= limit:
        return None
    return (
        f"name too long: writing it takes a temporary name of {longest} bytes,"
        f" over the directory's limit of {limit}"
    )


def check_name_length(target: str | os.PathLike[str]) -> None:
    """``CKPT_IO`` where :func:`name_length_problem` finds one."""
    problem = name_length_problem(target)
    if problem is not None:
        raise CheckpointError(
            ErrorCode.CKPT_IO, f"{problem} (file {os.fspath(target)})", section="write"
        )


#: A temporary file written to this recently may belong to a live writer whose process id
#: this process cannot see (another container on the same volume).
ORPHAN_MIN_AGE_S = 60.0


def orphaned_temporaries(target: Path, *, now: float | None = None) -> list[Path]:
    """The :func:`temporary_sibling` files of ``target`` whose writing process is gone.

    A hard crash (``kill -9``, power loss) mid-write leaves one behind, as large as the file;
    a restart loop would gather them until the disk is full. Called before this process
    writes any: one named with its own process id is a former process's (a container
    restarted with the same id). A file whose process id is alive otherwise is kept, whoever
    holds that id now, and so is one written in the last :data:`ORPHAN_MIN_AGE_S` seconds.
    """
    now = time.time() if now is None else now
    found = []
    for sibling, pid in _temporaries(target):
        if _writer_may_live(pid):
            continue
        with contextlib.suppress(OSError):
            if now - sibling.stat().st_mtime >= ORPHAN_MIN_AGE_S:
                found.append(sibling)
    return sorted(found)


def temporaries_written_by(target: Path, pid: int) -> list[Path]:
    """The :func:`temporary_sibling` files of ``target`` that process ``pid`` named: for a
    caller that knows that process is gone (its parent, once it reaped it)."""
    return sorted(sibling for sibling, writer in _temporaries(target) if writer == pid)


def _temporaries(target: Path) -> Iterator[tuple[Path, int]]:
    """Each :func:`temporary_sibling` file of ``target`` with its writer's process id."""
    hex_digits = 2 * _TEMPORARY_TOKEN_BYTES  # as temporary_sibling names them
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.[0-9a-f]{{{hex_digits}}}\.tmp")
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return
    for sibling in siblings:
        match = pattern.fullmatch(sibling.name)
        if match is not None:
            yield sibling, int(match.group(1))


def remove_orphaned_temporaries(target: Path) -> list[tuple[Path, int | OSError]]:
    """Remove :func:`orphaned_temporaries` of ``target`` (see :func:`remove_temporaries`)."""
    return remove_temporaries(orphaned_temporaries(target))


def remove_temporaries(files: list[Path]) -> list[tuple[Path, int | OSError]]:
    """Remove ``files``: each with its size in bytes, or the error that kept it (for the
    caller to report: a leftover is as large as the file it was to become)."""
    removed: list[tuple[Path, int | OSError]] = []
    for orphan in files:
        try:
            size = orphan.stat().st_size
            orphan.unlink()
        except OSError as exc:
            removed.append((orphan, exc))
        else:
            removed.append((orphan, size))
    return removed


def _writer_may_live(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # EPERM: someone else's; or no such id
        return True
    return True


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (a directory needs a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular_file(path: str | os.PathLike[str], *, pipes: bool = False) -> io.BufferedReader:
    """Open ``path`` for reading, refusing anything but a regular file (or, with ``pipes``, a
    pipe such as bash's ``<(command)``: a small input passed without a file on disk).

    A plain ``open`` of a FIFO waits for a writer forever: the file is opened non-blocking,
    checked with ``fstat``, and only then switched back to blocking reads (a named FIFO that
    no writer holds open reads as empty). A device, say ``/dev/zero``, is refused.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or (pipes and stat.S_ISFIFO(mode))):
            what = "a regular file or a pipe" if pipes else "a regular file"
            raise OSError(errno.EINVAL, f"not {what}", os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: str | os.PathLike[str], limit: int) -> bytes | None:
    """The bytes of a small input given by name (a regular file or a pipe), or None when it
    holds more than ``limit`` bytes: nothing past ``limit + 1`` is read. Opening and reading
    fail as :func:`open_regular_file` does."""
    with open_regular_file(path, pipes=True) as file:
        status = os.fstat(file.fileno())
        if stat.S_ISREG(status.st_mode) and status.st_size > limit:
            return None  # a regular file's size is known: refuse it without reading
        data = file.read(limit + 1)
    return None if len(data) > limit else data


def release_cached_pages(path: Path) -> None:
    """Advise the kernel to drop the page cache of a file that is about to be replaced.

    Old and new content would otherwise sit in the page cache side by side, so replacing a
    2 GiB checkpoint would ask for 2 GiB of fresh cache. Advisory only: contents never change,
    dirty pages are kept, and a missing file or a platform without ``posix_fadvise`` is fine.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


#: The ``section`` of the error :func:`atomic_replace` raises when the directory fsync after the
#: rename fails: unlike any other failure, the target *was* replaced (readers see the new file),
#: it is only not known to survive a crash.
UNSYNCED_RENAME = "directory sync"


@contextlib.contextmanager
def atomic_replace(
    target: str | os.PathLike[str], *, before_replace: Callable[[], object] | None = None
) -> Iterator[Path]:
    """Yield a temporary path to write; on a clean exit it durably replaces ``target``.

    The caller writes the temporary path however it likes (it does not exist yet). Its own
    handles must be closed when the block ends; the data is then fsynced, renamed and the
    directory fsynced. ``before_replace`` runs once the new data is durable, right before the
    rename (an error there leaves the target as it was). ``OSError`` becomes
    ``CheckpointError(CKPT_IO)``; its section is :data:`UNSYNCED_RENAME` only when the
    target was already replaced.
    """
    final = Path(target)
    staging = temporary_sibling(final)
    release_cached_pages(final)
    try:
        yield staging
        fsync_path(staging)
        if before_replace is not None:
            before_replace()
        os.replace(staging, final)
    except BaseException as exc:
        # Any failure here (EROFS on a read-only mount, where the file never came to be)
        # must not hide the error that ended the write.
        with contextlib.suppress(OSError):
            staging.unlink()
        if isinstance(exc, OSError):
            raise io_error(final, exc) from exc
        raise
    try:
        fsync_path(final.parent)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise CheckpointError(
            ErrorCode.CKPT_IO,
            f"{reason}: the new file replaced the old one, but its directory could not be synced,"
            f" so a crash may bring the old one back (file {os.fspath(final)})",
            section=UNSYNCED_RENAME,
        ) from exc


def write_bytes_atomically(target: str | os.PathLike[str], data: bytes) -> None:
    """Atomically replace ``target`` with ``data`` (for small files such as the final marker)."""
    with atomic_replace(target) as staging, open(staging, "xb") as file:
        file.write(data)


def io_error(
    path: str | os.PathLike[str], exc: OSError, *, section: str = "write"
) -> CheckpointError:
    """The one-line ``CKPT_IO`` error for a failed read or write of ``path``."""
    reason = exc.strerror or str(exc)
    return CheckpointError(ErrorCode.CKPT_IO, f"{reason} (file {os.fspath(path)})", section=section)
