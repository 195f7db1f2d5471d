"""Training state a user can hand the trainer: never unpickled, never half-written, never silently replaced.

A crafted pickle in a checkpoint runs no code (a marker file stays absent); a save killed at random points
(SIGKILL, 20 times, through every phase: tensors, JSON, manifest, renames, the pointer) always leaves a state
that ``resume`` continues from exactly, at the last complete step; a dangling ``latest`` is refused in one line
naming the newest complete step; the CLI refuses it with exit 2 before any rank starts."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ringmoe.model import MoETransformer
from ringmoe.parallel import make_mesh
from ringmoe.train import TrainConfig, Trainer
from ringmoe.train.checkpoint import CheckpointError, complete_steps, convert_legacy, latest, resume, save

from ..train.test_loop import CONFIG, _stream

SETTINGS = TrainConfig(rows=4, lr=1e-2, warmup=2, steps=40, clip=0.5)


def _trainer(seed=5):
    model = MoETransformer(CONFIG, make_mesh(1, 1)).double()
    model.init_weights(seed, std=0.2)
    return Trainer(model, SETTINGS, _stream())


def _state(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


class _Payload:
    """Unpickling this runs a shell command: what a hostile checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _legacy_state(trainer):
    """What ringmoe 0.1 pickled into out/step-N/rank0.pt."""
    return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(), "position": trainer.position, "step": trainer.step_count,
            "rng": torch.get_rng_state(), "mesh": (1, 1), "config": trainer.model.config}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch notes the payload's protocol: expected
def test_a_crafted_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    step = tmp_path / "out" / "step-000002"
    step.mkdir(parents=True)
    (step / "rank0.pt").write_bytes(pickle.dumps({"model": _Payload(marker)}))
    (tmp_path / "out" / "latest").write_text("step-000002\n")
    with pytest.raises(CheckpointError, match="convert-checkpoint"):
        resume(_trainer(), tmp_path / "out")
    with pytest.raises(CheckpointError, match="not converted"):
        convert_legacy(step)
    assert not marker.exists()
    assert sorted(p.name for p in step.parent.iterdir()) == ["latest", "step-000002"]  # nothing written
    assert [p.name for p in step.iterdir()] == ["rank0.pt"]  # a refused conversion leaves the folder as it was


def test_a_pickled_checkpoint_of_the_old_format_converts_and_resumes_exactly(tmp_path):
    trainer = _trainer()
    for _ in range(2):
        trainer.step()
    step = tmp_path / "step-000002"
    step.mkdir()
    torch.save(_legacy_state(trainer), step / "rank0.pt")
    (tmp_path / "latest").write_text("step-000002\n")
    with pytest.raises(CheckpointError, match="pickled"):
        latest(tmp_path)
    convert_legacy(step)
    assert not any(step.glob("*.pt"))
    fresh = _trainer(seed=9)
    assert resume(fresh, tmp_path) and fresh.step_count == 2
    assert [fresh.step()["loss"] for _ in range(2)] == [trainer.step()["loss"] for _ in range(2)]


def test_a_dangling_latest_is_refused_with_the_newest_complete_step(tmp_path):
    trainer = _trainer()
    trainer.step()
    save(trainer, tmp_path)
    (tmp_path / "latest").write_text("step-000007\n")
    with pytest.raises(CheckpointError, match="step-000007.*newest complete checkpoint is step-000001"):
        resume(_trainer(), tmp_path)
    (tmp_path / "step-000001" / "rank0.json").write_text("{}")  # damaged: sizes no longer match the manifest
    (tmp_path / "latest").write_text("step-000001\n")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resume(_trainer(), tmp_path)


def test_saving_the_same_step_again_replaces_it_only_once_the_new_copy_is_complete(tmp_path):
    trainer = _trainer()
    trainer.step()
    first = save(trainer, tmp_path)
    again = save(trainer, tmp_path)
    assert first == again and complete_steps(tmp_path) == [first]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]


class _Killed(BaseException):
    """Where the test stops a save, as a SIGKILL would (a BaseException: nothing in the save catches it)."""


@pytest.mark.parametrize("start", ["saved", "stopped between the renames of a re-save"])
def test_a_re_save_stopped_before_any_of_its_file_operations_leaves_a_complete_state(tmp_path, monkeypatch, start):
    """Every rename, replace and removal of a re-save of step N, in turn, is where it stops: ``latest`` still
    resolves to a complete copy of step N, from which ``resume`` continues exactly; also when the save starts
    from the state a stop between the two renames leaves (``step-N.old`` the only complete copy)."""
    trainer = _trainer()
    trainer.step()
    expected = _state(trainer)
    operations = {"rename": Path.rename, "replace": Path.replace, "rmtree": shutil.rmtree}
    stop_at, stopped = 0, True
    while stopped:
        stop_at += 1
        out = tmp_path / f"stop{stop_at}"
        save(trainer, out)
        if start != "saved":
            (out / "step-000001").rename(out / "step-000001.old")
        countdown = [stop_at]

        def counted(operation):
            def run(*args, **kwargs):
                countdown[0] -= 1
                if countdown[0] == 0:
                    raise _Killed
                return operations[operation](*args, **kwargs)
            return run

        for name in ("rename", "replace"):
            monkeypatch.setattr(Path, name, counted(name))
        monkeypatch.setattr(shutil, "rmtree", counted("rmtree"))
        try:
            save(trainer, out)
            stopped = False
        except _Killed:
            pass
        monkeypatch.undo()
        fresh = _trainer(seed=11)
        assert resume(fresh, out) and fresh.step_count == 1, (start, stop_at)
        assert all(torch.equal(fresh.model.state_dict()[k], expected[k]) for k in expected)
    assert stop_at >= 4  # the stops went through the staging removal, both renames and the pointer


def _save_forever(trainer, out, steps_per_life):
    """What `ringmoe train --resume --save-every 1` does, killed at any moment by the parent.

    Each life trains at most ``steps_per_life`` steps past the resumed one, so the kills land at many different
    steps whatever the machine's speed; then it saves the same step again and again (the replace-aside path)."""
    torch.set_num_threads(1)
    resume(trainer, out)
    last = min(SETTINGS.steps, trainer.step_count + steps_per_life)
    while trainer.step_count < last:
        trainer.step()
        save(trainer, out)
    while True:
        save(trainer, out)


def test_sigkill_at_random_points_of_saves_always_resumes_from_the_last_complete_step(tmp_path):
    torch.set_num_threads(1)
    reference, states = _trainer(), {}
    for _ in range(SETTINGS.steps):
        reference.step()
        states[reference.step_count] = _state(reference)
    rng = random.Random(1234)
    ctx = mp.get_context("fork")
    seen_steps, previous = set(), 0
    for attempt in range(20):
        child = ctx.Process(target=_save_forever, args=(_trainer(), tmp_path, 2), daemon=True)
        forker = threading.Thread(target=child.start)  # fork from a thread that never ran an OpenMP region
        forker.start()
        forker.join()
        time.sleep(rng.uniform(0.05, 0.8))
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=10)
        assert child.exitcode == -signal.SIGKILL
        folder = latest(tmp_path)  # never a CheckpointError: the pointer always names a complete state
        if folder is None:
            assert not complete_steps(tmp_path), "a complete checkpoint exists but latest does not name it"
            continue
        fresh = _trainer(seed=11)
        assert resume(fresh, tmp_path)
        step = fresh.step_count
        on_disk = [int(f.name.split("-")[1]) for f in complete_steps(tmp_path)]
        if folder.name.endswith(".old"):  # killed between the two renames of a re-save: the aside copy is the state
            on_disk.append(int(folder.name[len("step-"):-len(".old")]))
        newest = max(on_disk)
        assert newest - 1 <= step <= newest  # the last complete step (the one before: killed before the pointer)
        assert step >= previous  # never back to an older state
        assert all(torch.equal(fresh.model.state_dict()[k], states[step][k]) for k in states[step])
        seen_steps.add(step)
        previous = step
    assert len(seen_steps) >= 3, seen_steps  # the kills landed at different steps


def test_the_cli_refuses_a_dangling_latest_before_starting(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "latest").write_text("step-000300\n")
    proc = subprocess.run([sys.executable, "-m", "ringmoe.cli", "train", "--out", str(tmp_path / "out"), "--resume",
                           "--preset", "tiny", "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "step-000300" in lines[0] and "missing or incomplete" in lines[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["latest"]  # nothing written
