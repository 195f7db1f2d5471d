"""Packaging and honest tooling: a clean import, a declared licence and plotting dependency, fair timings."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_import_prints_nothing():
    done = subprocess.run([sys.executable, "-c", "import ringmoe, ringmoe.model, ringmoe.parallel, ringmoe.sim"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == ""


def test_pyproject_declares_licence_numpy_and_the_plot_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX string: no setuptools deprecation warning
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert any(d.startswith("numpy") for d in project["dependencies"])  # torch warns on import without it
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["plot"])


def test_attention_showcase_warms_up_sdpa_like_the_other_backends(monkeypatch):
    from ringmoe.apps.attention import attention_showcase

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    assert attention_showcase(64, 0)
    assert len(calls) == 2  # one warm-up, one timed
