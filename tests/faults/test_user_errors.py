"""A user's mistake ends in one line naming the flag or file (exit 2, no traceback), before any rank starts."""

from __future__ import annotations

import json
import logging
import shutil
import time

import pytest
import torch

from ringmoe.cli import main
from tests.helpers import save_tiny_mixtral

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


def _error_line(capsys, argv) -> str:
    """Run the CLI, expect exit 2 and a single error line on stderr; return it."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def _argparse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Mixtral written by transformers (2 layers, 4 experts)."""
    return save_tiny_mixtral(tmp_path_factory.mktemp("mixtral"))


def _copy(checkpoint, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoint, target)
    return target


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_capacity_factor_must_be_positive_and_finite(capsys, value):
    assert "--capacity-factor" in _argparse_error(capsys, ["check", f"--capacity-factor={value}"])


def test_pickled_only_checkpoint_is_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    err = _error_line(capsys, ["check", "--checkpoint", str(tmp_path)])
    assert "pickled weights" in err or "lacks the field" in err


def test_pickled_only_checkpoint_with_a_full_config(capsys, checkpoint, tmp_path):
    ckpt = _copy(checkpoint, tmp_path)
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    assert "only pickled weights (.bin/.pt)" in _error_line(capsys, ["check", "--checkpoint", str(ckpt)])


@pytest.mark.parametrize("damage", ["random", "truncated-header"])
def test_corrupt_safetensors_are_named(capsys, checkpoint, tmp_path, damage):
    ckpt = _copy(checkpoint, tmp_path)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes() if damage == "random"
                        else data[:100])
    err = _error_line(capsys, ["check", "--checkpoint", str(ckpt)])
    assert str(weights) in err and "not a valid safetensors file" in err


def test_a_shape_mismatch_names_the_tensor(capsys, checkpoint, tmp_path):
    ckpt = _copy(checkpoint, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 48  # the experts on disk are 40 wide
    (ckpt / "config.json").write_text(json.dumps(config))
    err = _error_line(capsys, ["check", "--checkpoint", str(ckpt)])
    assert "checkpoint tensor 'model.layers." in err and "(40, 32)" in err and "(48, 32)" in err


def test_an_index_pointing_at_a_missing_shard_names_it(capsys, checkpoint, tmp_path):
    ckpt = _copy(checkpoint, tmp_path)
    from safetensors import safe_open

    with safe_open(ckpt / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    weight_map = {name: ("model-00001-of-00002.safetensors" if i % 2 else "model.safetensors")
                  for i, name in enumerate(names)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    err = _error_line(capsys, ["check", "--checkpoint", str(ckpt)])
    assert "'model-00001-of-00002.safetensors', which is missing" in err


def test_bad_json_names_the_file(capsys, checkpoint, tmp_path):
    ckpt = _copy(checkpoint, tmp_path)
    (ckpt / "config.json").write_text("{not json")
    err = _error_line(capsys, ["check", "--checkpoint", str(ckpt)])
    assert str(ckpt / "config.json") in err and "not valid JSON" in err


def test_debug_shows_the_traceback(checkpoint, tmp_path):
    ckpt = _copy(checkpoint, tmp_path)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        main(["check", "--checkpoint", str(ckpt), "--debug"])


def test_torchrun_launcher_outside_torchrun(capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    err = _error_line(capsys, ["check", "--preset", "tiny", "--seqlen", "64", "--launcher", "torchrun"])
    assert "--launcher torchrun needs torchrun's environment" in err


@pytest.mark.parametrize("argv", [
    ["check", "--preset", "mixtral-8x7b"],
    ["check", "--preset", "qwen3-30b-a3b"],
    ["check", "--seqlen", "100000000"],
    ["check", "--batch", "1000000"],
    ["check", "--new-tokens", "100000000"],
    ["attention", "--seqlen", "1000000"],
])
def test_jobs_that_cannot_fit_are_refused_with_the_estimate(capsys, argv):
    start = time.monotonic()
    err = _error_line(capsys, argv)
    assert "needs about" in err and "GiB" in err and "is available" in err
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("argv, flag", [(["--chunks", "100000"], "chunks"), (["--cp", "4096"], "cp")])
def test_simulator_inputs_are_bounded(capsys, argv, flag):
    start = time.monotonic()
    err = _error_line(capsys, ["simulate", *argv])
    assert "events per layer" in err and flag in err
    assert time.monotonic() - start < 5


def test_simulate_hw_that_is_not_a_profile(capsys, tmp_path):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"name": "x", "flops": 1}))
    err = _error_line(capsys, ["simulate", "--hw", str(wrong)])
    assert str(wrong) in err and "not a hardware profile" in err and "matmul_flops" in err
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2")
    err = _error_line(capsys, ["simulate", "--hw", str(broken)])
    assert str(broken) in err and "not valid JSON" in err


@pytest.mark.parametrize("flag", ["--png", "--calibrate"])
def test_output_into_a_missing_folder_fails_before_any_work(capsys, tmp_path, flag):
    target = tmp_path / "missing" / "out.file"
    start = time.monotonic()
    err = _error_line(capsys, ["simulate", flag, str(target)])
    assert f"{flag} {target}" in err and "does not exist" in err
    assert time.monotonic() - start < 5  # calibration measures for a minute: it must not have started
