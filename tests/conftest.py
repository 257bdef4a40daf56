"""Shared fixtures: tiny Hugging Face checkpoints made by transformers inside the test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import _bootstrap  # noqa: E402  (a plain checkout, e.g. on the GPU machine, has no installed package)

_bootstrap.ensure_package()

from tinyhf import make_hf  # noqa: E402

# The tests run tiny models: one intra-op thread avoids OpenMP spin contention on small matmuls.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_qwen35(tmp_path_factory):
    """(folder, model) of a tiny untied Qwen3_5ForCausalLM."""
    folder = tmp_path_factory.mktemp("hf_qwen35")
    return folder, make_hf("qwen3_5", folder)


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, hf_qwen35):
    """A fp32 v3 artifact of ``hf_qwen35``."""
    from ninfer_bench.engine.artifact.convert import convert

    out = tmp_path_factory.mktemp("art") / "tiny.ninfer"
    convert(hf_qwen35[0], out, policy="fp32")
    return out
