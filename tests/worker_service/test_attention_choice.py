"""The attention backend a worker runs (worker_service/attention/attention_choice.py),
every case pinned on the CPU: FlashInfer on CUDA where its kernels fit the model,
the torch backend with the reason otherwise, a refusal that says what to do where
an explicit choice cannot work."""

from __future__ import annotations

import pytest
import torch

from worker_service.attention.attention_choice import (
    AttentionChoice,
    AttentionRefused,
    choose_attention,
)

HALF = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_auto_on_cuda_is_flashinfer_where_its_kernels_fit(dtype, head_dim) -> None:
    choice = choose_attention("auto", device_type="cuda", dtype=dtype, head_dim=head_dim)
    assert choice == AttentionChoice("flashinfer")


def test_auto_on_cuda_in_fp32_is_torch_and_says_why() -> None:
    choice = choose_attention("auto", device_type="cuda", dtype=torch.float32, head_dim=128)
    assert choice.name == "torch"
    assert "no float32 attention kernels" in choice.reason


@pytest.mark.parametrize("head_dim", [80, 96, 32, 512])
@pytest.mark.parametrize("dtype", HALF)
def test_auto_on_cuda_with_an_unfit_head_dim_is_torch_and_says_why(head_dim, dtype) -> None:
    choice = choose_attention("auto", device_type="cuda", dtype=dtype, head_dim=head_dim)
    assert choice.name == "torch"
    assert f"head dim {head_dim}" in choice.reason and "64, 128, 256" in choice.reason


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_cpu_runs_torch_and_refuses_flashinfer(dtype) -> None:
    auto = choose_attention("auto", device_type="cpu", dtype=dtype, head_dim=64)
    assert auto == AttentionChoice("torch")
    with pytest.raises(AttentionRefused, match="needs --device cuda"):
        choose_attention("flashinfer", device_type="cpu", dtype=dtype, head_dim=64)


def test_explicit_torch_is_always_torch() -> None:
    for dtype in (torch.float32, *HALF):
        choice = choose_attention("torch", device_type="cuda", dtype=dtype, head_dim=96)
        assert choice == AttentionChoice("torch")


def test_explicit_flashinfer_that_cannot_work_is_refused_with_what_to_do() -> None:
    with pytest.raises(AttentionRefused) as fp32:
        choose_attention("flashinfer", device_type="cuda", dtype=torch.float32, head_dim=128)
    assert "--dtype bfloat16 or float16" in str(fp32.value)
    assert "--attention-backend torch" in str(fp32.value)
    with pytest.raises(AttentionRefused) as hd96:
        choose_attention("flashinfer", device_type="cuda", dtype=torch.bfloat16, head_dim=96)
    assert "head dim 96" in str(hd96.value) and "--attention-backend torch" in str(hd96.value)
    ok = choose_attention("flashinfer", device_type="cuda", dtype=torch.float16, head_dim=256)
    assert ok == AttentionChoice("flashinfer")
    with pytest.raises(ValueError, match="triton"):
        choose_attention("triton", device_type="cuda", dtype=torch.float16, head_dim=256)


@pytest.mark.parametrize("dtype", HALF)
def test_a_sink_model_on_cuda_runs_torch_and_explicit_flashinfer_is_refused(dtype) -> None:
    """FlashInfer's FA2 kernels drop sinks (test_flashinfer_features.py shows it)."""
    choice = choose_attention("auto", device_type="cuda", dtype=dtype, head_dim=64, sinks=True)
    assert choice.name == "torch" and "sinks" in choice.reason
    with pytest.raises(AttentionRefused) as refused:
        choose_attention("flashinfer", device_type="cuda", dtype=dtype, head_dim=64, sinks=True)
    assert "sinks" in str(refused.value) and "--attention-backend torch" in str(refused.value)
    assert "--dtype" not in str(refused.value)
    assert choose_attention("torch", device_type="cuda", dtype=dtype, head_dim=64, sinks=True) == (
        AttentionChoice("torch")
    )
