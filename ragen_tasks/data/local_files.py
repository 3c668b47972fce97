"""Local files written whole or not at all, and never left half-named by a killed writer.

``write_local_file`` is how the store (``store.py``) writes every file under a local root (data objects and
manifests create-only, leases and reports by replacement) and how the regression gate writes a local evaluation
record (``pipeline/gate.py``).
"""

from __future__ import annotations

import os
import tempfile
import uuid

_FILE_MODE = 0o644  # of every file written here, whichever way it was written


def write_local_file(path: str, data: bytes, *, exclusive: bool) -> bool:
    """Give ``data`` the local name ``path`` in one step, so a reader sees all of it or nothing, and
    make the name durable. ``exclusive``: create-only, False if ``path`` already exists (a link fails
    with EEXIST like ``O_EXCL``); else the new file replaces any old one."""
    path = os.path.abspath(path)  # a bare file name's folder is the working folder, not ""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    written = _write_nameless(folder, path, data, exclusive=exclusive)
    if written is None:
        written = _write_named(folder, path, data, exclusive=exclusive)
    _sync_folder(folder)
    return written


def _write_nameless(folder: str, path: str, data: bytes, *, exclusive: bool) -> bool | None:
    """Write ``data`` to a file that has no name (Linux ``O_TMPFILE``: it vanishes with a killed
    writer), sync it, then link it to ``path`` (create-only) or to a ``.tmp-*`` name renamed over
    ``path`` (a kill must land between those two system calls to leave it). None where this cannot be
    done here, with nothing named: not Linux, no ``/proc``, or a file system that refuses the flag or
    the link."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, _FILE_MODE)
    except OSError:  # EOPNOTSUPP, EISDIR or EINVAL, depending on the kernel and the file system
        return None
    target = path if exclusive else f"{folder}/.tmp-{uuid.uuid4().hex}"
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        # open(2)'s way to name an O_TMPFILE file: linkat("/proc/self/fd/N", ..., AT_SYMLINK_FOLLOW); os.link
        # calls linkat with that flag only when given a folder descriptor (the paths stay absolute).
        folder_fd = os.open(folder, os.O_RDONLY)
        try:
            os.link(f"/proc/self/fd/{f.fileno()}", target, src_dir_fd=folder_fd, follow_symlinks=True)
        except FileExistsError:
            if exclusive:
                return False
            raise
        except OSError:  # EXDEV, EPERM, ENOENT: a file system or sandbox that does not allow it
            return None
        finally:
            os.close(folder_fd)
    if not exclusive:
        try:
            os.replace(target, path)
        finally:
            if os.path.lexists(target):
                os.unlink(target)
    return True


def _write_named(folder: str, path: str, data: bytes, *, exclusive: bool) -> bool:
    """The portable way: a named ``.tmp-*`` file in the same folder, synced, then linked (create-only)
    or renamed into place; a kill before that leaves it behind (no manifest names it: nothing reads it)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _FILE_MODE)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _sync_folder(folder: str) -> None:
    """Sync ``folder`` so a name just linked or renamed in it survives a power cut; best effort (some
    file systems refuse to sync a folder: the name is there all the same)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform that cannot open a folder for reading (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
