"""``StagedCheckpointDir``: a checkpoint directory replaced as a whole, the user's files kept, a failure undone."""

import logging
import os
import stat

import pytest

from megatron_trace.rollout.checkpoint_dir import StagedCheckpointDir


def _tree(d) -> dict[str, bytes | str]:
    """Every entry under ``d``: file bytes, or ``"-> target"`` for a symlink (not followed)."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(root, name)
            rel = os.path.relpath(p, d)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                out[rel] = open(p, "rb").read()
    return out


def _old_checkpoint(d):
    d.mkdir()
    for name, data in {"model-00001-of-00002.safetensors": b"old 1", "model-00002-of-00002.safetensors": b"old 2",
                       "model.safetensors.index.json": b"{}", "config.json": b"old config",
                       "hf_quant_config.json": b"old quant", "model-00003.safetensors.partial": b"killed save",
                       "README.md": b"mine", "tokenizer.json": b"tok"}.items():
        (d / name).write_bytes(data)
    (d / "extra").mkdir()
    (d / "extra" / "notes.txt").write_bytes(b"notes")
    (d / "latest").symlink_to("extra/notes.txt")


def test_a_commit_replaces_the_checkpoint_files_and_keeps_the_user_s(tmp_path):
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    os.chmod(target, 0o751)
    readme_inode = (target / "README.md").stat().st_ino
    with StagedCheckpointDir(target) as staged:
        assert staged.path.parent == tmp_path and staged.path.name.startswith(".ckpt.tmp-")
        (staged.path / "model.safetensors").write_bytes(b"new")
        (staged.path / "config.json").write_bytes(b"new config")
    assert _tree(target) == {"model.safetensors": b"new", "config.json": b"new config", "README.md": b"mine",
                             "tokenizer.json": b"tok", "extra/notes.txt": b"notes", "latest": "-> extra/notes.txt"}
    assert (target / "README.md").stat().st_ino == readme_inode  # a hard link, not a copy
    assert stat.S_IMODE(target.stat().st_mode) == 0o751
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old directory left


def test_a_failure_leaves_the_target_as_it_was_and_removes_the_temporary_directory(tmp_path):
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    before = _tree(target)
    with pytest.raises(OSError, match="disk full") as e:
        with StagedCheckpointDir(target) as staged:
            (staged.path / "model-00001.safetensors.partial").write_bytes(b"half")
            raise OSError(28, "disk full")
    assert any("was left as it was" in n for n in e.value.__notes__)
    assert _tree(target) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_new_target_its_parents_a_symlinked_target_and_refusals(tmp_path):
    target = tmp_path / "a" / "b" / "ckpt"
    with StagedCheckpointDir(target) as staged:
        (staged.path / "config.json").write_text("{}")
    assert _tree(target) == {"config.json": b"{}"}
    link = tmp_path / "latest"
    link.symlink_to(target)
    with StagedCheckpointDir(link) as staged:
        (staged.path / "config.json").write_text("{1}")
    assert link.is_symlink() and _tree(target) == {"config.json": b"{1}"}  # the directory it points to is replaced
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="'.*file' exists and is not a directory"):
        StagedCheckpointDir(tmp_path / "file")
    with pytest.raises(ValueError, match="'/' is a mount point"):
        StagedCheckpointDir("/")


@pytest.mark.parametrize("where", [".", "sub"], ids=["cwd", "cwd-inside"])
def test_a_target_holding_the_working_directory_is_refused_before_anything_changes(tmp_path, monkeypatch, where):
    """Saving into the working directory (``"."``) or one holding it renamed the process's working directory away
    and removed it: the save succeeded, then every relative path of the process failed (``os.getcwd()`` too)."""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    (target / "sub").mkdir()
    before = _tree(target)
    monkeypatch.chdir(target / where)
    with pytest.raises(ValueError, match="holds the working directory"):
        StagedCheckpointDir("." if where == "." else target)
    assert os.getcwd() == str(target / where) and _tree(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_target_holding_a_mount_point_is_refused_before_anything_changes(tmp_path, monkeypatch):
    """The old directory is removed after the swap: with a mount inside, that would remove the mounted files.
    (``os.path.ismount`` is told which directory is one: mounting needs privileges the tests do not have.)"""
    target = tmp_path / "ckpt"
    (target / "data" / "mnt").mkdir(parents=True)
    (target / "data" / "mnt" / "shared.bin").write_bytes(b"x")
    mount = str(target / "data" / "mnt")
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == mount or real(p))
    with pytest.raises(ValueError, match=r"holds a mount point, .*data/mnt"):
        StagedCheckpointDir(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (target / "data" / "mnt" / "shared.bin").read_bytes() == b"x"


def _leftover_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "megatron_trace.rollout.checkpoint_dir" and r.levelno == logging.WARNING]


def test_the_leftovers_of_killed_saves_are_named_in_one_warning_and_kept(tmp_path, caplog):
    """A save killed mid-write leaves ``.ckpt.tmp-*``; killed after the swap, ``.ckpt.old-*``. Nothing said so: the
    next save names them (a few, and how many), and removes none (another save to the target may be running)."""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    leftovers = [f".ckpt.tmp-{i:08x}" for i in range(6)] + [".ckpt.old-0000abcd"]
    for name in leftovers + [".other.tmp-0000abcd", ".ckpt2.old-0000abcd", ".ckpt.tmp-x", ".ckpt.tmp-0000abcd.mine"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    caplog.set_level(logging.WARNING)
    with StagedCheckpointDir(target) as staged:
        (staged.path / "config.json").write_text("{1}")
    [msg] = _leftover_warnings(caplog)
    assert "7 leftover(s)" in msg and "once no other save to" in msg and ".ckpt.old-0000abcd" in msg, msg
    assert ".ckpt.tmp-00000000" in msg and ".ckpt.tmp-00000005" not in msg, msg  # a few of them, not all
    assert not any(n in msg for n in (".other.", ".ckpt2.", ".ckpt.tmp-x", ".mine", staged.path.name)), msg
    assert "does not exist" not in msg  # the target is there: the .old- is a stale copy, not the only one
    assert all((tmp_path / n / "config.json").exists() for n in leftovers)  # not removed
    assert _tree(target)["config.json"] == b"{1}"
    for name in leftovers:
        (tmp_path / name / "config.json").unlink()
        (tmp_path / name).rmdir()
    caplog.clear()
    with StagedCheckpointDir(target) as staged:
        (staged.path / "config.json").write_text("{2}")
    assert _leftover_warnings(caplog) == []  # nothing left over: nothing said


def test_a_missing_target_whose_earlier_checkpoint_an_interrupted_save_moved_aside_is_said_so(tmp_path, caplog):
    """Killed between the two renames: the target is gone, the earlier checkpoint in ``.ckpt.old-<hex>``, the
    complete new one in ``.ckpt.tmp-<hex>``. The warning says where the earlier checkpoint is, to move it back."""
    target = tmp_path / "ckpt"
    _old_checkpoint(tmp_path / ".ckpt.old-1234abcd")
    (tmp_path / ".ckpt.tmp-1234abcd").mkdir()
    (tmp_path / ".ckpt.tmp-1234abcd" / "config.json").write_text("{new}")
    caplog.set_level(logging.WARNING)
    staged = StagedCheckpointDir(target)
    staged.abort()
    [msg] = _leftover_warnings(caplog)
    assert f"{target} does not exist" in msg and "earlier checkpoint" in msg, msg
    assert "interrupted save" in msg and ".ckpt.old-1234abcd" in msg and "move it back" in msg, msg
    assert ".ckpt.tmp-1234abcd holds the new checkpoint" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.old-1234abcd", ".ckpt.tmp-1234abcd"]


def test_a_new_file_of_a_user_file_s_name_and_symlinks_are_carried_as_they_are(tmp_path):
    """A new checkpoint that writes a file the target already had (here ``tokenizer.json``) keeps the new one (the
    old one is not linked or copied over it); symlinks at the top and inside a carried subdirectory stay symlinks
    (a link to a directory is not copied as that directory's tree, a link inside one is not followed)."""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    (target / "extra_link").symlink_to("extra")
    (target / "extra" / "notes_link").symlink_to("notes.txt")
    (target / "extra" / "sub").mkdir()
    (target / "extra" / "sub" / "f").write_bytes(b"f")
    (target / "extra" / "sub_link").symlink_to("sub")
    with StagedCheckpointDir(target) as staged:
        (staged.path / "tokenizer.json").write_bytes(b"new tok")
        (staged.path / "config.json").write_bytes(b"new config")
    tree = _tree(target)
    assert tree["tokenizer.json"] == b"new tok"
    assert tree["extra_link"] == "-> extra" and tree["extra/notes_link"] == "-> notes.txt"
    assert tree["extra/sub_link"] == "-> sub" and tree["extra/sub/f"] == b"f" and "extra/sub_link/f" not in tree
    assert (target / "extra_link").is_symlink() and not (target / "extra_link" / "notes.txt").is_symlink()


def _failing_swap(monkeypatch, staged, fail_put_back: bool):
    """``os.rename`` of the staged directory into place fails (and, ``fail_put_back``, so does the rename of the old
    checkpoint back), as on a full or read-only filesystem: the swap's own failure path, not the caller's."""
    import megatron_trace.rollout.checkpoint_dir as cd

    real = os.rename

    def rename(src, dst):
        if os.fspath(src) == os.fspath(staged.path) or (fail_put_back and os.fspath(src) == os.fspath(staged._backup)):
            raise OSError(30, "read-only file system")
        return real(src, dst)

    monkeypatch.setattr(cd.os, "rename", rename)


def test_a_swap_that_fails_puts_the_earlier_checkpoint_back(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    before = _tree(target)
    with pytest.raises(OSError, match="read-only") as e:
        with StagedCheckpointDir(target) as staged:
            (staged.path / "config.json").write_bytes(b"new config")
            _failing_swap(monkeypatch, staged, fail_put_back=False)
    assert any("was left as it was" in n for n in e.value.__notes__)
    assert _tree(target) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_swap_that_cannot_put_the_earlier_checkpoint_back_keeps_both_and_says_where(tmp_path, monkeypatch):
    """Both renames failed: the earlier checkpoint is in ``.ckpt.old-*``, the new one in ``.ckpt.tmp-*``; neither is
    removed, not by the ``with`` block's exit nor by an ``abort`` after it, and a second ``commit`` is refused."""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    before = _tree(target)
    staged = StagedCheckpointDir(target)
    (staged.path / "config.json").write_bytes(b"new config")
    _failing_swap(monkeypatch, staged, fail_put_back=True)
    with pytest.raises(OSError, match=r"nor its earlier checkpoint put back: it is in .*\.ckpt\.old-"):
        with staged:
            pass
    staged.abort()
    assert _tree(staged._backup) == before and _tree(staged.path)["config.json"] == b"new config"
    with pytest.raises(RuntimeError, match="already committed or aborted"):
        staged.commit()
    monkeypatch.undo()
    done = StagedCheckpointDir(tmp_path / "other")
    done.commit()
    with pytest.raises(RuntimeError, match="already committed or aborted"):
        done.commit()


@pytest.mark.parametrize("bad", ["model*.safetensors", ("config.json", 3)])
def test_replaced_globs_that_are_no_tuple_of_strs_are_refused(tmp_path, bad):
    """A str was taken as its characters: no glob matched, so the earlier checkpoint's shards were carried into the
    new one beside its own (a stale model-00002 shard in a one-shard checkpoint)."""
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "model-00002-of-00002.safetensors").write_bytes(b"old")
    with pytest.raises(ValueError, match=r"replaced=.* must be a tuple of file-name globs"):
        StagedCheckpointDir(target, replaced=bad)
    assert _tree(target) == {"model-00002-of-00002.safetensors": b"old"}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # (no staging directory left behind)
