"""DeepSpeed presets: standalone use in HF transformers, our "auto" resolution, batch arithmetic,
and real engines built from each preset (DESIGN §2-3).

Engines are built in one subprocess per preset: a ZeRO-3 model construction leaves transformers'
global DeepSpeed config set (see `model_init_context`), so a later ZeRO-0 model in the same
process would still be built partitioned.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # when run as a script (the engine probe below)
    sys.path.insert(0, str(REPO_ROOT))

from align_anything.backend.ds_config import ONE_PROCESS_ZERO3  # noqa: E402
from align_anything.config import PRESET_DIR, TASK_DIR, load_config, load_preset  # noqa: E402
from align_anything.errors import ConfigError  # noqa: E402

PRESET_FILES = sorted(PRESET_DIR.glob("ds_*_config.json"))
PRESET_NAMES = [p.name.removeprefix("ds_").removesuffix("_config.json") for p in PRESET_FILES]
TASK_NAMES = sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
BUCKET_KEYS = (
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)
TINY_MODEL = "tiny-random-llama"
TINY_HIDDEN = 64  # models/zoo.py builds tiny-random-llama with hidden_size=64


def find_auto(node: Any, path: str = "") -> list[str]:
    """Dotted paths of every "auto" left in a config."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in find_auto(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in find_auto(v, f"{path}[{i}]")]
    return [path] if node == "auto" else []


def one_process_zero3(preset: dict[str, Any]) -> bool:
    """A ZeRO-3 preset without parameter offload: one process resolves its "auto" persistence
    threshold and prefetch bucket to `ds_config.ONE_PROCESS_ZERO3`."""
    zero = preset["zero_optimization"]
    return zero["stage"] == 3 and zero.get("offload_param", {}).get("device", "none") == "none"


def resolve(preset: dict[str, Any], **overrides: Any) -> tuple[dict[str, Any], Any, str]:
    from align_anything.backend.ds_config import AdamSettings, resolve_ds_config

    kwargs: dict[str, Any] = dict(
        world_size=1,
        hidden_size=576,
        device="cpu",
        precision="auto",
        micro_batch=2,
        grad_accum=3,
        global_batch="auto",
        max_grad_norm=0.7,
        adam=AdamSettings(3e-4, (0.8, 0.95), 1e-7, 0.01),
        bf16_supported=False,
        explicit=frozenset(),
    )
    kwargs.update(overrides)
    return resolve_ds_config(preset, **kwargs)


def all_auto_preset() -> dict[str, Any]:
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 0},
    }


# --------------------------------------------------------------------------- HF transformers


@pytest.fixture
def hf_global_state():
    """TrainingArguments(deepspeed=...) sets transformers' global DeepSpeed config and
    accelerate's state; undo both so later tests in this process start clean."""
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("preset_file", PRESET_FILES, ids=PRESET_NAMES)
def test_preset_works_unchanged_in_hf_trainer(
    preset_file: Path, tmp_path: Path, hf_global_state: None
) -> None:
    import torch
    from transformers import TrainingArguments

    from align_anything.backend.ds_config import AdamSettings
    from align_anything.families.language.loading import load_config as load_model_config

    preset = json.loads(preset_file.read_text())
    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=str(preset_file),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        learning_rate=3e-4,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        weight_decay=0.01,
        max_grad_norm=0.7,
        use_cpu=True,
        report_to=[],
    )
    hf = args.hf_deepspeed_config
    # What Trainer does once it has the model: fill the hidden-size based buckets.
    model = types.SimpleNamespace(config=load_model_config(TINY_MODEL))
    hf.trainer_config_finalize(args, model, num_training_steps=10)
    filled = hf.config

    assert find_auto(filled) == []
    # HF: train_batch_size = world_size × per_device_train_batch_size × gradient_accumulation_steps
    assert args.world_size == 1
    assert filled["train_micro_batch_size_per_gpu"] == 2
    assert filled["gradient_accumulation_steps"] == 3
    assert filled["train_batch_size"] == 6
    assert filled["gradient_clipping"] == 0.7
    # fp16/bf16 "auto" follow the (unset) TrainingArguments flags: full fp32.
    assert filled["fp16"]["enabled"] is False and filled["bf16"]["enabled"] is False
    assert hf.dtype() == torch.float32
    if "optimizer" in preset:
        assert filled["optimizer"]["params"] == {
            "lr": 3e-4,
            "betas": [0.8, 0.95],
            "eps": 1e-7,
            "weight_decay": 0.01,
        }
    zero = filled["zero_optimization"]
    expected_buckets = {
        "reduce_bucket_size": TINY_HIDDEN**2,
        "stage3_prefetch_bucket_size": int(0.9 * TINY_HIDDEN**2),
        "stage3_param_persistence_threshold": 10 * TINY_HIDDEN,
    }
    for key in BUCKET_KEYS:
        if preset["zero_optimization"].get(key) == "auto":
            assert zero[key] == expected_buckets[key], key
    assert zero["stage"] == preset["zero_optimization"]["stage"]
    if one_process_zero3(preset):
        # Where we choose differently on purpose: ZeRO-3 in one process without parameter
        # offload persists every parameter and prefetches nothing (ds_config.ONE_PROCESS_ZERO3);
        # HF fills them from h. Put HF's fills in for the key-for-key comparison below.
        filled = json.loads(json.dumps(filled))
        filled["zero_optimization"].update(
            {key: ONE_PROCESS_ZERO3[key] for key in ONE_PROCESS_ZERO3
             if preset["zero_optimization"].get(key) == "auto"}
        )  # fmt: skip

    # Our resolution of the same preset with the same numbers agrees with HF's key for key;
    # accelerate only rewrites steps_per_print (to silence DeepSpeed's logging).
    ours, _, precision = resolve(
        preset,
        hidden_size=TINY_HIDDEN,
        micro_batch=2,
        grad_accum=3,
        max_grad_norm=0.7,
        adam=AdamSettings(3e-4, (0.8, 0.95), 1e-7, 0.01),
    )
    assert precision == "fp32"
    assert {k: v for k, v in ours.items() if k != "steps_per_print"} == {
        k: v for k, v in filled.items() if k != "steps_per_print"
    }


# --------------------------------------------------------------------------- our resolution


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_resolution_fills_every_auto(name: str, world_size: int) -> None:
    preset, _ = load_preset(name)
    before = json.dumps(preset, sort_keys=True)
    hidden = 576
    config, plan, precision = resolve(
        preset, world_size=world_size, hidden_size=hidden, micro_batch=2, grad_accum=3
    )
    assert find_auto(config) == []
    assert json.dumps(preset, sort_keys=True) == before, "resolution must not modify the preset"

    assert (plan.micro_batch, plan.grad_accum, plan.world_size) == (2, 3, world_size)
    assert plan.global_batch == 6 * world_size
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 6 * world_size
    assert config["gradient_clipping"] == 0.7

    # precision auto on CPU: fp32, neither mixed-precision flag on.
    assert precision == "fp32"
    assert config["bf16"]["enabled"] is False
    assert config["fp16"]["enabled"] is False

    zero, shipped_zero = config["zero_optimization"], preset["zero_optimization"]
    assert zero["stage"] == shipped_zero["stage"]
    expected = {
        "reduce_bucket_size": 331_776,  # 576²
        "stage3_prefetch_bucket_size": 298_598,  # int(0.9 × 576²)
        "stage3_param_persistence_threshold": 5_760,  # 10 × 576
    }
    if world_size == 1 and one_process_zero3(preset):
        # One process: every parameter persists (a partition is the whole parameter), nothing
        # is prefetched. With parameter offload (z3_offload) or 2 ranks, the h-based fills.
        expected.update(
            stage3_prefetch_bucket_size=0, stage3_param_persistence_threshold=sys.maxsize
        )
    for key in BUCKET_KEYS:
        if shipped_zero.get(key) == "auto":
            assert zero[key] == expected[key], key
        elif key in shipped_zero:
            assert zero[key] == shipped_zero[key], f"{key}: a number in the preset is kept"
    if shipped_zero["stage"] == 3:
        assert all(key in zero for key in BUCKET_KEYS)
    if "optimizer" in preset:
        assert config["optimizer"]["params"] == {
            "lr": 3e-4,
            "betas": [0.8, 0.95],
            "eps": 1e-7,
            "weight_decay": 0.01,
        }


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("task", TASK_NAMES)
def test_every_task_resolves_with_every_preset(task: str, name: str) -> None:
    from align_anything.backend.ds_config import AdamSettings

    cfg = load_config([f"task={task}", f"deepspeed={name}"])
    train = cfg.train
    config, plan, _ = resolve(
        cfg.deepspeed,
        world_size=2,
        hidden_size=TINY_HIDDEN,
        precision=train.precision,
        micro_batch=train.per_device_batch_size,
        grad_accum=train.gradient_accumulation_steps,
        global_batch=train.global_batch_size,
        max_grad_norm=train.max_grad_norm,
        adam=AdamSettings(
            train.learning_rate, train.adam_betas, train.adam_eps, train.weight_decay
        ),
        explicit=cfg.explicit_keys,
    )
    assert find_auto(config) == []
    assert plan.micro_batch == train.per_device_batch_size
    assert plan.global_batch == plan.micro_batch * plan.grad_accum * 2


def test_preset_precision_flags_on_cpu() -> None:
    preset = all_auto_preset()
    preset["bf16"] = {"enabled": True}
    config, _, precision = resolve(preset)
    assert precision == "bf16"  # an explicit preset flag wins over auto, even on CPU
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    # fp16 is not for a CPU (DeepSpeed's CPU accelerator has no fp16): one message before any
    # model loads, naming what this device trains in.
    with pytest.raises(
        ConfigError, match=r"train.precision=fp16, but this device \(cpu\) trains in bf16 or fp32"
    ):
        resolve(all_auto_preset(), precision="fp16")
    fp16_preset = all_auto_preset()
    fp16_preset["fp16"] = {"enabled": True}
    with pytest.raises(ConfigError, match="the preset enables fp16, but this device"):
        resolve(fp16_preset)


def test_auto_the_resolver_does_not_know_is_an_error() -> None:
    preset = all_auto_preset()
    preset["zero_optimization"]["sub_group_size"] = "auto"
    with pytest.raises(ConfigError, match=r"cannot fill: zero_optimization\.sub_group_size"):
        resolve(preset)


# --------------------------------------------------------------------------- batch arithmetic


@pytest.mark.parametrize(
    ("micro", "accum", "global_batch", "world", "expected"),
    [
        (2, 3, "auto", 2, (2, 3, 12)),
        ("auto", 2, 8, 2, (2, 2, 8)),
        (2, "auto", 8, 2, (2, 2, 8)),
        (4, 2, 16, 2, (4, 2, 16)),
        (1, "auto", 12, 3, (1, 4, 12)),
    ],
)
def test_any_two_batch_numbers_determine_the_third(
    micro: Any, accum: Any, global_batch: Any, world: int, expected: tuple[int, int, int]
) -> None:
    explicit = frozenset(
        {"train.per_device_batch_size", "train.gradient_accumulation_steps"}
        | ({"train.global_batch_size"} if global_batch != "auto" else set())
    )
    config, plan, _ = resolve(
        all_auto_preset(),
        world_size=world,
        micro_batch=micro,
        grad_accum=accum,
        global_batch=global_batch,
        explicit=explicit,
    )
    assert (plan.micro_batch, plan.grad_accum, plan.global_batch) == expected
    assert plan.world_size == world
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
        config["train_batch_size"],
    ) == expected


def test_batch_numbers_in_the_preset_determine_the_third() -> None:
    preset = all_auto_preset()
    preset["train_batch_size"] = 24
    preset["gradient_accumulation_steps"] = 3
    # micro comes from the preset's two numbers, not from the task default of 4.
    _, plan, _ = resolve(preset, world_size=2, micro_batch=4, grad_accum=1, global_batch="auto")
    assert (plan.micro_batch, plan.grad_accum, plan.global_batch) == (4, 3, 24)
    preset["train_batch_size"] = 36
    _, plan, _ = resolve(preset, world_size=2, micro_batch=4, grad_accum=1, global_batch="auto")
    assert (plan.micro_batch, plan.grad_accum, plan.global_batch) == (6, 3, 36)


def test_three_that_disagree_show_the_numbers() -> None:
    explicit = frozenset(
        {
            "train.per_device_batch_size",
            "train.gradient_accumulation_steps",
            "train.global_batch_size",
        }
    )
    with pytest.raises(ConfigError) as info:
        resolve(
            all_auto_preset(),
            world_size=2,
            micro_batch=2,
            grad_accum=1,
            global_batch=8,
            explicit=explicit,
        )
    assert "train_batch_size 8 != micro 2 × grad_accum 1 × world 2 (= 4)" in str(info.value)
    # The same when the three numbers come from the preset.
    preset = all_auto_preset()
    preset.update(
        train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1
    )
    with pytest.raises(
        ConfigError, match=r"train_batch_size 8 != micro 2 × grad_accum 1 × world 2"
    ):
        resolve(preset, world_size=2)


def test_global_batch_not_divisible() -> None:
    with pytest.raises(ConfigError) as info:
        resolve(
            all_auto_preset(),
            world_size=2,
            micro_batch=2,
            grad_accum="auto",
            global_batch=10,
            explicit=frozenset({"train.per_device_batch_size", "train.global_batch_size"}),
        )
    message = str(info.value)
    assert "train_batch_size 10 is not divisible by micro 2 × world 2" in message


def test_undetermined_batch_is_an_error() -> None:
    with pytest.raises(ConfigError, match="batch size is undetermined"):
        resolve(all_auto_preset(), micro_batch="auto", grad_accum="auto", global_batch="auto")


def test_explicit_values_that_conflict_with_the_preset_are_listed_together() -> None:
    preset = all_auto_preset()
    preset.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    preset["gradient_clipping"] = 1.0
    preset["bf16"] = {"enabled": True}
    explicit = frozenset(
        {
            "train.per_device_batch_size",
            "train.gradient_accumulation_steps",
            "train.max_grad_norm",
            "train.precision",
        }
    )
    with pytest.raises(ConfigError) as info:
        resolve(
            preset,
            micro_batch=8,
            grad_accum=3,
            max_grad_norm=0.5,
            precision="fp32",
            explicit=explicit,
        )
    message = str(info.value)
    assert (
        "train.per_device_batch_size=8 but the preset sets train_micro_batch_size_per_gpu=4"
        in message
    )
    assert (
        "train.gradient_accumulation_steps=3 but the preset sets gradient_accumulation_steps=2"
        in message
    )
    assert "train.max_grad_norm=0.5 but the preset sets gradient_clipping=1.0" in message
    assert "train.precision=fp32 but the preset enables bf16" in message


def test_command_line_conflict_with_preset_override_end_to_end() -> None:
    cfg = load_config(
        ["train.per_device_batch_size=8", "deepspeed.train_micro_batch_size_per_gpu=4"]
    )
    with pytest.raises(ConfigError, match="train.per_device_batch_size=8 but the preset sets"):
        resolve(
            cfg.deepspeed,
            micro_batch=cfg.train.per_device_batch_size,
            grad_accum=cfg.train.gradient_accumulation_steps,
            global_batch=cfg.train.global_batch_size,
            explicit=cfg.explicit_keys,
        )


def test_preset_numbers_win_over_task_defaults() -> None:
    preset = all_auto_preset()
    preset.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2)
    preset["gradient_clipping"] = 0.3
    # Not explicit: the task's defaults (micro 4, accum 1, clip 1.0) yield to the preset.
    config, plan, _ = resolve(preset, world_size=2, micro_batch=4, grad_accum=1, max_grad_norm=1.0)
    assert (plan.micro_batch, plan.grad_accum, plan.global_batch) == (8, 2, 32)
    assert config["gradient_clipping"] == 0.3
    # Through load_config: the task file's per_device_batch_size is a default, not explicit.
    cfg = load_config(["task=dpo", "deepspeed.train_micro_batch_size_per_gpu=8"])
    _, plan, _ = resolve(
        cfg.deepspeed,
        micro_batch=cfg.train.per_device_batch_size,
        grad_accum=cfg.train.gradient_accumulation_steps,
        global_batch=cfg.train.global_batch_size,
        explicit=cfg.explicit_keys,
    )
    assert plan.micro_batch == 8


# --------------------------------------------------------------------------- real engines


def _probe_engine(name: str) -> dict[str, Any]:
    """Build the tiny model and an Engine from preset `name` in this process; one forward on a
    fixed batch, one training step, another forward."""
    import torch

    from align_anything.backend.distributed import setup_distributed
    from align_anything.backend.ds_config import AdamSettings, resolve_ds_config, zero_stage_of
    from align_anything.backend.engine import Engine
    from align_anything.backend.zero_init import model_init_context
    from align_anything.families.language.loading import load_config as load_model_config
    from align_anything.families.language.loading import load_model, text_hidden_size

    setup_distributed()
    model_config = load_model_config(TINY_MODEL)
    preset, _ = load_preset(name)
    ds_config, _, precision = resolve_ds_config(
        preset,
        world_size=1,
        hidden_size=text_hidden_size(model_config),
        device="cpu",
        precision="auto",
        micro_batch=2,
        grad_accum=1,
        global_batch="auto",
        max_grad_norm=1.0,
        adam=AdamSettings(1e-3, (0.9, 0.999), 1e-8, 0.0),
        bf16_supported=False,
    )
    torch.manual_seed(0)
    with model_init_context(ds_config):
        model = load_model(TINY_MODEL, reward=False, dtype=torch.float32)
    params = list(model.parameters())
    local_numel_loaded = [p.numel() for p in params]
    engine = Engine(
        model,
        ds_config,
        adam=AdamSettings(1e-3, (0.9, 0.999), 1e-8, 0.0),
        schedule="constant",
        total_steps=10,
        warmup_steps=0,
    )
    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(3, model_config.vocab_size, (2, 24), generator=generator)
    engine.train()
    loss = engine(input_ids=input_ids, labels=input_ids).loss
    first_loss = float(loss)
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        second_loss = float(engine(input_ids=input_ids, labels=input_ids).loss)
    return {
        "precision": precision,
        "requested_stage": zero_stage_of(ds_config),
        "zero_stage": engine.zero_stage,
        "optimizer": type(engine.engine.basic_optimizer).__name__,
        "first_loss": first_loss,
        "second_loss": second_loss,
        "ds_numel": [getattr(p, "ds_numel", None) for p in params],
        "local_numel_loaded": local_numel_loaded,
        "full_numel": [math.prod(getattr(p, "ds_shape", p.shape)) for p in params],
    }


_PROBES: dict[str, dict[str, Any]] = {}


def engine_probe(name: str) -> dict[str, Any]:
    """`_probe_engine` of every shipped preset, in one fresh process (once per test session),
    each from the same seed; the result for `name`."""
    if not _PROBES:
        env = {
            k: v
            for k, v in os.environ.items()
            if k
            not in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            )
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        # The first z3_offload run JIT-compiles DeepSpeed's CPU Adam (minutes on 2 cores).
        proc = subprocess.run(
            [sys.executable, __file__, *PRESET_NAMES],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        marker = "ENGINE_PROBE "
        lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
        assert proc.returncode == 0 and len(lines) == len(PRESET_NAMES), (
            f"engine probes for {PRESET_NAMES} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
        for line in lines:
            probe = json.loads(line.removeprefix(marker))
            _PROBES[probe.pop("name")] = probe
    return _PROBES[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_deepspeed_accepts_each_resolved_preset(name: str) -> None:
    probe = engine_probe(name)
    shipped_stage = load_preset(name)[0]["zero_optimization"]["stage"]
    assert probe["zero_stage"] == shipped_stage == probe["requested_stage"]
    assert probe["precision"] == "fp32"
    # DESIGN §3: CPU Adam when the optimizer is offloaded, torch AdamW on CPU otherwise.
    offloaded = load_preset(name)[0]["zero_optimization"].get("offload_optimizer")
    assert probe["optimizer"] == ("DeepSpeedCPUAdam" if offloaded else "AdamW")
    # Same weights, same batch: every stage starts from ZeRO-0's loss.
    assert probe["first_loss"] == pytest.approx(engine_probe("z0")["first_loss"], abs=1e-5)
    # One step at lr 1e-3 on the same batch lowers its loss.
    assert probe["second_loss"] < probe["first_loss"] - 1e-3


@pytest.mark.slow
def test_zero3_starts_from_the_same_loss_as_zero0_and_is_partitioned() -> None:
    zero0, zero3 = engine_probe("z0"), engine_probe("z3")
    assert zero3["zero_stage"] == 3 and zero0["zero_stage"] == 0
    assert zero3["first_loss"] == pytest.approx(zero0["first_loss"], abs=1e-5)
    # ZeRO-0: plain full tensors.
    assert all(n is None for n in zero0["ds_numel"])
    assert zero0["local_numel_loaded"] == zero0["full_numel"]
    # ZeRO-3: every parameter is built partitioned under zero.Init: its full size is ds_numel,
    # the local tensor is empty.
    assert zero3["ds_numel"] == zero0["full_numel"]
    assert all(n == 0 for n in zero3["local_numel_loaded"])


@pytest.mark.slow
def test_zero3_in_one_process_trains_the_numbers_of_the_h_based_settings(tmp_path: Path) -> None:
    """One process: ZeRO-3's one-process resolution (every parameter persists, nothing is
    prefetched) is a change of time and memory only. DPO with its precomputed reference logs
    exactly the losses, gradient norms and eval metrics of ZeRO-3 with the h-based fills (10·h
    persistence threshold, 0.9·h² prefetch bucket: the tiny model's 64×64 matrices are then
    fetched and released module by module), and the start-up summary says what ZeRO-3 costs
    in one process."""
    from conftest import DPO_ARGS, RECIPE_STEPS, run_inline

    one = run_inline([*DPO_ARGS, "deepspeed=z3"], tmp_path / "one-process").check()
    h = TINY_HIDDEN
    previous = run_inline(
        [*DPO_ARGS, "deepspeed=z3",
         f"deepspeed.zero_optimization.stage3_param_persistence_threshold={10 * h}",
         f"deepspeed.zero_optimization.stage3_prefetch_bucket_size={int(0.9 * h * h)}"],
        tmp_path / "h-based",
    ).check()  # fmt: skip
    resolved = json.loads((tmp_path / "one-process" / "ds_config.json").read_text())
    assert resolved["zero_optimization"]["stage3_param_persistence_threshold"] == sys.maxsize
    assert resolved["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    assert len(one.losses()) == RECIPE_STEPS
    assert one.losses() == previous.losses()
    norms = [[m["grad_norm"] for m in run.train_steps()] for run in (one, previous)]
    assert norms[0] == norms[1]
    assert one.eval("after") == previous.eval("after")
    line = one.summary_line("one process")
    assert "fp32 master copy" in line and "deepspeed=z0" in line


def test_a_stale_build_lock_of_the_offload_optimizer_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed JIT build leaves `<TORCH_EXTENSIONS_DIR>/cpu_adam/lock`, and torch's loader
    would wait for it forever: an old lock is refused with its path; a fresh one (another
    process building now) and none at all pass."""
    from align_anything.backend.engine import STALE_BUILD_LOCK_S, refuse_a_stale_build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    refuse_a_stale_build_lock("cpu_adam")  # no lock (nor build) yet
    lock = tmp_path / "cpu_adam" / "lock"
    lock.touch()
    created = lock.stat().st_mtime
    refuse_a_stale_build_lock("cpu_adam", now=created + 60)  # a build in progress
    with pytest.raises(ConfigError, match="left 16 minutes ago") as err:
        refuse_a_stale_build_lock("cpu_adam", now=created + STALE_BUILD_LOCK_S + 60)
    assert str(lock) in str(err.value) and "delete that file" in str(err.value)


if __name__ == "__main__":
    for preset_name in sys.argv[1:]:
        probe = {"name": preset_name, **_probe_engine(preset_name)}
        print("ENGINE_PROBE " + json.dumps(probe), flush=True)
