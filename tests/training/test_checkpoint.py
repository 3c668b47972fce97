"""Checkpoints: exact round trip, marker commit, tamper / uncommitted refusal, keep_last pruning."""

import json

import pytest
import torch

from ragen_tasks.training import checkpoint as ckpt
from ragen_tasks.training.backend import make_optimizer
from ragen_tasks.training.critic import make_critic
from tests.training._models import tiny_actor


def _train_one_step(model, opt):
    loss = model(input_ids=torch.arange(2, 10).unsqueeze(0)).logits.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_round_trip_is_exact(tmp_path):
    actor = tiny_actor(0)
    critic = make_critic(actor)
    opt = make_optimizer(actor, lr=1e-3, weight_decay=0.0)
    _train_one_step(actor, opt)
    gen = torch.Generator().manual_seed(3)
    info = ckpt.save_checkpoint(
        tmp_path,
        1,
        actor=actor,
        optimizers={"actor": opt},
        models={"critic": critic},
        extra_state={"generator": gen.get_state(), "note": 7},
        policy_version=5,
    )
    assert info.path.name == "step_000001" and info.policy_version == 5
    assert info.fingerprint == ckpt.sha256_file(info.path / "model.safetensors")
    expected_next = torch.rand(3)

    actor2, critic2 = tiny_actor(1), make_critic(tiny_actor(1))
    opt2 = make_optimizer(actor2, lr=1e-3, weight_decay=0.0)
    _train_one_step(actor2, opt2)
    loaded = ckpt.load_checkpoint(info.path, actor=actor2, optimizers={"actor": opt2}, models={"critic": critic2})
    assert torch.equal(torch.rand(3), expected_next)  # global RNG restored
    assert loaded.extra_state["note"] == 7 and loaded.fingerprint == info.fingerprint
    for k, v in actor.state_dict().items():
        assert torch.equal(v, actor2.state_dict()[k]), k
    for k, v in critic.state_dict().items():
        assert torch.equal(v, critic2.state_dict()[k]), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)


def test_refuses_uncommitted_and_tampered(tmp_path):
    actor = tiny_actor(0)
    opt = make_optimizer(actor, lr=1e-3, weight_decay=0.0)
    info = ckpt.save_checkpoint(tmp_path, 1, actor=actor, optimizers={"actor": opt})
    with pytest.raises(ckpt.CheckpointError, match="already committed"):
        ckpt.save_checkpoint(tmp_path, 1, actor=actor, optimizers={"actor": opt})
    (info.path / "optim_actor.pt").write_bytes(b"tampered")
    with pytest.raises(ckpt.CheckpointError, match=r"optim_actor\.pt has sha256"):
        ckpt.load_checkpoint(info.path, actor=actor, optimizers={"actor": opt})
    (info.path / ckpt.MARKER).unlink()
    with pytest.raises(ckpt.CheckpointError, match="not committed"):
        ckpt.load_checkpoint(info.path, actor=actor)
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_keep_last_prunes_only_after_commit(tmp_path):
    actor = tiny_actor(0)
    opt = make_optimizer(actor, lr=1e-3, weight_decay=0.0)
    for step in range(1, 5):
        _train_one_step(actor, opt)
        ckpt.save_checkpoint(tmp_path, step, actor=actor, optimizers={"actor": opt}, keep_last=2)
    assert [i.step for i in ckpt.committed_checkpoints(tmp_path)] == [3, 4]
    marker = json.loads((tmp_path / "step_000004" / ckpt.MARKER).read_text())
    assert set(marker["files"]) >= {"model.safetensors", "config.json", "optim_actor.pt", "rng.pt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_prune_removes_what_an_interrupted_prune_left(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A prune killed between uncommitting a folder and deleting it leaves an uncommitted folder of an
    old step: the next prune removes it, and never touches a committed or newer folder."""
    actor = tiny_actor()
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    for step in (0, 1, 2):
        ckpt.save_checkpoint(tmp_path, step, actor=actor, optimizers={"actor": opt})
    (ckpt.step_dir(tmp_path, 0) / ckpt.MARKER).unlink()  # the kill came after this line of prune
    ckpt.step_dir(tmp_path, 3).mkdir()  # a newer folder being written: left alone
    ckpt.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]


class _Part:
    """A stand-in for one rank's sharded optimizer (a ZeRO TrainModel): its state is its own part."""

    sharded_state = True

    def __init__(self, value: float) -> None:
        self.state = {"state": {0: {"exp_avg": torch.full((3,), value)}}, "param_groups": []}

    def state_dict(self):  # type: ignore[no-untyped-def]
        return self.state

    def load_state_dict(self, state):  # type: ignore[no-untyped-def]
        self.state = state


def test_parts_are_listed_checked_and_copied_whole(tmp_path):
    """A checkpoint whose marker lists per-rank optimizer parts: a lost part is refused; a 1-rank
    loader starts that optimizer fresh (the documented policy); the rollback's copy keeps every part."""
    actor = tiny_actor(0)
    info = ckpt.save_checkpoint(tmp_path, 1, actor=actor, optimizers={})
    torch.save(_Part(2.0).state_dict(), info.path / "optim_actor.rank001-of-002.pt")
    torch.save(_Part(1.0).state_dict(), info.path / "optim_actor.rank000-of-002.pt")
    marker = json.loads((info.path / ckpt.MARKER).read_text())
    marker["optimizers"], marker["optimizer_parts"], marker["world_size"] = ["actor"], {"actor": 2}, 2
    marker["files"]["optim_actor.rank000-of-002.pt"] = ckpt.sha256_file(info.path / "optim_actor.rank000-of-002.pt")
    (info.path / ckpt.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ckpt.CheckpointError, match=r"incomplete: its marker lacks optim_actor\.rank001-of-002\.pt"):
        ckpt.load_optimizers(info.path, {"actor": _Part(0.0)})
    marker["files"]["optim_actor.rank001-of-002.pt"] = ckpt.sha256_file(info.path / "optim_actor.rank001-of-002.pt")
    (info.path / ckpt.MARKER).write_text(json.dumps(marker))

    whole = make_optimizer(actor, lr=1e-3, weight_decay=0.0)  # one rank, whole state: cannot take a part
    assert ckpt.load_optimizers(info.path, {"actor": whole}) == ["actor"] and not whole.state_dict()["state"]

    copy = ckpt.copy_checkpoint(tmp_path, info.path, 4)
    copied = ckpt.verify_checkpoint(copy.path)
    assert copy.step == copied["step"] == 4 and copy.fingerprint == info.fingerprint
    assert copied["optimizer_parts"] == {"actor": 2} and copied["world_size"] == 2
    for rank, value in ((0, 1.0), (1, 2.0)):
        part = torch.load(copy.path / f"optim_actor.rank{rank:03d}-of-002.pt", weights_only=True)
        assert torch.equal(part["state"][0]["exp_avg"], torch.full((3,), value))
