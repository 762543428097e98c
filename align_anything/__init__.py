"""align_anything: SFT, DPO-family and reward-model training on DeepSpeed ZeRO."""

__version__ = "0.1.0"
