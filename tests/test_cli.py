"""`ringmoe demo` end to end at a small size: exit code 0 means every exactness check passed."""

from ringmoe.cli import main


def test_demo_runs_and_passes(capsys):
    assert main(["demo", "--seqlen", "512"]) == 0
    printed = capsys.readouterr().out
    assert "exactness check: PASS" in printed and "parallel exactness check: PASS" in printed


def test_help_documents_the_demo(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "demo" in capsys.readouterr().out
