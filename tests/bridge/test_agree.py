"""``agree`` / ``agreed``: every rank's outcome is known on every rank before the next collective. The other ranks'
outcomes are what ``all_gather_object`` hands back (torch.distributed's functions stand in for a world of ``W``
ranks here; the gloo runs of test_tensor_parallel.py cover real ranks)."""

import pytest

from megatron_trace.bridge import agree as agree_mod
from megatron_trace.bridge.agree import agree, agreed


@pytest.fixture
def world(monkeypatch):
    """Make this process rank ``rank`` of ``size``, whose peers report ``reasons`` (None: succeeded); returns the
    list of objects this rank gave to each all-gather."""
    sent = []

    def make(rank, size, reasons, gather_error=None):
        dist = agree_mod.dist
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)

        def all_gather_object(out, obj, group=None):
            sent.append(obj)
            if gather_error is not None:
                raise gather_error
            out[:] = [obj if r == rank else reasons[r] for r in range(size)]

        monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
        return sent

    return make


def test_without_a_world_agreed_returns_the_result_or_raises_the_error():
    assert agreed(lambda: 7, "checked") == 7
    with pytest.raises(KeyError, match="gone"):
        agreed(lambda: {}["gone"], "checked")
    agree(None, "checked")


@pytest.mark.parametrize("size", [2, 3])
def test_a_rank_that_succeeded_raises_naming_the_first_rank_that_failed(world, size):
    reasons = [None] * size
    reasons[size - 1] = "OSError: disk"
    sent = world(0, size, reasons)
    with pytest.raises(RuntimeError, match=rf"^rank {size - 1} saved \(this rank's part succeeded; 1 of {size} "
                                           r"rank\(s\) failed\): OSError: disk$"):
        agreed(lambda: 1, "saved", RuntimeError)
    assert sent == [None]


def test_every_rank_succeeding_returns_the_result(world):
    sent = world(1, 2, [None, None])
    assert agreed(lambda: "ok", "loaded") == "ok"
    assert sent == [None]


def test_a_rank_that_failed_raises_its_own_error_with_a_note_after_telling_the_others(world):
    sent = world(1, 2, ["ValueError: other"])
    with pytest.raises(ValueError, match="^mine") as e:
        agreed(lambda: (_ for _ in ()).throw(ValueError("mine")), "loaded")
    assert sent == ["ValueError: mine"]
    assert e.value.__notes__ == ["(on rank 1 of 2; the other ranks raise naming it)"]


def test_a_failed_agreement_raises_this_ranks_error_or_the_agreements(world):
    world(0, 2, [None, None], gather_error=RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        agree(None, "saved")
    with pytest.raises(ValueError, match="mine") as e:
        agree(ValueError("mine"), "saved")
    assert "could not be told: RuntimeError: peer died" in e.value.__notes__[0]
