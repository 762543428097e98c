"""Config composition and validation (DESIGN §1-2, STYLE 2).

Every shipped task config composes and validates; mistakes are reported together in one
ConfigError with full key paths and hints; presets are loaded by name or path with a
duplicate-key check, and dotted overrides reach inside them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from align_anything.config import (
    PRESET_DIR,
    TASK_DIR,
    TASK_SECTIONS,
    available_presets,
    load_config,
    load_preset,
)
from align_anything.errors import ConfigError

TASK_FILES = sorted(TASK_DIR.glob("*.yaml"))
PRESET_FILES = sorted(PRESET_DIR.glob("ds_*_config.json"))
PRESET_NAMES = ["z0", "z2", "z3", "z3_offload"]


def config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    return str(info.value)


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf of a nested mapping."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(leaves(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: node}


# --------------------------------------------------------------------------- shipped task configs


def test_task_files_found() -> None:
    assert {path.stem for path in TASK_FILES} == {
        "sft", "dpo", "rm", "kto", "grpo", "rloo", "ppo", "diffusion_sft", "diffusion_dpo",
        "flow_grpo", "dance_grpo", "diffusion_nft",
    }  # fmt: skip


@pytest.mark.parametrize("task_file", TASK_FILES, ids=lambda p: p.stem)
def test_task_config_composes_and_validates(task_file: Path) -> None:
    task = task_file.stem
    cfg = load_config([f"task={task}"])
    assert cfg.task == task
    assert type(cfg.section()) is TASK_SECTIONS[task]
    for other in TASK_SECTIONS:
        if other != task:
            assert getattr(cfg, other) is None, f"task={task} must not carry a {other} section"
    # Every value the task file sets reaches the validated config unchanged.
    resolved = leaves(cfg.to_dict())
    expected = leaves(yaml.safe_load(task_file.read_text()))
    assert expected, f"{task_file} sets nothing"
    for key, value in expected.items():
        assert key in resolved, f"{task_file.name}: {key} is missing from the config"
        assert resolved[key] == value, f"{task_file.name}: {key}"
    # The default preset is z0, loaded from the shipped file.
    assert cfg.deepspeed_source == str(PRESET_DIR / "ds_z0_config.json")
    assert cfg.explicit_keys == frozenset()


@pytest.mark.parametrize("preset_file", PRESET_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("task_file", TASK_FILES, ids=lambda p: p.stem)
def test_every_task_with_every_preset(task_file: Path, preset_file: Path) -> None:
    name = preset_file.name.removeprefix("ds_").removesuffix("_config.json")
    cfg = load_config([f"task={task_file.stem}", f"deepspeed={name}"])
    assert cfg.deepspeed == json.loads(preset_file.read_text())
    assert cfg.deepspeed_source == str(preset_file)


def test_shipped_presets_are_listed() -> None:
    assert available_presets() == PRESET_NAMES


# --------------------------------------------------------------------------- errors, all at once


def test_several_mistakes_in_one_error() -> None:
    message = config_error(
        [
            "train.learnig_rate=1e-4",
            "data.max_length=abc",
            "deepspeed=z3_ofload",
            "dpo.beta=0.2",
        ]
    )
    assert message.startswith("4 problems in the configuration:"), message
    assert "train.learnig_rate: unknown key (did you mean 'train.learning_rate'?)" in message
    assert "data.max_length:" in message and "(given: 'abc')" in message
    assert "deepspeed='z3_ofload': unknown preset (did you mean 'z3_offload'?)" in message
    assert "z0, z2, z3, z3_offload" in message
    # A dpo.* key while task=sft.
    assert "section 'dpo' is set but task is 'sft'" in message


def test_unknown_task_reported_with_other_mistakes() -> None:
    message = config_error(["task=spf", "train.learnig_rate=1e-4", "data.max_length=abc"])
    assert "task='spf': unknown task (did you mean 'sft'?)" in message
    assert (
        "dance_grpo, diffusion_dpo, diffusion_nft, diffusion_sft, dpo, flow_grpo, grpo, kto, ppo, "
        "rloo, rm, sft" in message
    )
    assert "train.learnig_rate: unknown key (did you mean 'train.learning_rate'?)" in message
    assert "data.max_length:" in message


def test_unknown_task_lists_valid_ones() -> None:
    message = config_error(["task=dpq"])  # (dpp is as close to ppo as to dpo)
    assert "task='dpq': unknown task (did you mean 'dpo'?)" in message
    assert (
        "Available tasks: dance_grpo, diffusion_dpo, diffusion_nft, diffusion_sft, dpo, "
        "flow_grpo, grpo, kto, ppo, rloo, rm, sft." in message
    )


def test_unknown_preset_lists_valid_ones() -> None:
    message = config_error(["deepspeed=z7"])
    assert "deepspeed='z7': unknown preset" in message
    assert "Shipped presets: z0, z2, z3, z3_offload" in message


def test_section_of_another_task_is_rejected() -> None:
    message = config_error(["task=sft", "dpo.beta=0.2"])
    assert "section 'dpo' is set but task is 'sft'" in message
    assert "choose task=dpo" in message


def test_nested_keys_and_values_have_full_paths() -> None:
    message = config_error(
        [
            "task=dpo",
            "dpo.bta=0.2",
            "dpo.loss_type=sigmod",
            "checkpoint.keep_lst=3",
            "logging.backends=[console,wandbb]",
            "trian.epochs=2",
        ]
    )
    assert message.startswith("5 problems in the configuration:"), message
    assert "dpo.bta: unknown key (did you mean 'dpo.beta'?)" in message
    assert "dpo.loss_type: Input should be 'sigmoid', 'ipo'" in message
    assert "(given: 'sigmod')" in message
    assert "checkpoint.keep_lst: unknown key (did you mean 'checkpoint.keep_last'?)" in message
    assert "logging.backends.1:" in message and "(given: 'wandbb')" in message
    assert "trian: unknown key (did you mean 'train'?)" in message


def test_valid_overrides_are_typed() -> None:
    cfg = load_config(["train.adam_betas=[0.8,0.95]", "train.global_batch_size=16", "resume=auto"])
    assert cfg.train.adam_betas == (0.8, 0.95)
    assert cfg.train.global_batch_size == 16
    assert cfg.resume == "auto"


# --------------------------------------------------------------------------- preset files


def test_preset_path_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "ds.json"
    message = config_error([f"deepspeed={missing}"])
    assert f"file {missing} does not exist" in message


def test_preset_with_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text(
        '{\n  "train_batch_size": "auto",\n'
        '  "zero_optimization": {"stage": 2, "overlap_comm": true, "stage": 3}\n}\n'
    )
    with pytest.raises(ConfigError) as info:
        load_preset(str(path))
    assert str(path) in str(info.value)
    assert "duplicate key 'stage'" in str(info.value)
    # Through load_config too, alongside another mistake.
    message = config_error([f"deepspeed={path}", "train.learnig_rate=1"])
    assert f"deepspeed preset {path}: invalid JSON: duplicate key 'stage'" in message
    assert "train.learnig_rate" in message


def test_preset_with_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": "auto",\n  "gradient_clipping": 1.0,\n}\n')
    message = config_error([f"deepspeed={path}"])
    assert f"deepspeed preset {path}: invalid JSON" in message
    assert "line 4" in message  # where the trailing comma bites


def test_preset_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    message = config_error([f"deepspeed={path}"])
    assert f"deepspeed preset {path}: expected a JSON object" in message


def test_own_preset_path(tmp_path: Path) -> None:
    own = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 1},
    }
    path = tmp_path / "own.json"
    path.write_text(json.dumps(own))
    cfg = load_config([f"deepspeed={path}"])
    assert cfg.deepspeed == own
    assert cfg.deepspeed_source == str(path)


@pytest.mark.parametrize(
    "overrides",
    [
        ["deepspeed=z3", "deepspeed.zero_optimization.overlap_comm=false"],
        ["deepspeed.zero_optimization.overlap_comm=false", "deepspeed=z3"],
    ],
    ids=["preset-first", "override-first"],
)
def test_dotted_overrides_reach_inside_the_preset(overrides: list[str]) -> None:
    cfg = load_config(overrides)
    shipped = json.loads((PRESET_DIR / "ds_z3_config.json").read_text())
    assert shipped["zero_optimization"]["overlap_comm"] is True
    expected = json.loads(json.dumps(shipped))
    expected["zero_optimization"]["overlap_comm"] = False
    assert cfg.deepspeed == expected
    # The shipped preset is not modified for later loads.
    assert load_preset("z3")[0] == shipped


def test_dotted_overrides_add_nested_keys_to_own_preset(tmp_path: Path) -> None:
    path = tmp_path / "own.json"
    path.write_text('{"zero_optimization": {"stage": 2}}')
    cfg = load_config(
        [
            f"deepspeed={path}",
            "deepspeed.zero_optimization.offload_optimizer.device=cpu",
            "deepspeed.gradient_clipping=0.5",
        ]
    )
    assert cfg.deepspeed == {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "gradient_clipping": 0.5,
    }


# --------------------------------------------------------------------------- explicit keys


def test_explicit_keys_record_command_line_keys() -> None:
    cfg = load_config(["task=dpo", "train.learning_rate=3e-4", "data.max_length=64"])
    assert cfg.explicit_keys == frozenset({"train.learning_rate", "data.max_length"})
    assert cfg.train.learning_rate == 3e-4
    # Values from the task file are defaults, not explicit (dpo.yaml sets 8 pairs per device).
    assert cfg.train.per_device_batch_size == 8
    assert "train.per_device_batch_size" not in cfg.explicit_keys


def test_explicit_keys_are_not_saved_with_the_config() -> None:
    cfg = load_config(["train.learning_rate=3e-4"])
    saved = cfg.to_dict()
    assert "explicit_keys" not in saved
    assert saved["train"]["learning_rate"] == 3e-4
    assert saved["deepspeed"] == cfg.deepspeed


def test_lora_target_modules_take_one_name_without_brackets() -> None:
    # `target_modules=q_proj` is what a user writes for one module; it means [q_proj].
    assert load_config(["model.lora.target_modules=q_proj"]).model.lora.target_modules == ["q_proj"]
    both = load_config(["model.lora.target_modules=[q_proj,v_proj]"]).model.lora
    assert both.target_modules == ["q_proj", "v_proj"]
    assert load_config([]).model.lora.target_modules == "all-linear"


def test_a_repeated_key_keeps_its_last_value_and_says_so() -> None:
    # As Hydra does (`a=1 a=2` gives 2), so a wrapper script's defaults followed by the user's
    # overrides work; the start-up summary shows the note (not silently, issue #38).
    cfg = load_config(["train.max_steps=2", "train.max_steps=3", "deepspeed.steps_per_print=5",
                       "+deepspeed.steps_per_print=7"])  # fmt: skip
    assert cfg.train.max_steps == 3 and cfg.deepspeed["steps_per_print"] == 7
    assert cfg.override_notes == (
        "train.max_steps given 2 times (train.max_steps=2, train.max_steps=3): the last is used",
        "deepspeed.steps_per_print given 2 times (deepspeed.steps_per_print=5, "
        "+deepspeed.steps_per_print=7): the last is used",
    )
    assert "override_notes" not in cfg.to_dict()
    assert load_config(["train.max_steps=2"]).override_notes == ()
