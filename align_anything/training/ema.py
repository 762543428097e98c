"""An exponential moving average (EMA) of the trained weights, under every ZeRO stage.

After every optimizer step: ema ← decay·ema + (1 − decay)·θ, for every trainable parameter.
Rank 0 holds the average in fp32 (on CPU by default, or on its device); under ZeRO-3 each
parameter is gathered once per update, in groups of parameters to keep the number of
collectives small, while stages 0-2 read the local whole copy without communication. The
average is saved in every checkpoint (`ema.safetensors`) and exported as its own Hugging Face
folder (`output_dir/final-ema`).

Written here rather than taken from a library: torch's `AveragedModel` and timm's `ModelEmaV3`
keep a whole second module and know nothing of ZeRO-3 partitions.
"""

from __future__ import annotations

from pathlib import Path

import torch

from align_anything.backend.engine import Engine, gathered
from align_anything.backend.params import full_numel
from align_anything.errors import ConfigError

EMA_FILE = "ema.safetensors"
# Elements gathered per collective under ZeRO-3 (fp32: 64 MiB).
GATHER_GROUP_ELEMENTS = 2**24


class WeightEMA:
    """The moving average of `engine.module`'s trainable parameters (see module docstring)."""

    def __init__(self, engine: Engine, *, decay: float, on_device: bool, is_main: bool):
        self.engine = engine
        self.decay = decay
        self.is_main = is_main
        self.device = engine.device if on_device else torch.device("cpu")
        self.params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        self.average: dict[str, torch.Tensor] = {}
        self._visit(lambda name, value: self.average.__setitem__(name, value.clone()))

    def _groups(self) -> list[list[tuple[str, torch.nn.Parameter]]]:
        groups: list[list[tuple[str, torch.nn.Parameter]]] = [[]]
        size = 0
        for name, param in self.params:
            numel = full_numel(param)
            if groups[-1] and size + numel > GATHER_GROUP_ELEMENTS:
                groups.append([])
                size = 0
            groups[-1].append((name, param))
            size += numel
        return groups

    def _visit(self, fn) -> None:
        """Call fn(name, whole fp32 value on the EMA device) on rank 0 for every parameter;
        every rank takes part in the ZeRO-3 gathers."""
        stage = self.engine.zero_stage
        if stage != 3 and not self.is_main:
            return
        for group in self._groups():
            with gathered([p for _, p in group], stage):
                if self.is_main:
                    for name, param in group:
                        fn(name, param.detach().to(self.device, torch.float32))

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step from the current weights (call after every optimizer step)."""
        keep = self.decay

        def blend(name: str, value: torch.Tensor) -> None:
            self.average[name].mul_(keep).add_(value, alpha=1.0 - keep)

        self._visit(blend)

    def state_dict(self, reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full state dict (rank 0's `reference`, e.g. the gathered model) with the trained
        parameters replaced by their averages, in the reference's dtypes."""
        state = dict(reference)
        for name, value in self.average.items():
            if name in state:
                state[name] = value.to("cpu", state[name].dtype)
        return state

    def save(self, directory: Path) -> None:
        """Rank 0 writes the average beside a checkpoint."""
        from safetensors.torch import save_file

        if self.is_main:
            save_file(
                {k: v.cpu().contiguous() for k, v in self.average.items()}, directory / EMA_FILE
            )

    def describe(self, restored: bool | None) -> str:
        """The start-up summary's line; `restored`: None for a fresh run, else whether the
        resumed checkpoint held an average."""
        where = "on the device" if self.device.type != "cpu" else "in host memory"
        note = {None: "", True: ", restored from the checkpoint"}.get(
            restored, ", started from the checkpoint's weights (it holds no average)"
        )
        return (
            f"decay {self.decay} over {len(self.params)} trained tensors, fp32 {where} of rank "
            f"0{note}; exported to final-ema"
        )

    def load(self, directory: Path) -> bool:
        """Restore the average from a checkpoint (rank 0); False when it holds none."""
        from safetensors.torch import load_file

        path = directory / EMA_FILE
        if not self.is_main:
            return True
        if not path.exists():
            return False
        saved = load_file(path)
        missing = sorted(set(self.average) - set(saved))
        if missing:
            raise ConfigError(
                f"{path} lacks {len(missing)} trained parameters of this run (e.g. "
                f"{missing[:3]}): it was written for another model or LoRA setting"
            )
        self.average = {k: saved[k].to(self.device, torch.float32) for k in self.average}
        return True
