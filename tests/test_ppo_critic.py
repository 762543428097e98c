"""PPO's critic (align_anything/models/value.py) and the per-token passes of forward.py it and
the actor use: values at every token from a reward model, their alignment with the completion
log-probs, the shared-prefix layout, LoRA, export and loading back; a ZeRO-3 engine (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from align_anything.errors import ConfigError
from align_anything.families import zoo
from align_anything.families.language import IGNORE_INDEX, loading
from align_anything.families.language.batches import Rows
from align_anything.families.language.forward import (
    completion_token_logps,
    completion_token_logps_and_entropy,
    completion_token_values,
    sequence_scores,
    shared_prefix_token_values,
)
from align_anything.families.language.layouts import PrefixGroup, collate_shared_prefix
from align_anything.families.language.value import ValueModel, load_critic
from align_anything.losses import token_entropy

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = "tiny-random-llama"


def make_reward_model(folder: Path, seed: int = 0) -> Path:
    """The tiny model as a one-output sequence-classification model (a new, seeded score head),
    saved as a task=rm run would save it: a reward-model folder without any training."""
    path = zoo.resolve_model_path(TINY)
    tokenizer = loading.load_tokenizer(path)
    torch.manual_seed(seed)
    model = loading.load_model(path, reward=True, dtype=torch.float32)
    # A larger head than transformers' init (std 0.02), so values differ visibly per token.
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reward_model(tmp_path_factory.mktemp("rm") / "final")


def plain_batch(rows: list[tuple[list[int], list[int]]], pad: int = 2) -> Rows:
    """prompt + completion per row, right-padded, labels on the completion (online.collate's)."""
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    mask = torch.zeros_like(ids)
    for b, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[b, :n] = torch.tensor(prompt + completion)
        labels[b, len(prompt) : n] = torch.tensor(completion)
        mask[b, :n] = 1
    return Rows(ids, mask, labels)


# Two rows: prompt 3 + completion 4, prompt 5 + completion 2 (ids avoid the pad id 2).
ROWS = [([5, 6, 7], [8, 9, 10, 11]), ([12, 13, 14, 15, 16], [17, 18])]


def test_values_are_the_reward_models_score_of_every_prefix(tiny_rm: Path) -> None:
    """V at position t is what the reward model scores for the sequence cut after token t."""
    scorer = load_critic(str(tiny_rm), init="reward_model", dtype=torch.float32).eval()
    critic = ValueModel(scorer)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        values = critic(input_ids=ids, attention_mask=torch.ones_like(ids))
        prefixes = [
            float(sequence_scores(scorer, Rows(ids[:, : t + 1], torch.ones(1, t + 1),
                                               ids[:, : t + 1])))
            for t in range(ids.shape[1])
        ]  # fmt: skip
    assert values.shape == (1, 6)
    torch.testing.assert_close(values[0], torch.tensor(prefixes), rtol=1e-5, atol=1e-5)
    assert len({round(v, 4) for v in prefixes}) == 6  # a real head: every prefix differs


def test_completion_token_values_align_with_the_completion_logps(tiny_rm: Path) -> None:
    critic = ValueModel(load_critic(str(tiny_rm), init="reward_model", dtype=torch.float32))
    policy = loading.load_model(zoo.resolve_model_path(TINY), reward=False, dtype=torch.float32)
    batch = plain_batch(ROWS)
    with torch.no_grad():
        values = completion_token_values(critic.eval(), batch)
        logps = completion_token_logps(policy.eval(), batch, completion_only=True)
        full = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    assert values.shape == logps.shape == (2, 4) and values.dtype == torch.float32
    # Completion token j of row b is chosen after position len(prompt) + j − 1.
    assert values[0].tolist() == pytest.approx(full[0, 2:6].tolist(), abs=1e-6)
    assert values[1, :2].tolist() == pytest.approx(full[1, 4:6].tolist(), abs=1e-6)
    assert values[1, 2:].tolist() == [0.0, 0.0]


def test_shared_prefix_values_equal_the_plain_rows(tiny_rm: Path) -> None:
    """Two completions of one prompt as one row prompt + c1 + c2 (the online trainer's
    share_prefix layout): the same value for every completion token."""
    critic = ValueModel(
        loading.load_model(str(tiny_rm), reward=True, dtype=torch.float32,
                           attn_implementation="sdpa")
    ).eval()  # fmt: skip
    prompt, first, second = [5, 6, 7, 8], [9, 10, 11], [12, 13]
    shared = collate_shared_prefix(
        [PrefixGroup(prompt, [first, second], [first, second], [0, 1])],
        num_sequences=2, pad_id=2, additive_mask_dtype=None,
    )  # fmt: skip
    with torch.no_grad():
        flat = shared_prefix_token_values(critic, shared)
        plain = completion_token_values(critic, plain_batch([(prompt, first), (prompt, second)]))
    torch.testing.assert_close(flat, torch.cat([plain[0], plain[1, :2]]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("completion_only", [True, False])
def test_logps_and_entropy_from_one_pass(completion_only: bool) -> None:
    policy = loading.load_model(zoo.resolve_model_path(TINY), reward=False, dtype=torch.float32)
    batch = plain_batch(ROWS)
    with torch.no_grad():
        logps, entropy = completion_token_logps_and_entropy(
            policy.eval(), batch, completion_only=completion_only
        )
        expected = completion_token_logps(policy, batch, completion_only=completion_only)
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
    # Entropy of the distribution that chose each completion token (positions 2..5 of row 0,
    # 4..5 of row 1), 0 past row 1's end.
    torch.testing.assert_close(entropy[0], token_entropy(logits[0, 2:6]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[1, :2], token_entropy(logits[1, 4:6]), rtol=1e-5, atol=1e-5)
    assert entropy[1, 2:].tolist() == [0.0, 0.0]


def test_critic_from_the_policy_has_the_policys_backbone_and_a_new_small_head() -> None:
    path = zoo.resolve_model_path(TINY)
    policy = loading.load_model(path, reward=False, dtype=torch.float32)
    torch.manual_seed(0)
    critic = ValueModel(load_critic(path, init="policy", dtype=torch.float32))
    backbone = dict(critic.scorer.model.named_parameters())
    for name, param in policy.model.named_parameters():
        assert torch.equal(param, backbone[name]), name
    head = critic.scorer.score.weight
    # transformers' init of a new linear layer: normal with std initializer_range (0.02).
    assert head.shape == (1, 64) and head.abs().max() < 0.1 and head.std() > 0.005


def test_critic_init_refuses_the_wrong_kind_of_folder(tiny_rm: Path) -> None:
    with pytest.raises(ConfigError, match=r"ppo.critic_model=.* is not a reward model \("):
        load_critic(zoo.resolve_model_path(TINY), init="reward_model", dtype=torch.float32)
    with pytest.raises(ConfigError, match="set ppo.critic_init=reward_model"):
        load_critic(str(tiny_rm), init="policy", dtype=torch.float32)


def test_critic_with_lora_trains_adapters_and_head(tiny_rm: Path) -> None:
    from align_anything.families.language.prepare import prepare_for_training

    plain = ValueModel(load_critic(str(tiny_rm), init="reward_model", dtype=torch.float32))
    scorer = load_critic(str(tiny_rm), init="reward_model", dtype=torch.float32)
    adapters = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    prepared, lines = prepare_for_training(
        scorer, name="critic", freeze=[], adapters=adapters, gradient_checkpointing=False,
        reward=True,
    )  # fmt: skip
    critic = ValueModel(prepared)
    assert "score" in lines[0].split("trained fully:")[1]
    batch = plain_batch(ROWS)
    # LoRA's B starts at 0: the adapted critic gives the reward model's values.
    with torch.no_grad():
        before = completion_token_values(plain.eval(), batch)
    values = completion_token_values(critic.train(), batch)
    torch.testing.assert_close(values, before, rtol=1e-5, atol=1e-5)
    values.sum().backward()
    trained = {n for n, p in critic.named_parameters() if p.grad is not None}
    assert any("lora_A" in n for n in trained) or any("lora_B" in n for n in trained)
    assert any(n.endswith("score.modules_to_save.default.weight") for n in trained)
    assert not any("lora" not in n and "score" not in n for n in trained)  # base frozen


def test_exported_critic_loads_back_with_its_values(tiny_rm: Path, tmp_path: Path) -> None:
    critic = ValueModel(load_critic(str(tiny_rm), init="reward_model", dtype=torch.float32))
    with torch.no_grad():  # a "trained" critic: move the head
        critic.scorer.score.weight.add_(0.5)
    state = {k: v.clone() for k, v in critic.state_dict().items()}  # as an engine gathers it
    assert all(k.startswith("scorer.") for k in state)
    out = tmp_path / "critic"
    critic.scorer.save_pretrained(out, state_dict=ValueModel.scorer_state(state))
    loaded = ValueModel(load_critic(str(out), init="reward_model", dtype=torch.float32))
    batch = plain_batch(ROWS)
    with torch.no_grad():
        torch.testing.assert_close(
            completion_token_values(loaded.eval(), batch),
            completion_token_values(critic.eval(), batch),
        )
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"
    ]


# --------------------------------------------------------------------------- under ZeRO-3


def _zero3_probe(rm: str, out: str) -> dict:
    """A LoRA critic built under zero.Init (ZeRO-3 preset, one rank): its values against the
    plain model's, one optimizer step on a value loss, and the export of the trained critic
    loaded back."""
    from align_anything.backend.distributed import setup_distributed
    from align_anything.backend.ds_config import AdamSettings, resolve_ds_config
    from align_anything.backend.engine import Engine
    from align_anything.backend.zero_init import model_init_context
    from align_anything.config import load_preset
    from align_anything.families.language.export import write_final
    from align_anything.families.language.prepare import prepare_for_training
    from align_anything.losses import loss_items, loss_sum, value_loss

    world = setup_distributed().world_size
    adam = AdamSettings(1e-4, (0.9, 0.999), 1e-8, 0.0)
    preset, _ = load_preset("z3")
    ds_config, _, _ = resolve_ds_config(
        preset, world_size=world, hidden_size=64, device="cpu", precision="fp32", micro_batch=2,
        grad_accum=1, global_batch="auto", max_grad_norm=1.0, adam=adam, bf16_supported=False,
    )  # fmt: skip
    batch = plain_batch(ROWS)
    with model_init_context(ds_config):
        scorer = load_critic(rm, init="reward_model", dtype=torch.float32)
    partitioned = all(hasattr(p, "ds_id") for p in scorer.parameters())
    adapters = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    prepared, _ = prepare_for_training(
        scorer, name="critic", freeze=[], adapters=adapters, gradient_checkpointing=False,
        reward=True,
    )  # fmt: skip
    engine = Engine(ValueModel(prepared), ds_config, adam=adam, schedule="constant",
                    total_steps=1, warmup_steps=0)  # fmt: skip
    engine.eval()
    with torch.no_grad():
        before = completion_token_values(engine, batch)
    engine.train()
    mask = (torch.arange(4)[None] < torch.tensor([[4], [2]])).float()
    returns = torch.ones(2, 4)
    per_token, _ = value_loss(
        completion_token_values(engine, batch), before, returns, value_clip=None
    )
    loss = loss_sum(per_token, mask, loss_type="dapo", max_completion_length=4)
    engine.backward(loss / loss_items(mask, loss_type="dapo"))
    engine.step()
    engine.eval()
    with torch.no_grad():
        after = completion_token_values(engine, batch)
    state = ValueModel.scorer_state(engine.full_state_dict())
    tokenizer = loading.load_tokenizer(rm)
    write_final(Path(out), engine.module.scorer, state, tokenizer=tokenizer, configs={})
    return {"partitioned": partitioned, "stage": engine.zero_stage, "before": before.tolist(),
            "after": after.tolist(), "mask": mask.tolist()}  # fmt: skip


@pytest.mark.slow
def test_critic_under_zero3_with_lora_trains_and_exports(tiny_rm: Path, tmp_path: Path) -> None:
    out = tmp_path / "critic"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_rm), str(out)], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["partitioned"] and probe["stage"] == 3
    # Before the step: the plain reward model's values (LoRA's B starts at 0).
    plain = ValueModel(load_critic(str(tiny_rm), init="reward_model", dtype=torch.float32))
    batch = plain_batch(ROWS)
    with torch.no_grad():
        expected = completion_token_values(plain.eval(), batch)
    torch.testing.assert_close(torch.tensor(probe["before"]), expected, rtol=1e-5, atol=1e-5)
    # The step moved every counted value towards the return 1.
    mask = torch.tensor(probe["mask"]).bool()
    before, after = torch.tensor(probe["before"]), torch.tensor(probe["after"])
    assert ((after - 1).abs() < (before - 1).abs())[mask].all(), (before, after)
    # The export is a LoRA adapter of the reward model; applied, it gives the trained values.
    from align_anything.families.language import lora

    assert lora.is_adapter_folder(out)
    model, _ = lora.load_adapter_model(out, str(tiny_rm), task="rm")
    with torch.no_grad():
        exported = completion_token_values(ValueModel(model).eval(), batch)
    torch.testing.assert_close(exported, after, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":  # the ZeRO-3 probe, in a fresh process (see the test above)
    print(json.dumps(_zero3_probe(sys.argv[1], sys.argv[2])))
