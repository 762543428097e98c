"""DeepSpeed checkpoints across ZeRO stages and world sizes, and reading their files.

`convert_to_universal` turns a ZeRO-1/2/3 checkpoint into DeepSpeed's universal checkpoint (with
workarounds for three DeepSpeed 0.19.8 problems, each explained where it is fixed), and
`unshare_step_counts` mends a fourth, in what DeepSpeed's ZeRO-3 universal load leaves behind;
`checkpoint_state_dict` merges any checkpoint into full fp32 weights; `load_deepspeed_file`
reads one of DeepSpeed's files without unpickling arbitrary objects.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

import torch

from align_anything import atomic
from align_anything.backend.distributed import broadcast_object, dist_info
from align_anything.errors import ConfigError

UNIVERSAL_TAG = "universal"
# The DeepSpeed folder of the policy in a checkpoint; an engine trained beside it (PPO's critic)
# has `deepspeed-<name>`, converted into `universal-<name>`.
POLICY_TAG = "deepspeed"


def universal_tag(tag: str) -> str:
    """The folder a checkpoint's DeepSpeed folder `tag` is converted into: `universal` for the
    policy's `deepspeed`, `universal-<name>` for `deepspeed-<name>`."""
    return UNIVERSAL_TAG + tag.removeprefix(POLICY_TAG)


def engine_tags(checkpoint_dir: Path) -> list[str]:
    """The DeepSpeed folders of every trained engine in a checkpoint (`deepspeed`, and
    `deepspeed-<name>` for each engine trained beside the policy)."""
    return sorted(
        p.name for p in Path(checkpoint_dir).iterdir()
        if p.is_dir() and (p.name == POLICY_TAG or p.name.startswith(POLICY_TAG + "-"))
    )  # fmt: skip


def load_deepspeed_file(path: Path) -> Any:
    """A DeepSpeed checkpoint file read without unpickling arbitrary objects: torch's
    `weights_only` loader, allowing only the three DeepSpeed classes its files hold besides
    tensors and containers (a loss-scaler record, the ZeRO stage enum, fragment addresses).
    DeepSpeed's own loaders (`load_checkpoint`, `ds_to_universal`, `zero_to_fp32`) still
    unpickle fully; see docs/running.md on checkpoints from elsewhere."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location="cpu", weights_only=True)


def convert_to_universal(checkpoint_dir: Path, tag: str = POLICY_TAG) -> Path:
    """Convert `…/step-N/<tag>` (ZeRO-1/2/3, any world size; `deepspeed` is the policy's,
    `deepspeed-<name>` an engine trained beside it) into DeepSpeed's universal checkpoint
    `…/step-N/<universal_tag(tag)>`, which loads under another ZeRO stage (1-3) or world size.

    Rank 0 converts with DeepSpeed's `ds_to_universal` into a temporary folder renamed when
    complete (a finished conversion is reused); every rank then waits at a barrier. Collective:
    call on every rank.
    """
    import argparse
    import io
    import shutil

    from deepspeed.checkpoint import ds_to_universal

    checkpoint_dir = Path(checkpoint_dir)
    target = universal_tag(tag)
    final = checkpoint_dir / target
    error: str | None = None
    if dist_info().is_main and not final.is_dir():
        tmp = checkpoint_dir / f".tmp-{target}"
        shutil.rmtree(tmp, ignore_errors=True)
        fixed_input = checkpoint_dir / f".tmp-{target}-input"
        shutil.rmtree(fixed_input, ignore_errors=True)
        source = checkpoint_dir / tag
        if _write_fixed_slice_mappings(source, fixed_input):
            source = fixed_input
        args = argparse.Namespace(
            input_folder=str(source), output_folder=str(tmp),
            # In-process and serial: no worker pool forked from a rank that holds a process group.
            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
            # transformers models carry no universal-checkpoint metadata; plain data-parallel
            # ZeRO needs none beyond the version DeepSpeed injects.
            inject_missing_state=True,
        )  # fmt: skip
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                ds_to_universal.main(args)
            _link_model_states_for_every_stage(tmp)
            _add_stage3_optimizer_globals(tmp)
            atomic.publish(tmp, final)
            shutil.rmtree(fixed_input, ignore_errors=True)
            # ds_to_universal points `latest_universal` at its output folder (the temporary
            # name); loads name their folder, so this only keeps DeepSpeed's own tools pointed
            # at the policy's.
            (checkpoint_dir / "latest_universal").write_text(UNIVERSAL_TAG)
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(fixed_input, ignore_errors=True)
            error = (
                f"DeepSpeed's ds_to_universal failed on {checkpoint_dir / tag}: "
                f"{type(err).__name__}: {err}\n{log.getvalue()[-2000:]}"
            )
    error = broadcast_object(error)
    if error:
        raise ConfigError(error)
    return final


def _write_fixed_slice_mappings(source: Path, dest: Path) -> bool:
    """Work around a DeepSpeed 0.19 ZeRO-1/2 bug that `ds_to_universal` would copy into the
    universal checkpoint: with `round_robin_gradients` (our z2 preset) and no alignment padding,
    `_link_all_hp_params` (runtime/zero/stage_1_and_2.py) maps each parameter to its offset in
    the *unshuffled* order, but the flat fp32/Adam buffers are in the round-robin order, so the
    saved `param_slice_mappings` point at other parameters' data. The checkpoint's own
    `param_shapes` (which `zero_to_fp32` uses, correctly) and `param_alignment_paddings` give
    the true layout; when the saved mappings disagree with it, write optimizer-state files with
    the true mappings into `dest` (model-state files hard-linked) and return True.
    """
    from deepspeed.utils.tensor_fragment import fragment_address

    model_files = sorted(source.glob("mp_rank_*_model_states.pt"))
    optim_files = sorted(source.glob("*zero_pp_rank_*_optim_states.pt"))
    if len(model_files) != 1 or not optim_files:
        return False  # ZeRO-3 (no such mappings) or a layout this does not know
    param_shapes = load_deepspeed_file(model_files[0])["param_shapes"]
    fixed: dict[Path, dict[str, Any]] = {}
    for path in optim_files:
        state = load_deepspeed_file(path)
        optim = state["optimizer_state_dict"]
        if "param_slice_mappings" not in optim or int(optim.get("zero_stage", 1)) > 2:
            return False
        rank = int(path.name.split("zero_pp_rank_")[1].split("_")[0])
        mappings = []
        for group, shapes in enumerate(param_shapes):
            size = optim["single_partition_of_fp32_groups"][group].numel()
            lo_part, hi_part = rank * size, (rank + 1) * size
            paddings = optim["param_alignment_paddings"][group]
            mapping, offset = {}, 0
            for (name, shape), padding in zip(shapes.items(), paddings, strict=True):
                numel = math.prod(shape)
                lo, hi = max(offset, lo_part), min(offset + numel, hi_part)
                if lo < hi:
                    mapping[name] = fragment_address(numel=hi - lo, start=lo - lo_part)
                offset += numel + padding
            mappings.append(mapping)
        saved = [
            {k: (v.start, v.numel) for k, v in g.items()} for g in optim["param_slice_mappings"]
        ]
        if saved != [{k: (v.start, v.numel) for k, v in g.items()} for g in mappings]:
            optim["param_slice_mappings"] = mappings
            fixed[path] = state
    if not fixed:
        return False
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if path in fixed:
            torch.save(fixed[path], dest / path.name)
        elif path.is_file():
            try:
                os.link(path, dest / path.name)
            except OSError:
                import shutil

                shutil.copy2(path, dest / path.name)
    return True


def _link_model_states_for_every_stage(folder: Path) -> None:
    """DeepSpeed's universal load looks for `mp_rank_XX_model_states.pt` under ZeRO-1/2 and
    `zero_pp_rank_0_mp_rank_XX_model_states.pt` under ZeRO-3, but `ds_to_universal` keeps the
    source's names; give the folder both (hard links: the files hold the same scheduler and step
    counters; the weights and optimizer state load from `zero/`)."""
    for path in list(folder.glob("*model_states.pt")):
        name = path.name
        if name.startswith("zero_pp_rank_0_mp_rank_"):
            other = folder / name.removeprefix("zero_pp_rank_0_")
        elif name.startswith("mp_rank_"):
            other = folder / f"zero_pp_rank_0_{name}"
        else:
            continue
        if not other.exists():
            try:
                os.link(path, other)
            except OSError:
                import shutil

                shutil.copy2(path, other)


def _add_stage3_optimizer_globals(folder: Path) -> None:
    """Let a universal checkpoint converted from ZeRO-1/2 load under ZeRO-3.

    `ds_to_universal` writes `zero/optimizer_state.pt` in its source's layout: from ZeRO-1/2
    with `param_groups` at the top level, from ZeRO-3 also nested under `optimizer_state_dict`
    with the Adam step count. DeepSpeed 0.19's ZeRO-3 universal load reads only the nested
    form (`stage3.py`, `load_hp_checkpoint_state_from_checkpoint_dir_stage3`: KeyError
    'optimizer_state_dict' otherwise). Add it from what the file and the per-parameter
    `step.pt` (the same count for every parameter) already hold; nothing else changes.
    """
    path = folder / "zero" / "optimizer_state.pt"
    state = load_deepspeed_file(path)
    if "optimizer_state_dict" in state:
        return
    steps = sorted((folder / "zero").glob("*/step.pt"))
    if not steps:
        return  # no optimizer step was taken: nothing to carry
    step = load_deepspeed_file(steps[0])
    state["optimizer_state_dict"] = {
        "state": {0: {"step": step}},
        "param_groups": state["param_groups"],
    }
    torch.save(state, path)


def unshare_step_counts(optimizer: Any) -> int:
    """Give every parameter group of `optimizer` (DeepSpeed's ZeRO optimizer, or the torch
    optimizer it wraps) its own Adam step count after a universal load; returns how many were
    shared. Call after every ZeRO-3 universal load.

    DeepSpeed 0.19.8's ZeRO-3 universal load (`stage3.py`,
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`) stores ONE `step` tensor object in
    the state of every sub-group's fp32 partition. torch's Adam/AdamW (foreach and fused)
    increment step tensors in place, once per parameter group, so with two groups (weights with
    decay, and the norms and biases without) the shared count advances twice per optimizer
    step: the first group's bias correction sees steps 3, 5, 7, ... and the second's 4, 6, 8,
    ... instead of 3, 4, 5. Measured on PPO's tiny run (ZeRO-2 -> ZeRO-3 and 2 -> 1 ranks from
    step 2): the norms' weights already off by 9e-5 after step 3 (lr 1e-3), both engines'
    losses 2% off by step 5, and the resumed run's checkpoints recording step 10 at step 6.
    (ZeRO-1/2's universal load reads each group's count from its own `step.pt`: not shared.)
    """
    state = getattr(optimizer, "optimizer", optimizer).state
    seen: set[int] = set()
    shared = 0
    for param_state in state.values():
        step = param_state.get("step")
        if not isinstance(step, torch.Tensor):
            continue
        if id(step) in seen:
            param_state["step"] = step.clone()
            shared += 1
        seen.add(id(step))
    return shared


def checkpoint_state_dict(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights from an align_anything checkpoint folder (`…/step-N`), whatever the
    ZeRO stage and world size it was written with. ZeRO-2/3 partitions are merged by DeepSpeed's
    own `zero_to_fp32`; stage 0 keeps whole weights in the model-states file."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ds_dir = Path(checkpoint_dir)
    tag_dir = ds_dir / "deepspeed"
    if not tag_dir.is_dir():
        raise ConfigError(
            f"{checkpoint_dir}: no deepspeed/ folder; not an align_anything checkpoint"
        )
    if any(tag_dir.glob("*optim_states.pt")):
        state = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag="deepspeed")
        return {k: v.contiguous() for k, v in state.items()}
    model_states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not model_states:
        raise ConfigError(f"{tag_dir}: no model states file")
    module = load_deepspeed_file(model_states[0])["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
