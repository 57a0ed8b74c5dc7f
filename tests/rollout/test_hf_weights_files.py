"""``ShardedSafetensorsWriter``: transformers' shard names and index, bounded host memory, partial files."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_trace.rollout.hf_weights import INDEX_FILE, ShardedSafetensorsWriter


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(8, 16, generator=g) for i in range(10)} | {"big": torch.randn(64, 64, generator=g)}


def test_shards_fill_in_order_and_hold_one_shard_plus_one_tensor(tmp_path):
    tensors = _tensors()  # 512 bytes each, "big" 16 KiB: above the shard size, a shard of its own
    with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1500) as w:
        for name, t in tensors.items():
            w.add(name, t)
    assert w.files == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*w.files, INDEX_FILE])
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["weight_map"]["t0"] == w.files[0] and index["weight_map"]["big"] == w.files[-1]
    back = {}
    for f in w.files:
        shard = load_file(tmp_path / f)
        assert set(shard) == {n for n, v in index["weight_map"].items() if v == f}
        back.update(shard)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert w.peak_bytes == 1024 + 64 * 64 * 4  # two small ones held when the big one came, never the whole set


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    view = torch.arange(12.0).view(3, 4)
    with ShardedSafetensorsWriter(tmp_path) as w:
        w.add("a", view[:, :2])  # a non-contiguous view and another of the same storage
        w.add("b", view[1])
    assert w.files == ["model.safetensors"] and sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    back = load_file(tmp_path / "model.safetensors")
    assert torch.equal(back["a"], view[:, :2]) and torch.equal(back["b"], view[1])


def test_refusals_and_an_interrupted_write_leaves_no_partial_files(tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_bytes"):
            ShardedSafetensorsWriter(tmp_path, max_shard_bytes=bad)
    with pytest.raises(RuntimeError, match="export failed"):
        with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=600) as w:
            for name, t in _tensors().items():
                w.add(name, t)
                if name == "t5":
                    with pytest.raises(ValueError, match="'t5' was already written"):
                        w.add("t5", t)
                    raise RuntimeError("export failed")
    assert list(tmp_path.iterdir()) == []


def test_a_shard_fills_up_to_exactly_max_shard_bytes_and_an_empty_writer_writes_one_file(tmp_path):
    """Tensors that fill ``max_shard_bytes`` exactly share one shard (transformers: <= the limit); a writer given no
    tensor still writes ``model.safetensors`` (an empty checkpoint, not a directory without weights)."""
    (tmp_path / "a").mkdir()
    with ShardedSafetensorsWriter(tmp_path / "a", max_shard_bytes=128) as w:
        for i in range(3):
            w.add(f"t{i}", torch.zeros(16))  # 64 bytes each: two fill a shard
    assert w.files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(json.loads((tmp_path / "a" / INDEX_FILE).read_text())["weight_map"].items()) == [
        ("t0", w.files[0]), ("t1", w.files[0]), ("t2", w.files[1])]
    with ShardedSafetensorsWriter(tmp_path) as empty:
        pass
    assert empty.files == ["model.safetensors"] and load_file(tmp_path / "model.safetensors") == {}


def test_only_exact_expert_weight_names_are_parsed():
    """A suffixed name (a ModelOpt scale, a bias) is not the expert's weight: it must not be routed as one."""
    from megatron_trace.rollout.hf_weights import parse_expert_name

    assert parse_expert_name("model.layers.2.mlp.experts.7.up_proj.weight") == (2, 7, "up_proj")
    for name in ("model.layers.2.mlp.experts.7.up_proj.weight_scale", "model.layers.2.mlp.experts.7.up_proj.weight2",
                 "xmodel.layers.2.mlp.experts.7.up_proj.weight", "model.layers.2.mlp.experts.gate_up_proj"):
        assert parse_expert_name(name) is None, name


@pytest.mark.parametrize("where", ["missing", "file"])
def test_a_directory_that_is_missing_or_a_file_is_named_before_anything_is_held(tmp_path, where):
    """Was: a SafetensorError ("I/O error ... .tmpXXXX") at the first full shard or close(), the data held till then;
    loading a checkpoint from a missing local path was transformers' "Repo id must be in the form ..."."""
    from megatron_trace.rollout.hf_model import load_model

    path = tmp_path / "ckpt"
    if where == "file":
        path.write_text("{}")
    state = "is a file" if where == "file" else "does not exist"
    with pytest.raises(NotADirectoryError, match=f"{path} {state}"):
        ShardedSafetensorsWriter(path)
    with pytest.raises(NotADirectoryError, match=f"must be a checkpoint directory; it {state}"):
        load_model(str(path), torch.float32, "cpu", "eager")


@pytest.mark.parametrize("name,tensor", [("a", [1.0, 2.0]), (3, torch.ones(2))], ids=["list", "int_name"])
def test_add_names_a_value_that_is_no_tensor_or_a_name_that_is_no_str(tmp_path, name, tensor):
    """Was: AttributeError 'detach', or a safetensors TypeError at the flush (the whole shard lost)."""
    with pytest.raises(TypeError, match="add\\(name, tensor\\) takes a str name and a torch.Tensor"):
        with ShardedSafetensorsWriter(tmp_path) as w:
            w.add(name, tensor)
    assert list(tmp_path.iterdir()) == []


def test_an_add_that_raised_wrote_nothing_and_its_retry_is_taken(tmp_path):
    """The name was taken before the tensor was copied: an add that raised there (a meta tensor: torch's "Cannot copy
    out of meta tensor", naming no weight) left it taken, and the retry with the real tensor was refused as "already
    written" although nothing of it was."""
    with ShardedSafetensorsWriter(tmp_path) as w:
        w.add("a", torch.ones(2))
        with pytest.raises(ValueError, match="tensor 'b' is a meta tensor: it holds no values"):
            w.add("b", torch.empty(3, device="meta"))
        w.add("b", torch.arange(3.0))
    back = load_file(tmp_path / "model.safetensors")
    assert sorted(back) == ["a", "b"] and torch.equal(back["b"], torch.arange(3.0)) and w.tensors == 2


@pytest.mark.parametrize("blocked", ["model-00002-of-00003.safetensors", INDEX_FILE], ids=["shard", "index"])
def test_a_close_that_fails_renames_nothing_and_leaves_nothing_behind(tmp_path, blocked):
    """A rename failing half-way through ``close`` (a directory in the way) left the first shard under its final name,
    without an index, beside the rest's partial files, which neither the ``with`` block nor ``abort`` removed: a
    reader of the directory took one shard for the checkpoint. Now close rolls its renames back, the ``with`` block
    deletes the partial files, and only what was there before remains; the same writer then closes."""
    (tmp_path / blocked / "in_the_way").mkdir(parents=True)
    tensors = {n: torch.full((100,), float(i)) for i, n in enumerate("abc")}  # 400 bytes each: a shard each
    with pytest.raises(IsADirectoryError):
        with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=500) as w:
            for n, t in tensors.items():
                w.add(n, t)
    assert sorted(p.name for p in tmp_path.iterdir()) == [blocked] and w.files == []
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=500)
    for n, t in tensors.items():
        w.add(n, t)
    with pytest.raises(IsADirectoryError):
        w.close()
    partials = sorted(p.name for p in tmp_path.iterdir() if p.name != blocked)
    assert partials == [f"model-{i:05d}.safetensors.partial" for i in (1, 2, 3)]
    (tmp_path / blocked / "in_the_way").rmdir()
    (tmp_path / blocked).rmdir()
    assert w.close() == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    for f in w.files:
        for n, t in load_file(tmp_path / f).items():
            assert index[n] == f and torch.equal(t, tensors[n])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*w.files, INDEX_FILE])


def test_a_shard_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    """safetensors 0.4-0.7 (``setup.py`` takes >= 0.4) write a shard in place (``File::create``, then the bytes; 0.8
    writes a temporary file and renames it): a write failing half-way (a full disk) left a truncated ``.partial`` file
    that ``abort`` did not know of. Here that write, as those versions do it: the real bytes, cut off by ENOSPC."""
    import errno

    import safetensors.torch

    def in_place_until_full(tensors, filename, metadata=None):
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    with pytest.raises(OSError, match="No space left"):
        with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=500) as w:
            w.add("a", torch.zeros(100))
            w.add("b", torch.ones(100))  # shard 1 ("a") written as usual
            monkeypatch.setattr(safetensors.torch, "save_file", in_place_until_full)
            w.add("c", torch.ones(100))  # shard 2 ("b") fails half-way
    assert list(tmp_path.iterdir()) == []
