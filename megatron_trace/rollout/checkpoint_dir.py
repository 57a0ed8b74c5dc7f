"""Replace a checkpoint directory as a whole: write a temporary sibling, then rename it into place.

A save that fails (an I/O error on shard k, a full disk, an exception from the export) leaves the directory's
earlier checkpoint as it was and removes the temporary one. ``StagedCheckpointDir(target)`` makes the sibling
``.<name>.tmp-<hex>`` (same filesystem, so the final renames are atomic); write the checkpoint into its ``path``;
leaving the ``with`` block normally fsyncs every file, carries over the target's other files, renames the old
directory to ``.<name>.old-<hex>``, the new one to ``target``, and removes the old one. Leaving it by an exception
removes the temporary directory and re-raises (a note on the exception says the target was not changed).

The target's files that are not checkpoint files (``CHECKPOINT_FILES``: weights, their index, ``config.json``,
``hf_quant_config.json``) are the user's (a README, tokenizer files, a subdirectory): they are carried into the new
directory as hard links (copies where the filesystem has none), as transformers' ``save_pretrained`` leaves them.
The earlier checkpoint's files are not carried: a stale shard, index or ``hf_quant_config.json`` would describe
weights that are no longer there.

A process killed mid-save leaves the target untouched and the ``.<name>.tmp-*`` sibling behind; killed between the two
renames, it leaves the old checkpoint in ``.<name>.old-*`` (the target missing) and the complete new one in
``.<name>.tmp-*`` of the same suffix. The next ``StagedCheckpointDir`` for that target logs one warning naming such
siblings and, when the target is missing, where its earlier checkpoint is (to move it back). It removes none of them:
another process may be saving to the target right now; remove them once none is.

A target that is a symlink is resolved (the directory it points to is replaced); a mount point is refused (it cannot be
renamed), and so are a directory holding a mount point (removing the old directory would remove the mounted files) and
the working directory or one holding it (the process would be left in the removed old directory).
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

CHECKPOINT_FILES = ("model*.safetensors", "model*.safetensors.partial", "model.safetensors.index.json",
                    "config.json", "hf_quant_config.json")
"""Names (globs) of a checkpoint's own files: a new checkpoint replaces them; every other entry is carried over."""


class StagedCheckpointDir:
    """A temporary sibling of ``target`` to write a checkpoint into, renamed into place on success (see the module
    docstring). ``path``: where to write."""

    def __init__(self, target: str | os.PathLike, replaced: tuple[str, ...] = CHECKPOINT_FILES):
        self.target = Path(os.path.realpath(os.fspath(target)))
        if isinstance(replaced, str | bytes) or not all(isinstance(g, str) for g in replaced):
            # (a str was its characters: no glob matched, and the earlier checkpoint's shards were carried over)
            raise ValueError(f"replaced={replaced!r} must be a tuple of file-name globs (e.g. {CHECKPOINT_FILES[:2]})")
        self.replaced = tuple(replaced)
        if self.target.exists() and not self.target.is_dir():
            raise NotADirectoryError(f"{os.fspath(target)!r} exists and is not a directory: a checkpoint is a "
                                     "directory")
        if self.target.is_dir() and os.path.ismount(self.target):
            raise ValueError(f"{os.fspath(target)!r} is a mount point: a save writes a sibling directory and renames "
                             "it into place, which a mount point cannot be; save into a directory inside it")
        cwd = Path(os.path.realpath(os.getcwd()))
        if self.target == cwd or self.target in cwd.parents:
            raise ValueError(f"{os.fspath(target)!r} holds the working directory {cwd}: a save renames the directory "
                             "away and removes it, which would leave this process in a removed directory; save into "
                             "another directory, or run from outside it")
        inner = _mount_inside(self.target) if self.target.is_dir() else None
        if inner is not None:
            raise ValueError(f"{os.fspath(target)!r} holds a mount point, {inner}: a save carries the directory's "
                             "other entries into the new one and removes the old one, which would remove the mounted "
                             "files; move the mount out of the checkpoint directory or save elsewhere")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        _warn_of_leftovers(self.target)
        token = secrets.token_hex(4)
        self.path = self.target.parent / f".{self.target.name}.tmp-{token}"
        self._backup = self.target.parent / f".{self.target.name}.old-{token}"
        try:
            self.path.mkdir()  # (mode 0o777 less the umask, as a plain mkdir)
            if self.target.is_dir():
                shutil.copymode(self.target, self.path)
        except OSError as e:
            shutil.rmtree(self.path, ignore_errors=True)
            raise OSError(e.errno, f"cannot create the temporary directory {self.path} beside {self.target} (a "
                                   f"save writes there, then renames it into place): {e.strerror}") from e
        self._done = False

    def __enter__(self) -> StagedCheckpointDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            if isinstance(exc, Exception):
                exc.add_note(f"saving to {self.target} failed: the directory was left as it was; the partial save "
                             f"in {self.path} was removed")
            return
        try:
            self.commit()
        except BaseException as e:
            if not self._done:
                self.abort()
                if isinstance(e, Exception):
                    e.add_note(f"replacing {self.target} failed: it was left as it was; {self.path} was removed")
            raise

    def commit(self) -> None:
        """fsync the new files, carry over the target's other files, swap the directories, remove the old one."""
        if self._done:
            raise RuntimeError(f"{self.path} was already committed or aborted")
        for f in sorted(p for p in self.path.rglob("*") if p.is_file() and not p.is_symlink()):
            _fsync(f)
        if self.target.is_dir():
            self._carry_over()
        _fsync(self.path)
        had_target = self.target.is_dir()
        if had_target:
            os.rename(self.target, self._backup)
        try:
            os.rename(self.path, self.target)
        except OSError:
            if had_target:
                try:
                    os.rename(self._backup, self.target)
                except OSError as e:
                    self._done = True  # the new checkpoint stays in self.path, the old one in self._backup
                    raise OSError(e.errno, f"{self.target} could not be replaced, nor its earlier checkpoint put back: "
                                           f"it is in {self._backup}, the new one in {self.path}") from e
            raise
        self._done = True
        try:
            _fsync(self.target.parent)
        except OSError as e:
            logger.warning("%s: saved, but fsync of %s failed: %s", self.target, self.target.parent, e)
        if had_target:
            try:
                shutil.rmtree(self._backup)
            except OSError as e:  # the new checkpoint is in place; only the old copy is left over
                logger.warning("%s: saved, but the earlier checkpoint moved to %s could not be removed: %s",
                               self.target, self._backup, e)

    def abort(self) -> None:
        """Remove the temporary directory (the target is not touched)."""
        if self._done:
            return
        self._done = True
        try:
            shutil.rmtree(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("%s: the save failed and its temporary directory %s could not be removed: %s",
                           self.target, self.path, e)

    def _carry_over(self) -> None:
        kept = []
        for entry in sorted(os.scandir(self.target), key=lambda e: e.name):
            dst = self.path / entry.name
            if any(fnmatch.fnmatchcase(entry.name, g) for g in self.replaced) or os.path.lexists(dst):
                continue
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), dst)
            elif entry.is_dir():
                shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(entry.path, dst)
            kept.append(entry.name)
        if kept:
            logger.info("%s: kept %d entr%s that are not checkpoint files: %s", self.target, len(kept),
                        "y" if len(kept) == 1 else "ies", kept[:5])


_SHOWN = 5  # leftovers named in the warning


def _warn_of_leftovers(target: Path) -> None:
    """One warning naming the ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings of ``target`` (saves killed, or running
    now); none is removed."""
    prefix = f".{target.name}."
    sibling = re.compile(re.escape(prefix) + r"(tmp|old)-[0-9a-f]+")
    try:
        found = sorted(e.name for e in os.scandir(target.parent) if sibling.fullmatch(e.name))
    except OSError:
        return
    if not found:
        return
    shown = ", ".join(found[:_SHOWN]) + (", ..." if len(found) > _SHOWN else "")
    message = (f"{target}: {len(found)} leftover(s) of earlier saves beside it in {target.parent}: {shown} (.tmp-*: "
               "the temporary directories of saves that were killed, or of one running now; .old-*: earlier "
               "checkpoints moved aside by a save killed before removing them); they can be removed once no other "
               "save to this directory is running")
    olds = [n for n in found if n.startswith(prefix + "old-")]
    if olds and not target.exists():
        message += (f". {target} does not exist: an interrupted save left the earlier checkpoint in {', '.join(olds)} "
                    f"(move it back to {target} to restore it)")
        complete = [n for n in (prefix + "tmp-" + o[len(prefix) + 4:] for o in olds) if n in found]  # same suffix
        if complete:
            message += f"; {', '.join(complete)} holds the new checkpoint, complete (it was written before the renames)"
    logger.warning("%s", message)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links: a copy, on disk before the old directory is removed
        shutil.copy2(src, dst)
        _fsync(Path(dst))


def _mount_inside(root: Path) -> str | None:
    """A mount point under ``root`` (its directories walked, symlinks not followed), or None."""
    for dirpath, dirnames, _ in os.walk(root):
        for d in dirnames:
            if os.path.ismount(os.path.join(dirpath, d)):
                return os.path.join(dirpath, d)
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):  # (some filesystems do not fsync directories)
            raise
    finally:
        os.close(fd)
