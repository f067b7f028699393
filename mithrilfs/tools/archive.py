"""export / import: the whole namespace and its blobs as one portable tar archive.

Layout: ``blobs/<blake3 hex>`` once per unique content, then
``entries.jsonl`` (one JSON object per path: type, mode, times, blob, size,
symlink target) and ``mithrilfs-archive.json`` (format stamp).  Export reads
either a live mount through ordinary file APIs (works from any container
that sees it) or an unmounted store directly.  Import verifies every blob
before using it and merges into the store: paths missing there are added,
paths present are replaced only by a newer archive entry, nothing else is
touched.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from zlib import error as zlib_error

import blake3

from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.store.cas import hash_file
from mithrilfs.store.namespace import ROOT_INODE, outside_mode, servable, valid_name
from mithrilfs.store.open import Store

ARCHIVE_FORMAT = 1
_STAMP = "mithrilfs-archive.json"
_ENTRIES = "entries.jsonl"
Progress = Callable[[int, int], None] | None


class ArchiveError(Exception):
    """The file is not a (readable) mithrilfs archive; one line for the user."""


@dataclass
class Entry:
    path: str
    type: str  # "dir" | "file" | "symlink"
    mode: int
    mtime_ns: int
    atime_ns: int
    blob: str | None = None
    size: int = 0
    target: str | None = None


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _finish(tar: tarfile.TarFile, entries: list[Entry]) -> None:
    lines = "".join(json.dumps(e.__dict__, sort_keys=True) + "\n" for e in entries).encode()
    _add_bytes(tar, _ENTRIES, lines)
    _add_bytes(tar, _STAMP, json.dumps({"format": ARCHIVE_FORMAT, "entries": len(entries),
                                        "created": time.time()}).encode())


# ----------------------------------------------------------------------
# export
# ----------------------------------------------------------------------
def export_mount(mountpoint: Path, out: Path, progress: Progress = None) -> dict[str, int]:
    """Archive a live mount by walking it like any program would."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(mountpoint):
        dirnames[:] = sorted(d for d in dirnames if not (dirpath == str(mountpoint) and d == CONTROL_NAME.decode()))
        rel = os.path.relpath(dirpath, mountpoint)
        if rel != ".":
            paths.append(rel)
        paths += [os.path.normpath(os.path.join(rel, f)) for f in sorted(filenames)]
    entries: list[Entry] = []
    seen: set[str] = set()
    with tarfile.open(out, "w") as tar:
        for i, rel in enumerate(paths, start=1):
            full = mountpoint / rel
            try:
                st = os.lstat(full)
                if stat.S_ISDIR(st.st_mode):
                    entries.append(Entry(rel, "dir", stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_atime_ns))
                elif stat.S_ISLNK(st.st_mode):
                    entries.append(Entry(rel, "symlink", 0o777, st.st_mtime_ns, st.st_atime_ns,
                                         target=os.readlink(full)))
                elif stat.S_ISREG(st.st_mode):
                    digest = hash_file(full).hex()
                    if digest not in seen:
                        tar.add(full, arcname=f"blobs/{digest}", recursive=False)
                        seen.add(digest)
                    entries.append(Entry(rel, "file", stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_atime_ns,
                                         blob=digest, size=st.st_size))
            except FileNotFoundError:
                pass  # evicted or removed while we walked
            if progress:
                progress(i, len(paths))
        _finish(tar, entries)
    return {"entries": len(entries), "blobs": len(seen)}


def _walk_store(store: Store) -> Iterator[tuple[str, int]]:
    stack = [("", ROOT_INODE)]
    while stack:
        prefix, d = stack.pop()
        for name, ino in sorted(store.ns.children(d)):
            path = f"{prefix}{name.decode(errors='surrogateescape')}"
            yield path, ino
            node = store.ns.get(ino)
            if node is not None and node.is_dir:
                stack.append((path + "/", ino))


def export_store(store: Store, out: Path, progress: Progress = None) -> dict[str, int]:
    """Archive an unmounted store straight from its index and blobs."""
    items = list(_walk_store(store))
    entries: list[Entry] = []
    seen: set[str] = set()
    with tarfile.open(out, "w") as tar:
        for i, (path, ino) in enumerate(items, start=1):
            node = store.ns.get(ino)
            if node is None:
                continue
            mode = stat.S_IMODE(node.mode)
            if node.is_dir:
                entries.append(Entry(path, "dir", mode, node.mtime_ns, node.atime_ns))
            elif stat.S_ISLNK(node.mode):
                entries.append(Entry(path, "symlink", mode, node.mtime_ns, node.atime_ns,
                                     target=(node.target or b"").decode(errors="surrogateescape")))
            elif node.is_reg:
                digest = node.hash.hex() if node.hash else None
                if node.hash is not None and digest is not None and digest not in seen:
                    tar.add(store.cas.path(node.hash), arcname=f"blobs/{digest}", recursive=False)
                    seen.add(digest)
                entries.append(Entry(path, "file", mode, node.mtime_ns, node.atime_ns, blob=digest, size=node.size))
            if progress:
                progress(i, len(items))
        _finish(tar, entries)
    return {"entries": len(entries), "blobs": len(seen)}


# ----------------------------------------------------------------------
# import
# ----------------------------------------------------------------------
def _read_archive(tar: tarfile.TarFile) -> list[Entry]:
    try:
        stamp = json.loads(tar.extractfile(_STAMP).read())  # type: ignore[union-attr]
        raw = tar.extractfile(_ENTRIES).read()  # type: ignore[union-attr]
    except (KeyError, AttributeError, ValueError):
        raise ArchiveError("not a mithrilfs archive (no manifest)") from None
    if not isinstance(stamp, dict) or stamp.get("format") != ARCHIVE_FORMAT:
        raise ArchiveError(f"archive format {stamp.get('format') if isinstance(stamp, dict) else '?'} is not supported")
    try:
        lines = raw.decode().splitlines()
    except UnicodeDecodeError:
        raise ArchiveError("manifest is not UTF-8") from None
    return [_parse_entry(n, line) for n, line in enumerate(lines, start=1) if line.strip()]


_FIELDS = {"path", "type", "mode", "mtime_ns", "atime_ns", "blob", "size", "target"}


def _parse_entry(n: int, line: str) -> Entry:
    """One manifest line, checked field by field: ArchiveError naming the line and the field."""
    def bad(why: str) -> ArchiveError:
        return ArchiveError(f"manifest line {n}: {why}")

    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        raise bad("not JSON") from None
    if not isinstance(d, dict):
        raise bad("not an object")
    if not set(d) <= _FIELDS or not {"path", "type", "mode", "mtime_ns", "atime_ns"} <= set(d):
        raise bad(f"unknown or missing keys {sorted(set(d) ^ _FIELDS)}")

    def number(key: str, hi: int) -> int:
        v = d.get(key, 0)
        if type(v) is not int or not 0 <= v < hi:
            raise bad(f"{key} out of range")
        return v

    path, kind, blob, target = d["path"], d["type"], d.get("blob"), d.get("target")
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
        raise bad("bad path")
    if kind not in ("dir", "file", "symlink"):
        raise bad(f"type {kind!r} (only dir, file, symlink)")
    if blob is not None and not (isinstance(blob, str) and len(blob) == 64
                                 and all(c in "0123456789abcdef" for c in blob)):
        raise bad("bad blob hash")
    if target is not None and (not isinstance(target, str) or "\0" in target or len(target) > 4095):
        raise bad("bad symlink target")
    # only the permission bits (a type in the mode would make a device node or a fifo), as
    # namespace.outside_mode allows them: no set-id file, symlinks 0777
    kinds = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}
    mode = outside_mode(kinds[kind], number("mode", 1 << 32))
    return Entry(path, kind, mode, number("mtime_ns", 1 << 63), number("atime_ns", 1 << 63), blob,
                 number("size", 1 << 53), target)


def _open(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:")
    except tarfile.TarError:
        raise ArchiveError(f"{archive}: not a mithrilfs archive (not a tar file)") from None
    except OSError as e:
        raise ArchiveError(f"{archive}: {e.strerror}") from None


def check_archive(archive: Path) -> int:
    """Raise ArchiveError unless *archive* is readable; returns its number of entries."""
    try:
        with _open(archive) as tar:
            return len(_read_archive(tar))
    except (tarfile.TarError, EOFError, zlib_error) as e:
        raise ArchiveError(f"{archive}: truncated or damaged archive ({e})") from None


def import_archive(archive: Path, store: Store, progress: Progress = None) -> dict[str, int]:
    """Merge an archive into an unmounted store; blobs are verified, newer entries win.

    A truncated or damaged archive imports nothing (the manifest is read and
    checked first, every blob before any name); blobs already written by a
    failed import are garbage and collected.
    """
    report = {"added": 0, "replaced": 0, "kept": 0, "conflicts": 0, "rejected": 0, "corrupt_blobs": 0, "blobs": 0}
    try:
        with _open(archive) as tar:
            entries = _read_archive(tar)
            good = _import_blobs(tar, store, entries, report, progress)
            ns = store.ns
            with ns.txn():
                for entry in sorted(entries, key=lambda e: e.path.count("/")):
                    _merge_entry(store, entry, good, report)
    except (tarfile.TarError, EOFError, zlib_error) as e:
        raise ArchiveError(f"{archive}: truncated or damaged archive ({e})") from None
    finally:
        store.cas.clear_staging()
        store.collect_garbage()
    return report


def _import_blobs(tar: tarfile.TarFile, store: Store, entries: list[Entry], report: dict[str, int],
                  progress: Progress) -> dict[str, int]:
    """Extract and verify the blobs the manifest names, at their declared sizes; hex digest -> size of the good ones.

    Sizes are checked before a byte is written (against the manifest, and
    all together against the free space of the store's disk), and a blob is
    hashed while it streams and cut off at its declared size: an archive
    cannot make the import write more than it declares.
    """
    declared = {e.blob: e.size for e in entries if e.type == "file" and e.blob is not None}
    members = [m for m in tar.getmembers() if m.name.startswith("blobs/") and m.isfile()]
    wanted = [m for m in members if declared.get(m.name[len("blobs/"):]) == m.size]
    report["corrupt_blobs"] += len(members) - len(wanted)  # unnamed, or not the size the manifest says
    total = sum(m.size for m in wanted)
    free = shutil.disk_usage(store.root).free
    if total > free:
        raise ArchiveError(f"the archive's blobs need {total} bytes; the store's disk has {free} free")
    good: dict[str, int] = {}
    for i, member in enumerate(wanted, start=1):
        digest_hex = member.name[len("blobs/"):]
        fd, staging = store.cas.new_staging()
        hasher = blake3.blake3()
        try:
            with os.fdopen(fd, "wb") as out:
                src = tar.extractfile(member)
                assert src is not None
                left = member.size
                while left and (chunk := src.read(min(1 << 20, left))):
                    hasher.update(chunk)
                    out.write(chunk)
                    left -= len(chunk)
            if left or hasher.digest().hex() != digest_hex:
                report["corrupt_blobs"] += 1
                continue
            store.blobs.add(staging, bytes.fromhex(digest_hex), member.size)
            good[digest_hex] = member.size
            report["blobs"] += 1
        finally:
            os.unlink(staging)
        if progress:
            progress(i, len(wanted))
    return good


def _merge_entry(store: Store, e: Entry, good: dict[str, int], report: dict[str, int]) -> None:
    ns = store.ns
    if e.type == "file" and e.blob is not None and e.blob not in good:
        report["conflicts"] += 1  # its blob failed verification: leave the path alone
        return
    parent = ROOT_INODE
    parts = [p.encode(errors="surrogateescape") for p in e.path.split("/") if p not in ("", ".")]
    if not parts or not all(valid_name(p) for p in parts) or not servable(ROOT_INODE, parts[0]):
        report["rejected"] += 1  # a name the mount could not serve (too long, ".."): never in the index
        return
    for part in parts[:-1]:
        child = ns.lookup(parent, part)
        if child is None:
            d = ns.create_inode(stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), nlink=2)
            ns.link(parent, part, d.id)
            ns.add_link(ns.get(parent), +1)  # type: ignore[arg-type]
            child = d.id
        node = ns.get(child)
        if node is None or not node.is_dir:
            report["conflicts"] += 1
            return
        parent = child
    name = parts[-1]
    existing_id = ns.lookup(parent, name)
    existing = ns.get(existing_id) if existing_id is not None else None
    kind = {"dir": stat.S_IFDIR, "file": stat.S_IFREG, "symlink": stat.S_IFLNK}[e.type]
    if existing is not None:
        if stat.S_IFMT(existing.mode) != kind:
            report["conflicts"] += 1
            return
        if e.type == "dir" or e.mtime_ns <= existing.mtime_ns:
            report["kept"] += 1
            return
        if e.type == "file":
            _set_blob(store, existing, e, good)
        else:
            new_target = (e.target or "").encode(errors="surrogateescape")
            ns.update_attrs(existing, target=new_target, size=len(new_target))  # type: ignore[arg-type]
        ns.update_attrs(existing, mode=kind | e.mode, mtime_ns=e.mtime_ns)
        report["replaced"] += 1
        return
    target = (e.target or "").encode(errors="surrogateescape") if e.type == "symlink" else None
    node = ns.create_inode(kind | e.mode, os.getuid(), os.getgid(), target=target, nlink=2 if e.type == "dir" else 1)
    ns.link(parent, name, node.id)
    if e.type == "dir":
        ns.add_link(ns.get(parent), +1)  # type: ignore[arg-type]
    if e.type == "file":
        _set_blob(store, node, e, good)
    ns.update_attrs(node, mtime_ns=e.mtime_ns, atime_ns=e.atime_ns)
    report["added"] += 1


def _set_blob(store: Store, node, e: Entry, good: dict[str, int]) -> None:
    if e.blob is None:
        store.ns.drop_content(node)
        return
    store.ns.set_content(node, bytes.fromhex(e.blob), good[e.blob], e.mtime_ns)
