"""Models: what a run trains, and the weight-level tools around it.

- `zoo`: built-in model names (the real SmolLM2-135M-Instruct from its GGUF package, tiny random
  text, image-text and audio-text models) materialised once into the cache.
- `loading`: config, tokenizer, processor, and the one choice of model class for a task
  (`model_class`, `load_model`, `empty_model`).
- `reward_head`: reward models of multimodal families (base model + score head).
- `value`: PPO's critic, a value per token from a reward model's backbone and score head.
- `parts`: model parts and freezing by part (`model.freeze`).
- `lora`: adapters (PEFT), saving them from gathered weights, merging them.
- `ema`: an exponential moving average of the trained weights, under every ZeRO stage.
- `tied_embeddings`: one gradient buffer for a tied input embedding / LM head.
- `sizes`: parameter counts and dimensions, for the memory planner (denoisers too).
- `diffusion/`: text-to-image diffusers pipelines (SD 1.x/2.x, SDXL, SD3, Flux): family and
  parts, the denoiser and the frozen VAE / text encoders, denoiser LoRA, sampling grids, and the
  tiny random pipelines of the tests.
"""
