"""Run by tests/test_diffusion_models.py under torchrun with 2 CPU ranks (ZeRO-3 needs a
process group): a diffusers denoiser loads partitioned under ZeRO-3 (`load_denoiser` with a
stage-3 config), its gathered weights are the folder's and its forward equals the plain one;
the frozen parts loaded while the run's ZeRO-3 construction config is alive stay whole."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from align_anything.backend import zero_init
from align_anything.backend.distributed import setup_distributed, teardown_distributed
from align_anything.families import diffusion

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def main() -> None:
    import deepspeed

    dist = setup_distributed()
    info = diffusion.inspect_pipeline("tiny-random-sd")
    with zero_init.model_init_context(DS_CONFIG):  # the run's ZeRO-3 config, alive from here on
        denoiser = diffusion.load_denoiser(info, dtype=torch.float32, ds_config=DS_CONFIG)
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    # Frozen parts: whole (no ZeRO-3 attributes), usable without any collective.
    frozen = [p for m in (parts.vae, *parts.text_encoders.values()) for p in m.parameters()]
    assert not any(hasattr(p, "ds_id") for p in frozen), "a frozen part was partitioned"
    # The denoiser: partitioned, each rank holding about half of every large parameter.
    params = list(denoiser.parameters())
    assert all(hasattr(p, "ds_id") for p in params)
    largest = max(params, key=lambda p: p.ds_numel)
    assert largest.ds_tensor.numel() == (largest.ds_numel + 1) // 2, largest.ds_tensor.numel()
    plain = diffusion.load_denoiser(info, dtype=torch.float32)  # whole, diffusers' loader
    expected = load_file(str(info.path / "unet" / "diffusion_pytorch_model.safetensors"))
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    embeds = torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([10, 600])
    with deepspeed.zero.GatheredParameters(params):
        for name, param in denoiser.named_parameters():
            torch.testing.assert_close(param.data, expected[name], rtol=0, atol=0)
        with torch.no_grad():
            ours = denoiser(latents, timesteps, encoder_hidden_states=embeds).sample
    with torch.no_grad():
        reference = plain(latents, timesteps, encoder_hidden_states=embeds).sample
    torch.testing.assert_close(ours, reference)
    print(f"rank {dist.rank}: zero3 check passed", flush=True)
    teardown_distributed()


if __name__ == "__main__":
    main()
