"""`ringmoe` end to end at small sizes: exit code 0 means every exactness check passed."""

import logging

import pytest

from ringmoe.cli import main


def test_demo_runs_four_ranks_and_passes(capsys):
    assert main(["check", "--preset", "tiny", "--seqlen", "256", "--new-tokens", "3"]) == 0
    printed = capsys.readouterr().out
    assert "4 ranks (cp=2 x ep=2, zigzag)" in printed
    assert "tokens equal" in printed and "PASS" in printed
    assert "dropped tokens: 0" in printed


def test_demo_loads_a_checkpoint_with_capacity_and_reports_drops(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=24, initializer_range=0.3)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path)
    assert main(["check", "--checkpoint", str(tmp_path), "--cp", "1", "--ep", "2", "--seqlen", "60",
                 "--new-tokens", "2", "--capacity-factor", "0.5"]) == 0
    printed = capsys.readouterr().out
    dropped = int(printed.split("dropped tokens: ")[1].split()[0])
    assert dropped > 0  # capacity 0.5 must drop, and the single process drops the same tokens


def test_demo_rejects_bad_options_before_starting_ranks(capsys):
    assert main(["check", "--seqlen", "255"]) == 2
    assert "seqlen 255 must be divisible" in capsys.readouterr().err


def test_attention_showcase_passes(capsys):
    assert main(["attention", "--seqlen", "300"]) == 0
    assert "exactness check: PASS" in capsys.readouterr().out


def test_help_documents_every_demo_option(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = capsys.readouterr().out
    for option in ("--checkpoint", "--cp", "--ep", "--seqlen", "--layout", "--launcher", "--preset"):
        assert option in text


def test_simulate_prints_the_table_and_draws(tmp_path, capsys):
    png = tmp_path / "sim.png"
    assert main(["simulate", "--preset", "qwen3-30b-a3b", "--cp", "8", "--ep", "8", "--seqlen", "1048576",
                 "--hw", "h100", "--png", str(png)]) == 0
    printed = capsys.readouterr().out
    for row in ("prefill (all layers)", "K/V bytes per ring step", "tokens per rank for full overlap",
                "dispatch / combine bytes per rank", "straggler", "memory per rank",
                "sequence parallelism over cp = 8: ulysses"):
        assert row in printed
    assert png.stat().st_size > 10_000


@pytest.mark.slow  # `make test-all`
def test_simulate_with_a_calibrated_profile_of_this_machine(tmp_path, capsys):
    profile = tmp_path / "hw.json"
    assert main(["simulate", "--calibrate", str(profile)]) == 0
    assert main(["simulate", "--preset", "small", "--cp", "2", "--ep", "2", "--seqlen", "4096",
                 "--hw", str(profile)]) == 0
    assert "this-machine" in capsys.readouterr().out
    assert main(["simulate", "--hw", "tpu-v9"]) == 2


@pytest.mark.slow  # `make test-all`
def test_serving_demo_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """`make demo`: the model trained into the cache (a short run here), 4-rank server, openai client, exactness,
    clean stop."""
    pytest.importorskip("openai")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["demo", "--train-steps", "20"]) == 0
    printed = capsys.readouterr().out
    assert "cp=2 x ep=2, 4 ranks" in printed
    assert "16/16 answered, 0 errors" in printed
    assert "equal one process for 4 of 4 prompts: PASS" in printed
    assert "exit code 0, processes left: 0" in printed
    assert (tmp_path / "ringmoe" / "demo-trained-20-steps" / ".complete").is_file()
    assert "validation loss" in printed
