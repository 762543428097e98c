"""The benchmark scripts import, and their shared helpers do what the comparisons rely on (same
rows, same order, same token counts, the ratio arithmetic, the MFU formula). The benchmarks
themselves are not run here: speed is measured in benchmarks/, never asserted in tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import data_scale  # noqa: E402  (imports without TRL: TRL is imported in its child)
import diffusion_dpo  # noqa: E402
import diffusion_dpo_plain  # noqa: E402
import dpo_vs_trl  # noqa: E402
import generate_paired  # noqa: E402, F401
import gpu_bench  # noqa: E402
import grpo_vlm_vs_trl  # noqa: E402  (imports without TRL: TRL is imported in its child)
import grpo_vs_trl  # noqa: E402
import image_rl  # noqa: E402
import image_rl_plain  # noqa: E402
import kto_vs_trl  # noqa: E402
import media_dpo  # noqa: E402
import ppo_vs_trl  # noqa: E402  (imports without TRL: TRL is imported in its child)
import profile_step  # noqa: E402
import rm_vs_trl  # noqa: E402
import sft_packing  # noqa: E402
import sft_vs_trl  # noqa: E402
import trl_child  # noqa: E402, F401  (imports without TRL: TRL is imported inside main)
import zero3_one_process  # noqa: E402

from align_anything.training.batching import step_indices  # noqa: E402


def test_plain_diffusion_dpo_loss_by_hand() -> None:
    """logits = (ref_w - ref_l) - (θ_w - θ_l); loss = -log σ(β·logits), the batch mean."""
    import torch

    t = torch.tensor
    loss, logits = diffusion_dpo_plain.dpo_loss(
        t([0.1, 0.5]), t([0.3, 0.5]), t([0.2, 0.4]), t([0.2, 0.4]), beta=10.0
    )
    # pair 1: (0.2 - 0.2) - (0.1 - 0.3) = 0.2, -log σ(2) = 0.126928; pair 2: 0, ln 2 = 0.693147
    assert logits.tolist() == pytest.approx([0.2, 0.0])
    assert loss.item() == pytest.approx((0.126928 + 0.693147) / 2, abs=1e-6)


def test_training_order_is_the_trainers_step_batches() -> None:
    order = common.training_order(12, batch=4, steps=3, seed=42)
    assert sorted(order) == list(range(12))  # one epoch: every row once
    for step in range(3):
        expected = step_indices(12, global_batch=4, seed=42, epoch=0, step=step)
        assert order[step * 4 : (step + 1) * 4] == expected


def test_rows_are_the_first_n_of_the_builtin_sets() -> None:
    pairs = common.preference_rows("arith-pref", 3)
    first = common.read_jsonl(common.builtin_path("arith-pref"))[0]
    assert pairs[0]["prompt"] == [{"role": "user", "content": first["prompt"]}]
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": first["chosen"]}]
    assert len(pairs) == 3
    with pytest.raises(SystemExit, match="fewer than"):
        common.preference_rows("arith-pref", 10_000)
    chat = common.conversation_rows("arith-sft", 2)[1]
    record = common.as_prompt_completion(chat)
    assert record["prompt"] + record["completion"] == chat["messages"]
    with pytest.raises(ValueError, match="ends with its only assistant turn"):
        common.as_prompt_completion({"messages": chat["messages"][:1]})


@pytest.mark.parametrize("module", [dpo_vs_trl, sft_vs_trl])
def test_setup_orders_rows_and_counts_tokens(module) -> None:
    setup = module.build_setup(steps=2, batch=2, max_length=128, learning_rate=1e-5)
    order = common.training_order(4, batch=2, steps=2)
    assert len(setup.trl_rows) == len(setup.token_lengths) == 4
    if module is dpo_vs_trl:
        assert setup.trl_rows == [setup.ours_rows[i] for i in order]
        assert setup.tokens == sum(sum(pair) for pair in setup.token_lengths)
    else:
        assert setup.trl_rows == [common.as_prompt_completion(setup.ours_rows[i]) for i in order]
        assert setup.tokens == sum(length for length, _ in setup.token_lengths)
    assert setup.tokens > 4 * 30  # SmolLM2's template adds a ~30-token system prompt


def test_kto_setup_pairs_kl_completions_as_both_trainers_do() -> None:
    setup = kto_vs_trl.build_setup(steps=2, batch=4, max_length=128, learning_rate=1e-5)
    order = common.training_order(8, batch=4, steps=2)
    assert setup.trl_rows == [setup.ours_rows[i] for i in order]
    assert {r["label"] for r in setup.ours_rows} == {True, False}  # both kinds in the rows
    assert setup.tokens == sum(sum(pair) for pair in setup.token_lengths)
    # Row k of each batch (training order) borrows the completion of row k - 1, the first row
    # the last one's: TRL's rotation of its sequential batches.
    prompts, completions = [10, 20, 30, 40], [1, 2, 3, 4]
    assert kto_vs_trl.kl_partner_lengths(
        [2, 0, 3, 1], prompts, completions, batch=2, max_length=128
    ) == [30 + 1, 10 + 3, 40 + 2, 20 + 4]
    # Cut at max_length, as both trainers cut a KL sequence.
    assert kto_vs_trl.kl_partner_lengths(
        [2, 0, 3, 1], prompts, completions, batch=2, max_length=42
    ) == [30 + 1, 10 + 3, 42, 20 + 4]


def test_step_differences_compare_every_logged_step() -> None:
    ours = _record("ours", 1.0, 1.0, 0.5)
    ours.steps = [{"kl": 0.0}, {"kl": 0.25}]
    peer = _record("peer", 1.0, 1.0, 0.5)
    peer.steps = [{"kl": 0.0}, {"kl": 0.2501}]
    worst, compared = common.step_differences({"ours": [ours], "peer": [peer]}, "ours", ("kl",))[
        "kl"
    ]
    assert worst == pytest.approx(1e-4) and compared == 4


def _record(name: str, seconds: float, rss: float, loss: float) -> common.RunRecord:
    return common.RunRecord(name, seconds, [seconds], 0, rss, {"loss": loss})


def test_summary_table_ratios() -> None:
    records = {
        "ours": [_record("ours", 10.0, 1000.0, 0.5), _record("ours", 12.0, 1100.0, 0.5)],
        "peer": [_record("peer", 30.0, 1200.0, 0.5), _record("peer", 33.0, 1300.0, 0.5)],
    }
    table = common.summary_table(
        records, steps=2, tokens=1000, ours="ours", metrics=[("l", "loss")]
    )
    ours_row, peer_row = table.splitlines()[2:]
    # Medians: ours 11 s, 1050 MiB; peer 31.5 s, 1250 MiB.
    assert ours_row.split(" | ")[1:4] == ["0.1818", "90.9", "1050"]
    assert peer_row.split(" | ")[4:6] == ["2.86×", "0.84"]


def test_gpu_flops_and_peaks() -> None:
    # 6·N + 12·layers·hidden·seq: 6·1e9 + 12·24·1536·2048.
    assert gpu_bench.flops_per_token(10**9, layers=24, hidden=1536, seq_len=2048) == (
        6e9 + 12 * 24 * 1536 * 2048
    )
    assert gpu_bench.peak_tflops("NVIDIA H200") == 989.4
    assert gpu_bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_bench.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_bench.peak_tflops("Some Future GPU") is None


def test_sft_packing_setup_packs_the_same_rows_for_both_sides() -> None:
    sample = Path(__file__).resolve().parent / "data" / "hh-rlhf-harmless-base-test-sample.jsonl.gz"
    setup = sft_packing.PackingSetup(
        rows=40, steps=2, batch=2, max_length=256, learning_rate=1e-4,
        model="tiny-random-llama", source=sample,
    )  # fmt: skip
    packed, plain = setup.packed, setup.unpacked
    assert len(packed.ours_rows) == 40 and packed.trl_rows == packed.ours_rows  # file order
    first = packed.ours_rows[0]["messages"]
    assert first[0]["role"] == "user" and first[-1]["role"] == "assistant"
    # The bins both sides train on, in align_anything's order of packed sequences.
    assert packed.extra_spec["bin_order"] == common.training_order(setup.num_bins, batch=2, steps=2)
    assert all(sum(b) <= 256 for b in setup.bin_lengths) and len(setup.bin_lengths) == 4
    assert packed.tokens == sum(map(sum, setup.bin_lengths))
    # The unpacked run holds exactly the rows of those packed sequences.
    assert len(plain.ours_rows) == sum(len(b) for b in setup.bin_lengths)
    assert plain.batch == len(plain.ours_rows) // 2
    assert "sft.packing=true" in packed.extra_overrides
    assert "sft.packing=true" not in plain.extra_overrides


def test_data_scale_rows_are_all_different_and_numbered(tmp_path: Path) -> None:
    import json

    pairs = data_scale.hh_pairs(data_scale.HH_SAMPLE)
    assert pairs and all(p["prompt"][-1]["role"] == "user" for p in pairs)
    path = data_scale.write_rows(pairs[:3], 7, tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 7 and len({json.dumps(r) for r in rows}) == 7  # repeats differ
    first_user = next(m for m in rows[4]["prompt"] if m["role"] == "user")
    assert first_user["content"].startswith("(row 4) ")
    assert rows[4]["chosen"] == pairs[1]["chosen"]  # row 4 repeats pair 4 % 3
    record = {"seconds": 2.0, "baseline_rss_mib": 100.0, "peak_rss_mib": 150.0, "load": 1.0}
    table = data_scale.table({1000: {"ours": record, "cached": {**record, "seconds": 0.5},
                                     "trl": {**record, "seconds": 4.0}}})  # fmt: skip
    assert "| 1,000 | 2.0 | 0.50 | 4.0 | 0.50x | 0.125x | 150 / 150 / 150 | 50 / 50 |" in table


def assert_scored_as_by_hand(net, sequences: list, advantages: list, ours: dict) -> None:
    """The reference of both GRPO agreement checks: for each (prompt ids, completion ids, extra
    forward inputs), log_softmax of the full forward at each completion position equals ours;
    on-policy (ratio 1), the dapo loss is -Σ advantage over completion tokens / their count."""
    import torch

    tokens, weighted = 0, 0.0
    for b, (prompt, completion, extra) in enumerate(sequences):
        with torch.no_grad():
            logits = net(input_ids=torch.tensor([[*prompt, *completion]]), **extra).logits[0]
        logp = torch.log_softmax(logits.double(), -1)
        want = [float(logp[len(prompt) + j - 1, t]) for j, t in enumerate(completion)]
        assert ours["logps"][b] == pytest.approx(want, abs=1e-5)
        tokens += len(completion)
        weighted += advantages[b] * len(completion)
    assert ours["loss"] == pytest.approx(-weighted / tokens, abs=1e-6)


def test_grpo_fixed_completions_scored_as_by_hand() -> None:
    """The align_anything side of grpo_vs_trl's agreement check (TRL's side needs trl) against a
    hand-written reference: log_softmax of the full forward at each completion position, and,
    on-policy (ratio 1), the dapo loss -Σ advantage over completion tokens / their count."""
    import torch

    from align_anything.families.language.loading import load_model
    from align_anything.families.zoo import resolve_model_path

    fixed = grpo_vs_trl.fixed_completions("tiny-random-llama")
    group = len(grpo_vs_trl.FIXED_ANSWERS)
    assert len(fixed["completion_ids"]) == 2 * group
    # Only the first answer of each group is exact: advantage (1 - 1/4) / std for it.
    advantages = torch.tensor(fixed["advantages"]).view(2, group)
    assert (advantages[:, 0] > 0).all() and (advantages[:, 1:] < 0).all()
    ours = grpo_vs_trl.ours_score("tiny-random-llama", fixed)
    net = load_model(resolve_model_path("tiny-random-llama"), dtype=torch.float32, reward=False)
    sequences = [(prompt, completion, {}) for prompt, completion
                 in zip(fixed["prompt_ids"], fixed["completion_ids"], strict=True)]  # fmt: skip
    assert_scored_as_by_hand(net, sequences, fixed["advantages"], ours)


def test_the_vlm_grpo_benchmarks_sides_share_the_settings(tmp_path: Path) -> None:
    """`grpo_vlm_vs_trl.py`: align_anything's side validates as a run of the built-in
    image-text model on picture rows, and TRL's side gets the same reward, batch and limits."""
    from argparse import Namespace

    from align_anything.config import load_config

    args = Namespace(model="llava-smollm2-shapes", steps=2, prompts=2, num_generations=4,
                     max_completion_length=8, learning_rate=3e-5)  # fmt: skip
    cfg = load_config(grpo_vlm_vs_trl.ours_overrides(args, tmp_path / "rows.jsonl"))
    assert cfg.reward.functions == ["align_anything.rewards:shapes_answer"]
    assert (cfg.model.name_or_path, cfg.train.per_device_batch_size) == (args.model, 8)
    assert (cfg.grpo.num_generations, cfg.grpo.max_completion_length) == (4, 8)
    spec = grpo_vlm_vs_trl.trl_spec(args, tmp_path / "rows.jsonl")
    assert (spec["images"], spec["reward"], spec["batch"]) == (True, "shapes_answer", 8)
    assert (spec["num_generations"], spec["max_completion_length"]) == (4, 8)
    assert spec["max_length"] == cfg.data.max_length
    assert "shapes_answer" in trl_child.REWARD_FUNCTIONS


def test_trl_gets_the_models_chat_template_extended_to_content_blocks() -> None:
    """TRL's multimodal messages (content blocks) render as align_anything's picture rows: the
    image marker on its own line before the question; plain strings as the model's own
    template renders them."""
    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    own = tokenizer.chat_template
    from align_anything.families.language.vlm_shapes import content_block_template

    extended = content_block_template(own)
    question = "Which shape is in the picture? Answer with one word."
    as_string = [{"role": "user", "content": "<image>\n" + question}]
    blocks = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]

    def render(messages: list, template: str) -> str:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip

    assert render(as_string, extended) == render(as_string, own)
    assert render(blocks, extended) == render(as_string, own)


def test_vlm_grpo_fixed_completions_scored_as_by_hand(tmp_path: Path) -> None:
    """The align_anything side of grpo_vlm_vs_trl's agreement check (TRL's side needs trl), on
    the tiny LLaVA, against a hand-written reference: each completion's own row (prompt with
    its picture's placeholders, completion) through the model with the picture's pixels,
    log_softmax at each completion position; on-policy, the dapo loss -Σ advantage over
    completion tokens / their count. Only the right one-word answer is rewarded."""
    import torch
    from PIL import Image

    from align_anything.families.language.loading import load_model, load_processor
    from align_anything.families.zoo import resolve_model_path

    model = "tiny-random-llava"
    rows = grpo_vlm_vs_trl.picture_rows(2, tmp_path)
    fixed = grpo_vlm_vs_trl.fixed_completions(rows, model)
    group = len(grpo_vlm_vs_trl.FIXED_ANSWERS)
    assert len(fixed["completion_ids"]) == 2 * group
    ours = grpo_vlm_vs_trl.ours_score(rows, fixed, max_completion_length=8, model=model)
    assert ours["rewards"] == [1.0, 0.0, 0.0, 0.0] * 2
    assert ours["shared_prompt"]
    path = resolve_model_path(model)
    processor = load_processor(str(path))
    net = load_model(path, dtype=torch.float32, reward=False)
    sequences = []
    for b, completion in enumerate(fixed["completion_ids"]):
        prompt = ours["prompt_ids"][b // group]
        assert prompt.count(processor.image_token_id) > 0
        picture = Image.open(rows[b // group]["images"][0]).convert("RGB")
        pixels = processor.image_processor(images=[picture], return_tensors="pt")["pixel_values"]
        sequences.append((prompt, completion, {"pixel_values": pixels}))
    assert_scored_as_by_hand(net, sequences, ours["advantages"], ours)


def test_the_ppo_benchmarks_side_is_a_valid_run_with_the_shared_settings(tmp_path: Path) -> None:
    """align_anything's side of ppo_vs_trl.py validates as a run config and carries the
    settings TRL's side gets (one completion per prompt, one step per rollout, the KL, clips,
    GAE)."""
    from argparse import Namespace

    from align_anything.config import load_config

    args = Namespace(model="tiny-random-llama", steps=2, batch=4, max_completion_length=8,
                     learning_rate=1e-5, rows="hh")  # fmt: skip
    reward_model = tmp_path / "rm"
    reward_model.mkdir()
    cfg = load_config(ppo_vs_trl.ours_overrides(args, tmp_path / "rows.jsonl", reward_model))
    assert cfg.data.max_length == 512 - 8  # the long prompts leave room for the completion
    args.rows = "arith"
    cfg = load_config(ppo_vs_trl.ours_overrides(args, tmp_path / "rows.jsonl", reward_model))
    assert cfg.data.max_length == 256
    s = ppo_vs_trl.SETTINGS
    assert (cfg.ppo.num_generations, cfg.ppo.round_steps()) == (1, (1, 1))
    assert (cfg.ppo.kl_coef, cfg.ppo.epsilon, cfg.ppo.value_clip) == (
        s["kl_coef"],
        s["epsilon"],
        s["value_clip"],
    )
    assert (cfg.ppo.gamma, cfg.ppo.lam, cfg.ppo.critic_init) == (
        s["gamma"],
        s["lam"],
        "reward_model",
    )
    assert cfg.reward.model == str(reward_model) and cfg.train.per_device_batch_size == 4


def test_diffusion_dpo_benchmark_gives_both_sides_the_same_work(tmp_path: Path) -> None:
    """align_anything's overrides validate, and carry the steps, batch, beta and rate the plain
    loop is given; the loop's own defaults are the framework's clipping and no weight decay."""
    from align_anything.config import load_config

    args = diffusion_dpo.parse_args(["--steps", "7", "--batch", "3", "--beta", "500"])
    overrides = diffusion_dpo.ours_overrides(args, tmp_path / "out", tmp_path / "cache")
    cfg = load_config([o for o in overrides if not o.startswith("output_dir=")])
    plain = diffusion_dpo_plain.parse_args(diffusion_dpo.plain_command(args, "model", tmp_path)[2:])
    assert (cfg.train.max_steps, cfg.train.per_device_batch_size) == (plain.steps, plain.batch)
    assert (cfg.diffusion_dpo.beta, cfg.train.learning_rate) == (plain.beta, plain.lr)
    assert (cfg.train.max_grad_norm, cfg.train.weight_decay) == (
        plain.max_grad_norm, plain.weight_decay,
    )  # fmt: skip
    assert cfg.train.lr_scheduler == plain.lr_scheduler == "constant"
    assert plain.warmup_steps == 0 and cfg.train.warmup_ratio == 0.0


def test_zero3_one_process_ratios_are_medians_over_the_baselines() -> None:
    """Step-loop time is the sum of the logged step times; each variant's median over repeats
    divided by ZeRO-0's median."""

    def run(steps: list[float], rss: float) -> common.RunRecord:
        return common.RunRecord("x", seconds=99.0, step_seconds=steps, tokens=0,
                                peak_rss_mib=rss, first_step={})  # fmt: skip

    records = {
        "z0": [run([4.0, 6.0], 1000.0), run([5.0, 5.0], 3000.0), run([6.0, 6.0], 2000.0)],
        "z3": [run([6.0, 6.0], 2200.0), run([9.0, 9.0], 3300.0), run([6.0, 9.0], 1100.0)],
    }
    assert zero3_one_process.step_loop_seconds(records["z3"][2]) == 15.0
    found = zero3_one_process.ratios(records)
    assert found["z0"] == (1.0, 1.0)
    # z0 medians: 10 s, 2000 MiB; z3: 15 s, 2200 MiB.
    assert found["z3"] == pytest.approx((1.5, 1.1))
    variants = zero3_one_process.variants(576)
    assert variants["z0"] == ["deepspeed=z0"]
    assert (
        "deepspeed.zero_optimization.stage3_param_persistence_threshold=5760"
        in (variants["z3 h-buckets"])
    )


def test_rm_setup_takes_hh_pairs_that_fit_in_order() -> None:
    rows = common.long_pairs(4, max_length=512, source=common.HH_SAMPLE)
    assert all(m["role"] in ("user", "assistant") for r in rows for m in r["prompt"])
    assert all(r["prompt"][-1]["role"] == "user" and r["chosen"] != r["rejected"] for r in rows)
    setup = rm_vs_trl.build_setup(steps=2, batch=2, max_length=512, learning_rate=1e-5, rows=rows)
    order = common.training_order(4, batch=2, steps=2)
    assert setup.task == "rm" and setup.trl_rows == [rows[i] for i in order]
    assert all(max(pair) <= 512 for pair in setup.token_lengths)
    assert setup.tokens == sum(sum(pair) for pair in setup.token_lengths)
    # Multi-turn HH prompts: each sequence holds its prompt, so the tokens exceed the system
    # prompt's ~30 per sequence by far.
    assert setup.tokens > 4 * 2 * 60
    with pytest.raises(SystemExit, match="within 16 tokens"):
        common.long_pairs(1, max_length=16, source=common.HH_SAMPLE)
    with pytest.raises(SystemExit, match="hh rows only"):
        rm_vs_trl.build_setup(steps=2, batch=2, max_length=512, learning_rate=1e-5,
                              row_set="arith")  # fmt: skip


def test_rm_saved_head_loads_unchanged_in_both_loaders(tmp_path: Path) -> None:
    """Both trainers start from the saved head: neither loader draws a new one."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from align_anything.families.language.loading import load_model

    folder = rm_vs_trl.seeded_reward_model(tmp_path / "rm", model="tiny-random-llama")
    torch.manual_seed(123)  # another RNG state: a newly drawn head would differ
    ours = load_model(str(folder), reward=True, dtype=torch.float32)
    theirs = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    again = rm_vs_trl.seeded_reward_model(tmp_path / "rm2", model="tiny-random-llama")
    first = AutoModelForSequenceClassification.from_pretrained(again, num_labels=1)
    assert torch.equal(ours.score.weight, theirs.score.weight)
    assert torch.equal(first.score.weight, theirs.score.weight)  # the seed decides the head
    assert float(theirs.score.weight.detach().abs().sum()) > 0


def test_long_rows_are_the_first_multi_turn_hh_pairs_that_fit() -> None:
    """The hh row set: in file order, every multi-turn pair with two different answers whose
    prompt + longer answer fits, none skipped, none sampled; SFT and KTO take the same pairs."""
    from align_anything.families.language.encode import encode_preference
    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    rows = common.long_pairs(12, max_length=300, source=common.HH_SAMPLE)
    assert rows == common.long_pairs(12, max_length=300, source=common.HH_SAMPLE)
    tokenizer = load_tokenizer(resolve_model_path(common.MODEL))
    expected = []
    for pair in common.hh_pairs(common.HH_SAMPLE):
        turns = sum(m["role"] == "user" for m in pair["prompt"])
        fits = encode_preference([pair], tokenizer, max_length=300)[0]
        if turns >= 2 and pair["chosen"] != pair["rejected"] and fits:
            expected.append(pair)
    assert rows == expected[:12]
    assert all(common.user_turns(r["prompt"]) >= 2 for r in rows)
    conversations = common.long_conversations(rows)
    assert conversations[3]["messages"] == rows[3]["prompt"] + rows[3]["chosen"]
    unpaired = common.long_unpaired(rows)
    assert [r["label"] for r in unpaired[:4]] == [True, False, True, False]
    assert unpaired[0]["completion"] == rows[0]["chosen"]
    assert unpaired[1]["completion"] == rows[1]["rejected"]
    assert unpaired[1]["prompt"] == rows[1]["prompt"]


def test_long_row_setups_count_the_tokens_each_trainer_sees() -> None:
    """SFT on hh rows gives TRL align_anything's own ids and labels; KTO's KL sequences are cut
    at max_length; each setup's per-row tokens add up to its token count."""
    sft = sft_vs_trl.build_setup(steps=2, batch=2, max_length=512, learning_rate=1e-5,
                                 row_set="hh")  # fmt: skip
    assert len(sft.trl_rows) == 4 and set(sft.trl_rows[0]) == {"input_ids", "labels"}
    assert [len(r["input_ids"]) for r in sft.trl_rows] == sft.row_tokens
    assert [sum(t != -100 for t in r["labels"]) for r in sft.trl_rows] == [
        answer for _, answer in sft.token_lengths
    ]
    assert sft.tokens == sum(sft.row_tokens) and max(sft.row_tokens) <= 512
    assert sum(sft.row_tokens) > 4 * 100  # multi-turn conversations, not arithmetic rows
    kto = kto_vs_trl.build_setup(steps=2, batch=4, max_length=512, learning_rate=1e-5,
                                 row_set="hh")  # fmt: skip
    assert {r["label"] for r in kto.ours_rows} == {True, False}
    assert all(max(pair) <= 512 for pair in kto.token_lengths)
    assert kto.row_tokens == [sum(pair) for pair in kto.token_lengths]
    dpo = dpo_vs_trl.build_setup(steps=1, batch=2, max_length=512, learning_rate=1e-5,
                                 row_set="hh")  # fmt: skip
    assert dpo.ours_rows == common.long_pairs(2, max_length=512)
    assert dpo.tokens == sum(dpo.row_tokens)


def test_flop_arithmetic(tmp_path: Path) -> None:
    """6·N·tokens over the training time, and over steps 2..N with their own tokens; N read
    from the safetensors headers (a tied embedding counted once)."""
    import torch
    from safetensors.torch import save_file

    save_file({"embed": torch.zeros(10, 4), "norm": torch.zeros(4)}, tmp_path / "a.safetensors")
    save_file({"score": torch.zeros(1, 4)}, tmp_path / "b.safetensors")
    assert common.parameter_count(tmp_path) == 40 + 4 + 4
    with pytest.raises(SystemExit, match="no \\*.safetensors"):
        common.parameter_count(tmp_path / "missing")
    # 6 · 1e8 · 1000 tokens in 2 s = 300 GFLOP/s.
    assert common.model_gflops(10**8, 1000, 2.0) == pytest.approx(300.0)
    assert common.step_tokens([1, 2, 3, 4, 5, 6], batch=2) == [3, 7, 11]
    record = common.RunRecord("ours", 10.0, [4.0, 3.0, 2.0], 0, 100.0, {"loss": 0.5})
    # Steps 2..3: 18 tokens in 5 s.
    assert common.steady_gflops(record, [3, 7, 11], 10**8) == pytest.approx(6e8 * 18 / 5 / 1e9)
    assert common.steady_seconds(record) == 2.5
    one_step = common.RunRecord("ours", 4.0, [4.0], 0, 100.0, {"loss": 0.5})
    assert common.steady_gflops(one_step, [3], 10**8) == pytest.approx(6e8 * 3 / 4 / 1e9)


def test_summary_table_rates_and_the_line_against_trl() -> None:
    ours = common.RunRecord("ours", 10.0, [6.0, 4.0], 0, 1000.0, {"loss": 0.5})
    fast = common.RunRecord("TRL no-GC", 20.0, [12.0, 8.0], 0, 2000.0, {"loss": 0.5})
    slow = common.RunRecord("TRL defaults", 30.0, [15.0, 15.0], 0, 1250.0, {"loss": 0.5})
    records = {"ours": [ours], "TRL no-GC": [fast], "TRL defaults": [slow]}
    rates = common.Rates(params=10**8, matmul_gflops=200.0, threads=2)
    table = common.summary_table(records, steps=2, tokens=1000, ours="ours",
                                 metrics=[("l", "loss")], rates=rates, per_step=[600, 400])  # fmt: skip
    ours_row, fast_row, _ = (line.split(" | ") for line in table.splitlines()[2:])
    # ours: 6e8 · 1000 / 10 s = 60 GFLOP/s, 30% of 200; step 2: 400 tokens in 4 s = 60 too.
    assert ours_row[7:11] == ["60.0", "30%", "60.0", "30%"]
    # TRL no-GC: 2.00× over the run, 8 s against 4 s per steady step, 30 GFLOP/s.
    assert fast_row[4:11] == ["2.00×", "0.50", "2.00×", "30.0", "15%", "30.0", "15%"]
    line = common.against_trl(records, "ours", ["TRL no-GC", "TRL defaults"])
    assert "fastest configuration here (TRL no-GC): 2.00× over the training time" in line
    assert "2.00× per steady step; peak RSS 0.50× its, 0.80× TRL defaults'" in line


def test_profile_tables_split_the_step_as_timed() -> None:
    """The regions add up to the step (the rest is "other"); the decoder's forward is taken out
    of the loss and KL regions it ran in; padding against one padded row per sequence."""
    regions = profile_step.Regions()
    regions.seconds.update(data=0.5, kl=2.0, loss=3.0, backward=4.0, optimizer=0.25)
    regions.cpu.update(data=1.0, kl=4.0, loss=6.0, backward=8.0, optimizer=0.5)
    regions.decoder.update(kl=1.5, loss=2.5)
    regions.decoder_cpu.update(kl=3.0, loss=5.0)
    table = profile_step.step_table(regions, total=(10.0, 20.0))
    assert "| KL pass: LM head, log-probs, KL point | 0.50 | 1.00 | 5% |" in table
    assert "| forward: decoder (30 layers) | 2.50 | 5.00 | 25% |" in table
    assert "| logits + loss (LM head, log-softmax, gather, loss) | 0.50 | 1.00 | 5% |" in table
    assert "| other (metrics, bookkeeping) | 0.25 | 0.50 | 2% |" in table  # 20 - 19.5
    regions.decoder["kl"] = 0.0  # (SFT: no KL pass)
    assert "KL pass" not in profile_step.step_table(regions, total=(10.0, 20.0))
    # Three sequences of 10, 30 and 20 tokens in rows of 30: 90 positions, a third padding.
    assert profile_step.padding_rows([10, 30, 20]) == (90, 60)
    with regions.region("loss"):
        assert regions.current == "loss"
    assert regions.current == "other" and regions.seconds["loss"] > 3.0


def test_image_rl_plain_losses_by_hand() -> None:
    """The plain loop's maths on numbers worked by hand: DiffusionNFT's eq. 8, Flow-GRPO's SDE
    step (its mean written both ways) and log-density, the group advantages."""
    import math

    import torch

    one = lambda x: torch.full((1, 1, 1, 1), float(x))  # noqa: E731
    # v+ = (1 - β) v_old + β v_θ, v- = (1 + β) v_old - β v_θ; β = 0.5, v_θ = 1, v_old = 0.5,
    # v = 0, r = 0.75: v+ = 0.75, v- = 0.25, loss = 0.75·0.5625 + 0.25·0.0625.
    loss = image_rl_plain.nft_loss(one(1), one(0.5), one(0), torch.tensor([0.75]), beta=0.5)
    assert loss.item() == pytest.approx(0.4375)
    # σ_k = 0.5 -> 0.25, a = 0.7: σ_t = 0.7, dt = -0.25; x + (v + σ_t²/(2σ_k)·(x + (1 - σ_k)·v))·dt
    # = 1 + (2 + 0.49·2)·(-0.25) = 0.255; std 0.7·√0.25 = 0.35.
    mean, std = image_rl_plain.sde_step(
        one(1), one(2), torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor(0.9), 0.7
    )
    assert (mean.item(), std.item()) == (pytest.approx(0.255), pytest.approx(0.35))
    # At σ_k = 1 the denominator takes σ_1: σ_t = 0.7·√(1 / 0.1), std σ_t·√(1 - 0.9).
    _, first = image_rl_plain.sde_step(
        one(0), one(0), torch.tensor([1.0]), torch.tensor([0.9]), torch.tensor(0.9), 0.7
    )
    assert first.item() == pytest.approx(0.7 * math.sqrt(10) * math.sqrt(0.1))
    logp = image_rl_plain.gaussian_log_prob(mean + std, mean, std)
    assert logp.item() == pytest.approx(-0.5 - math.log(0.35) - 0.5 * math.log(2 * math.pi))
    # Rewards 1, 0, 0, 0: mean 0.25, unbiased std 0.5; the cap clips.
    advantages = image_rl_plain.group_advantages(torch.tensor([1.0, 0, 0, 0]), 4, cap=1.2)
    assert advantages.tolist() == pytest.approx(
        [1.2, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001]
    )


def test_image_rl_benchmark_gives_both_sides_the_same_work(tmp_path: Path) -> None:
    """ours' overrides validate for both tasks and carry the batch, group, rollout steps, rate
    and KL weight the plain side is given; the plain loop's own defaults are the tasks'."""
    from align_anything.config import load_config

    args = image_rl.parse_args(["--steps", "5", "--prompts", "3", "--group", "4"])
    plain = image_rl_plain.parse_args([])
    for algorithm in image_rl.ALGORITHMS:
        overrides = image_rl.ours_overrides(args, algorithm, tmp_path / "o", tmp_path / "c")
        cfg = load_config([o for o in overrides if not o.startswith("output_dir=")])
        section = cfg.section()
        assert (cfg.train.max_steps, cfg.train.per_device_batch_size) == (5, 12)
        assert (section.num_generations, section.rollout_steps) == (4, args.rollout_steps)
        assert (cfg.train.learning_rate, cfg.train.max_grad_norm, cfg.train.weight_decay) == (
            args.lr, 1.0, 0.0,
        )  # fmt: skip
        assert section.num_iterations == args.num_iterations
        assert (section.adv_clip_max, section.rollout_steps) == (
            plain.adv_clip_max, plain.rollout_steps,
        )  # fmt: skip
        if algorithm == "flow_grpo":
            assert section.beta == args.kl_beta and section.train_fraction == 1.0
            assert (section.noise_level, section.epsilon) == (plain.noise_level, plain.clip)
        else:
            assert (section.beta, section.old_decay) == (plain.nft_beta, plain.old_decay)
            assert section.sample_noise == 0.0 and section.timestep_sampling == "uniform"


def test_image_rl_speed_is_the_median_round_after_the_first() -> None:
    rows = [
        {"round": r, "ours_cpu_s": o, "plain_cpu_s": p, "ours_loss": 0.5, "plain_loss": 0.5,
         "ours_grad_norm": 2.0, "plain_grad_norm": 2.0 + g, "rollout_max_diff": 0.0,
         "rewards_equal": True}
        for r, o, p, g in [(0, 9.0, 1.0, 0.0), (1, 1.0, 1.1, 0.0), (2, 2.0, 2.2, 2e-6),
                           (3, 1.0, 1.2, 0.0)]
    ]  # fmt: skip
    summary = image_rl.summarise(rows, steps_per_round=1)
    assert (summary["ours_cpu_s_per_step"], summary["plain_cpu_s_per_step"]) == (1.0, 1.2)
    assert summary["speed_ours_over_plain"] == pytest.approx(1.2)
    assert summary["max_rel_grad_norm_diff"] == pytest.approx(1e-6, rel=1e-5)


def test_the_grpo_benchmarks_long_rows_are_rewarded_alike_on_both_sides(tmp_path: Path) -> None:
    """`grpo_vs_trl.py --rows hh`: both sides get the same reward (length_penalty, by name for
    TRL's child) and the prompt length that leaves room for the completion."""
    from argparse import Namespace

    from align_anything.config import load_config

    args = Namespace(model="tiny-random-llama", steps=2, prompts=2, num_generations=4,
                     max_completion_length=16, learning_rate=1e-5, rows="hh")  # fmt: skip
    cfg = load_config(grpo_vs_trl.ours_overrides(args, tmp_path / "rows.jsonl"))
    assert cfg.reward.functions == ["align_anything.rewards:length_penalty"]
    assert cfg.data.max_length == 512 - 16
    spec = grpo_vs_trl.trl_spec(args, tmp_path / "rows.jsonl")
    assert (spec["reward"], spec["max_length"]) == ("length_penalty", 512 - 16)
    args.rows = "arith"
    assert grpo_vs_trl.trl_spec(args, tmp_path / "rows.jsonl")["reward"] == "arith_exact"


def test_the_media_benchmark_sets_each_mediums_clip_and_held_out_pairs() -> None:
    """`media_dpo.py`: video runs sample frames, audio runs cut clips, and both hold out the
    pairs themselves (the task's default held-out set is the built-in image pairs)."""
    video = media_dpo.parse_args([])
    assert (video.model, video.data) == ("tiny-t2v-shapes", "t2v-shapes-pref")
    assert media_dpo.medium_overrides(video) == [
        "data.num_frames=9", "data.fps=8.0", "data.resolution=32",
        "data.eval_path=t2v-shapes-pref"]  # fmt: skip
    audio = media_dpo.parse_args(["--medium", "audio"])
    assert (audio.model, audio.data) == ("tiny-t2a-tones", "t2a-tones-pref")
    assert media_dpo.medium_overrides(audio) == ["data.eval_path=t2a-tones-pref"]
    audio = media_dpo.parse_args(["--medium", "audio", "--model", "tiny-random-audioldm",
                                  "--data", "p.jsonl", "--audio-seconds", "0.64"])  # fmt: skip
    assert media_dpo.medium_overrides(audio) == [
        "data.audio_seconds=0.64",
        "data.eval_path=p.jsonl",
    ]
