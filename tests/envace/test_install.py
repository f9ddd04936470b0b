"""What a CPU machine installs: the CPU build of torch, no vLLM, no CUDA wheels; envace's plugin is wired."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_torch_is_the_pinned_cpu_build():
    assert torch.__version__.split("+")[0] == "2.13.0"
    assert torch.version.cuda is None


def test_no_vllm_and_no_cuda_wheels_installed():
    assert importlib.util.find_spec("vllm") is None
    names = {d.metadata["Name"].lower() for d in md.distributions()}
    cuda = sorted(n for n in names if re.match(r"nvidia-(cu|nccl|cufft|curand|cusparse|cusolver|nvjitlink|nvtx)", n))
    assert not cuda, cuda


def test_lock_file_pins_cpu_torch_and_excludes_gpu_packages():
    lock = (REPO / "requirements" / "cpu.lock").read_text().splitlines()
    pins = dict(line.split("==", 1) for line in lock if "==" in line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0" and pins["verl"] == "0.9.1"
    assert "vllm" not in pins
    assert not [n for n in pins if re.match(r"nvidia-(cu|nccl)", n)]


def test_envace_is_a_verl_plugin_entry_point():
    eps = [ep for ep in md.entry_points(group="verl.plugins") if ep.name == "envace"]
    assert [ep.value for ep in eps] == ["envace.verl_plugin"]
