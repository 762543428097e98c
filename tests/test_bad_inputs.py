"""The bad-input catalogue: each case goes through the real entry point (`align_anything.train.
main`, in-process, hub offline) and must end with exit status 2, one message naming the key,
file, row or value at fault, no traceback, and no training step. test_cli_errors.py holds
eleven more (typos, unknown task/preset, missing model/dataset/column, batch arithmetic, ...).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, copy_tiny_model

from align_anything.train import main

TINY = "model.name_or_path=tiny-random-llama"


# Hub offline and no inherited rank variables (fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("in_process_offline")


def _conversation(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": assistant}]}  # fmt: skip


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of broken presets, datasets and models."""
    root = tmp_path_factory.mktemp("bad")
    (root / "dup.json").write_text('{"zero_optimization": {"stage": 0}, "zero_optimization": {}}')
    (root / "syntax.json").write_text('{"zero_optimization": {"stage": 0},}')
    (root / "list.json").write_text("[1, 2]")
    (root / "scheduler.json").write_text(
        json.dumps({"zero_optimization": {"stage": 0}, "scheduler": {"type": "WarmupLR"}})
    )
    (root / "empty.jsonl").write_text("")
    (root / "corrupt.jsonl").write_text('not json at all\n{"messages": [}\n')
    rows = [_conversation(f"hi {i}", "") for i in range(20)]
    (root / "empty_completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [_conversation("hi " * 50, "yo") for _ in range(20)]
    (root / "long_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "pairs.csv").write_text("query,answer\nq,a\n")
    (root / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    (root / "no_data").mkdir()
    (root / "no_model").mkdir()
    template = copy_tiny_model(root / "no_template") / "chat_template.jinja"
    template.unlink()
    _write_unreadable_data_files(root)
    _write_margin_files(root)
    _write_part_lists(root)
    _write_remote_code_models(root)
    _write_image_sets(root)
    return root


def _write_image_sets(root: Path) -> None:
    """Text-to-image data with bad rows: an image folder whose metadata names a missing image
    and gives another an empty caption; Pick-a-Pic pairs with a label outside {0, 0.5, 1}."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buffer, format="PNG")
    folder = root / "t2i_folder"
    folder.mkdir()
    (folder / "a.png").write_bytes(buffer.getvalue())
    (folder / "b.png").write_bytes(buffer.getvalue())
    rows = [{"file_name": "a.png", "text": "a red square"}, {"file_name": "gone.png", "text": "x"},
            {"file_name": "b.png", "text": ""}]  # fmt: skip
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = [{"caption": "a red square", "jpg_0": "t2i_folder/a.png", "jpg_1": "t2i_folder/b.png",
              "label_0": label} for label in (1, 2)]  # fmt: skip
    (root / "t2i_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))


def _write_unreadable_data_files(root: Path) -> None:
    """JSONL files `datasets` cannot read, each with a blank line (which pyarrow's row numbers
    skip) before the bad line, so only a message that counts lines gets the number right."""
    lines = [json.dumps(_conversation(f"hi {i}", "yo")) for i in range(50)]
    lines.insert(3, "")
    (root / "truncated.jsonl").write_text("\n".join([*lines[:50], lines[50][:30]]))
    cut = [*lines[:11], lines[11][:30], *lines[12:]]
    (root / "cut_line.jsonl").write_text("\n".join(cut) + "\n")
    latin1 = json.dumps(_conversation("café", "yo"), ensure_ascii=False).encode("latin-1")
    (root / "latin1.jsonl").write_bytes(
        "\n".join(lines[:6]).encode() + b"\n" + latin1 + b"\n" + "\n".join(lines[6:]).encode()
    )


def _write_margin_files(root: Path) -> None:
    def pairs(margins: list) -> str:
        rows = [{"prompt": f"q{i}", "chosen": "good", "rejected": "bad"} for i in range(20)]
        for row, margin in zip(rows, margins, strict=False):
            if margin != "absent":
                row["margin"] = margin
        return "".join(json.dumps(r) + "\n" for r in rows)

    (root / "margin_text.jsonl").write_text(pairs(["high"] * 20))
    (root / "margin_nan.jsonl").write_text(pairs([0.5, 1.0, 0.5, float("nan")] + [1.0] * 16))
    (root / "margin_missing.jsonl").write_text(pairs([0.5, 1.0, "absent"] + [1.0] * 17))


def _write_part_lists(root: Path) -> None:
    def rows(content: list) -> str:
        row = {"messages": [{"role": "user", "content": content},
                            {"role": "assistant", "content": "yo"}]}  # fmt: skip
        return "".join(json.dumps(row) + "\n" for _ in range(20))

    image = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "cat.png"}}]  # fmt: skip
    (root / "image_parts.jsonl").write_text(rows(image))
    (root / "parts_without_text.jsonl").write_text(rows([{"type": "text", "content": "hi"}]))


def _write_remote_code_models(root: Path) -> None:
    """Model folders whose config.json transformers cannot use without the folder's own code."""
    remote = copy_tiny_model(root / "remote_code")
    config = json.loads((remote / "config.json").read_text())
    config["model_type"] = "my_llama"
    config["auto_map"] = {"AutoConfig": "configuration_my.MyConfig",
                          "AutoModelForCausalLM": "modeling_my.MyForCausalLM"}  # fmt: skip
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "configuration_my.py").write_text("raise SystemExit('remote code ran')\n")
    unknown = copy_tiny_model(root / "unknown_type")
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "foo_bar"
    (unknown / "config.json").write_text(json.dumps(config))


# (id, overrides, fragments the message must contain); {bad} is the fixture's folder.
CASES = [
    ("wrong-type", ["task=sft", "train.learning_rate=abc"],
     ["train.learning_rate", "'abc'", "valid number"]),
    ("negative-lr", ["task=sft", "train.learning_rate=-1"],
     ["train.learning_rate", "greater than 0", "-1"]),
    ("max-steps-below-minus-one", ["task=sft", "train.max_steps=-5"],
     ["train.max_steps", "-5"]),
    # 0 once trained whole epochs, as -1 does (the tiny model: a quick run if it is accepted).
    ("max-steps-zero", ["task=sft", TINY, "train.max_steps=0"],
     ["train.max_steps: must be a number of optimizer steps >= 1, or -1 to run `train.epochs` "
      "epochs (given: 0)"]),
    # fp16 on a CPU once failed in DeepSpeed after the model had loaded (issue #38 case 12).
    ("fp16-on-cpu", ["task=sft", TINY, "train.precision=fp16"],
     ["train.precision=fp16, but this device (cpu) trains in bf16 or fp32 only",
      "set train.precision=fp32"]),
    ("fp16-preset-on-cpu", ["task=dpo", TINY, "deepspeed.fp16.enabled=true"],
     ["the preset enables fp16, but this device (cpu) trains in bf16 or fp32 only"]),
    ("zero-micro-batch", ["task=sft", "train.per_device_batch_size=0"],
     ["train.per_device_batch_size", "positive integer or 'auto'", "given: 0"]),
    ("eval-fraction-over-one", ["task=sft", "data.eval_fraction=1.5"],
     ["data.eval_fraction", "1.5"]),
    ("unknown-precision", ["task=sft", "train.precision=fp8"],
     ["train.precision", "'bf16'", "'fp8'"]),
    ("unknown-logging-backend", ["task=sft", "logging.backends=[console,foo]"],
     ["logging.backends", "'tensorboard'", "'foo'"]),
    ("unknown-truncation", ["task=sft", "data.truncation=bogus"],
     ["data.truncation", "'truncate_prompt'", "'bogus'"]),
    ("unknown-format", ["task=sft", "data.format=xml"], ["data.format", "'hh'", "'xml'"]),
    ("max-length-too-small", ["task=sft", "data.max_length=4"], ["data.max_length", "4"]),
    ("keep-last-zero", ["task=sft", "checkpoint.keep_last=0"], ["checkpoint.keep_last", "0"]),
    ("allow-mismatch-not-bool", ["task=sft", "checkpoint.allow_mismatch=maybe"],
     ["checkpoint.allow_mismatch", "boolean", "'maybe'"]),
    ("unknown-top-level-key", ["task=sft", "foo=1"], ["foo: unknown key"]),
    ("dpo-beta-zero", ["task=dpo", "dpo.beta=0"], ["dpo.beta", "greater than 0"]),
    ("unknown-dpo-loss", ["task=dpo", "dpo.loss_type=foo"], ["dpo.loss_type", "'ipo'", "'foo'"]),
    ("other-task-section", ["task=dpo", "sft.assistant_only_loss=false"],
     ["section 'sft' is set but task is 'dpo'"]),
    ("preset-duplicate-key", ["task=sft", TINY, "deepspeed={bad}/dup.json"],
     ["{bad}/dup.json", "duplicate key 'zero_optimization'"]),
    ("preset-syntax-error", ["task=sft", TINY, "deepspeed={bad}/syntax.json"],
     ["{bad}/syntax.json", "invalid JSON", "line 1 column"]),
    ("preset-not-an-object", ["task=sft", TINY, "deepspeed={bad}/list.json"],
     ["{bad}/list.json", "expected a JSON object"]),
    ("preset-file-missing", ["task=sft", TINY, "deepspeed={bad}/missing.json"],
     ["{bad}/missing.json does not exist"]),
    ("preset-scheduler-block", ["task=sft", TINY, "deepspeed={bad}/scheduler.json"],
     ["'scheduler' block", "train.lr_scheduler"]),
    ("preset-fractional-micro-batch",
     ["task=sft", TINY, "deepspeed.train_micro_batch_size_per_gpu=1.5"],
     ["deepspeed.train_micro_batch_size_per_gpu", "positive integer", "1.5"]),
    ("global-batch-not-divisible",
     ["task=sft", TINY, "train.global_batch_size=5", "train.per_device_batch_size=2",
      "train.gradient_accumulation_steps=auto"],
     ["train_batch_size 5 is not divisible by micro 2 × world 1"]),
    ("model-folder-without-config", ["task=sft", "model.name_or_path={bad}/no_model"],
     ["{bad}/no_model", "no config.json"]),
    ("model-path-missing", ["task=sft", "model.name_or_path={bad}/nowhere"],
     ["{bad}/nowhere", "no such folder"]),
    ("tokenizer-without-chat-template", ["task=sft", "model.name_or_path={bad}/no_template"],
     ["{bad}/no_template", "has no chat template"]),
    ("empty-data-file", ["task=sft", TINY, "data.path={bad}/empty.jsonl"],
     ["{bad}/empty.jsonl is empty"]),
    ("corrupt-data-file", ["task=sft", TINY, "data.path={bad}/corrupt.jsonl"],
     ["{bad}/corrupt.jsonl line 1 (lines count from 1) is not valid JSON", "'not json at all'"]),
    ("truncated-last-line", ["task=sft", TINY, "data.path={bad}/truncated.jsonl"],
     ["{bad}/truncated.jsonl line 51 (the last line; lines count from 1)", "looks truncated"]),
    ("line-cut-in-the-middle", ["task=sft", TINY, "data.path={bad}/cut_line.jsonl"],
     ["{bad}/cut_line.jsonl line 12 (lines count from 1)", "cut in the middle"]),
    ("invalid-utf8-row", ["task=sft", TINY, "data.path={bad}/latin1.jsonl"],
     ["{bad}/latin1.jsonl line 7 (lines count from 1) has invalid UTF-8 at byte offset",
      "byte 0xe9", "re-encode"]),
    ("image-part-in-content", ["task=sft", TINY, "data.path={bad}/image_parts.jsonl"],
     ["no usable training rows", "holds a part of type 'image_url'",
      'expected text, or a list of text parts [{{"type": "text", "text": "..."}}]',
      "(lines 1, 2, 3, 4, 5, ...)"]),
    ("content-part-without-text", ["task=sft", TINY, "data.path={bad}/parts_without_text.jsonl"],
     ["no usable training rows", "holds a part without text"]),
    ("corrupt-parquet", ["task=sft", TINY, "data.path={bad}/broken.parquet"],
     ["{bad}/broken.parquet cannot be read as PARQUET"]),
    ("data-folder-without-files", ["task=sft", TINY, "data.path={bad}/no_data"],
     ["{bad}/no_data holds no data files"]),
    ("missing-eval-file", ["task=sft", TINY, "data.eval_path={bad}/no_eval.jsonl"],
     ["{bad}/no_eval.jsonl does not exist"]),
    ("csv-missing-columns",
     ["task=dpo", TINY, "data.path={bad}/pairs.csv", "data.format=preference"],
     ["missing column 'prompt' in {bad}/pairs.csv", "'query', 'answer'", "data.columns.prompt"]),
    ("every-completion-empty", ["task=sft", TINY, "data.path={bad}/empty_completions.jsonl"],
     ["no usable training rows in {bad}/empty_completions.jsonl",
      "(line and row numbers of the file, from 1)", "empty completion (lines 1, 2, 3"]),
    ("every-prompt-too-long",
     ["task=sft", TINY, "data.path={bad}/long_prompts.jsonl", "data.max_length=8"],
     ["no usable training rows", "prompt leaves no room at max_length=8"]),
    ("margin-not-a-number", ["task=rm", TINY, "data.path={bad}/margin_text.jsonl",
                             "rm.margin_column=margin"],
     ["rm.margin_column='margin': 20 of 20 rows of {bad}/margin_text.jsonl",
      "not a number (e.g. 'high') in lines 1, 2, 3, 4, 5, ... (20 rows)", "finite numbers"]),
    ("margin-nan", ["task=rm", TINY, "data.path={bad}/margin_nan.jsonl", "rm.margin_column=margin"],
     ["1 of 20 rows of {bad}/margin_nan.jsonl", "NaN or infinite in line 4", "finite numbers"]),
    ("margin-missing", ["task=rm", TINY, "data.path={bad}/margin_missing.jsonl",
                        "rm.margin_column=margin"],
     ["1 of 20 rows of {bad}/margin_missing.jsonl", "missing in line 3"]),
    ("margin-column-absent", ["task=rm", TINY, "data.path={bad}/margin_nan.jsonl",
                              "rm.margin_column=score"],
     ["{bad}/margin_nan.jsonl has no column 'score'", "columns found: chosen, margin, prompt"]),
    ("deepspeed-empty", ["task=sft", "deepspeed="],
     ["deepspeed='': the value is empty", "z0, z2, z3, z3_offload"]),
    ("delete-a-key", ["task=sft", "~train.seed"], ["'~train.seed'", "deleting keys is not supported"]),
    ("comma-list-is-a-sweep", ["task=sft", "model.lora.target_modules=q_proj,v_proj"],
     ["sweeps are not supported", "key=[a,b]"]),
    ("lora-targets-not-names", ["task=sft", "model.lora.target_modules=5"],
     ["model.lora.target_modules: expected module names as a list, e.g. [q_proj,v_proj]",
      "(given: 5)"]),
    # One name without brackets is a one-item list; this one names no module.
    ("lora-target-not-in-model",
     ["task=sft", TINY, "model.lora.enabled=true", "model.lora.target_modules=qproj"],
     ["'qproj' names no module of LlamaForCausalLM (did you mean 'q_proj'?)",
      "linear layers are named: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj"]),
    ("model-needs-remote-code", ["task=sft", "model.name_or_path={bad}/remote_code"],
     ["'{bad}/remote_code' is a local folder", "configuration_my.py, modeling_my.py",
      "runs that code", "model.trust_remote_code=true"]),
    ("diffusion-pipeline-to-a-language-task", ["task=sft", "model.name_or_path=tiny-random-sd"],
     ["tiny-random-sd-v1' is a diffusers text-to-image pipeline (model_index.json), not a "
      "language model", "train it with a diffusion task (task=diffusion_sft or "
      "task=diffusion_dpo)"]),
    ("causal-lm-to-a-diffusion-task", ["task=diffusion_dpo", TINY],
     ["is a transformers language model: a diffusion task needs a diffusers pipeline folder"]),
    ("image-folder-bad-rows",
     ["task=diffusion_sft", "model.name_or_path=tiny-random-sd", "data.path={bad}/t2i_folder"],
     ["data.path='{bad}/t2i_folder'", "2 row(s) of data file {bad}/t2i_folder/metadata.jsonl",
      "line 2: image {bad}/t2i_folder/gone.png", "does not exist",
      "line 3: missing or empty caption in column 'text'"]),
    ("pair-label-outside-0-half-1",
     ["task=diffusion_dpo", "model.name_or_path=tiny-random-sd",
      "data.path={bad}/t2i_pairs.jsonl"],
     ["data.path='{bad}/t2i_pairs.jsonl'", "line 2", "label_0"]),
    ("lora-target-not-in-the-denoiser",
     ["task=diffusion_dpo", "model.name_or_path=tiny-random-sd", "model.lora.enabled=true",
      "model.lora.target_modules=to_qq"],
     ["'to_qq' names no module of UNet2DConditionModel (did you mean 'to_q'?)"]),
    ("resolution-the-denoiser-cannot-take",
     ["task=diffusion_sft", "model.name_or_path=tiny-random-sd", "data.resolution=30"],
     ["data.resolution=30", "must be a multiple of 4 pixels", "data.resolution=28 or 32"]),
    ("min-snr-on-a-flow-pipeline",
     ["task=diffusion_sft", "model.name_or_path=tiny-random-sd3", "diffusion_sft.min_snr_gamma=5"],
     ["diffusion_sft.min_snr_gamma=5.0: min-SNR weighting is for epsilon and v-prediction"]),
    ("freeze-parts-of-a-pipeline",
     ["task=diffusion_sft", "model.name_or_path=tiny-random-sd", "model.freeze=[vision_tower]"],
     ["model.freeze=['vision_tower'] names parts of multimodal language models"]),
    ("model-type-unknown", ["task=sft", "model.name_or_path={bad}/unknown_type"],
     ["'{bad}/unknown_type' is a local folder", "model_type 'foo_bar'", "does not know"]),
    ("resume-from-nowhere", ["task=sft", TINY, "resume={bad}/nowhere"],
     ["resume='{bad}/nowhere' is not a complete align_anything checkpoint"]),
    ("resume-from-a-model-folder", ["task=sft", TINY, "resume={bad}/no_template"],
     ["resume='{bad}/no_template' is not a complete align_anything checkpoint"]),
    # Issue 24 (3): a NaN or infinite weight makes every total reward NaN or inf.
    ("reward-weight-nan", ["task=grpo", TINY, "reward.weights=[nan]"],
     ["1 problem", "reward.weights: weights must be finite numbers, got nan"]),
    ("reward-weight-inf", ["task=grpo", TINY, "reward.weights=[1.0,inf]",
                           "reward.functions=[align_anything.rewards:arith_exact,"
                           "align_anything.rewards:arith_format]"],
     ["1 problem", "reward.weights: weights must be finite numbers, got inf"]),
    # Issue 24 (13): the key at fault is reward.model (model.name_or_path is fine).
    ("reward-model-missing-folder",
     ["task=grpo", TINY, "reward.functions=[]", "reward.model={bad}/no_rm/final"],
     ["1 problem", "reward.model: no such folder", "'{bad}/no_rm/final'",
      "the final/ folder of a task=rm run"]),
    # Issue 24 (14): no key max_prompt_length exists; say which two keys collide.
    ("completion-fills-max-length",
     ["task=grpo", TINY, "grpo.max_completion_length=64", "data.max_length=64"],
     ["grpo.max_completion_length=64 leaves no room for the prompt: data.max_length=64",
      "Raise data.max_length", "or lower grpo.max_completion_length below 64"]),
    ("rloo-completion-over-max-length",
     ["task=rloo", TINY, "rloo.max_completion_length=100", "data.max_length=64"],
     ["rloo.max_completion_length=100 leaves no room for the prompt: data.max_length=64"]),
    # Issue 24 (15): one problem per mixture entry, and a did-you-mean for a misspelt key.
    ("mixture-entry-misspelt-key", ["task=sft", TINY, "data.path=[{{path: arith-sft, wieght: 1}}]"],
     ["1 problem", "data.path.0.wieght: unknown key (did you mean 'data.path.0.weight'?)"]),
    ("mixture-entry-bad-weight", ["task=sft", TINY, "data.path=[{{path: arith-sft, weight: -1}}]"],
     ["1 problem", "data.path.0.weight: Input should be greater than 0 (given: -1)"]),
    ("mixture-entry-weight-and-rows",
     ["task=sft", TINY, "data.eval_path=[{{path: arith-sft, weight: 1, rows: 3}}]"],
     ["1 problem", "data.eval_path.0: give a source a weight or a row count, not both"]),
    # Issue 24 (20): a path Hydra's grammar cannot take unquoted: say how to quote it.
    ("output-dir-needs-quotes", ["task=sft", TINY, "output_dir={bad}/my run (2)"],
     ["cannot parse override 'output_dir={bad}/my run (2)'", "must be quoted for Hydra: "
      "output_dir='{bad}/my run (2)'", "quoted once more: \"output_dir='{bad}/my run (2)'\""]),
]  # fmt: skip

# Lines that a message must not hold (the misleading text of issue 24's cases).
NOT_IN_MESSAGE = {
    "reward-model-missing-folder": ["model.name_or_path"],
    "completion-fills-max-length": ["max_prompt_length", "got 0"],
    "mixture-entry-misspelt-key": ["valid string"],
    "mixture-entry-bad-weight": ["valid string"],
    "mixture-entry-weight-and-rows": ["valid string"],
}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(
    ("overrides", "fragments", "absent"),
    [(*c[1:], NOT_IN_MESSAGE.get(c[0], [])) for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input_is_reported_before_any_step(
    overrides: list[str], fragments: list[str], absent: list[str], bad: Path, tmp_path: Path,
    capsys,
) -> None:  # fmt: skip
    args = [a.format(bad=bad) for a in overrides]
    before = _snapshot(bad)
    status = main([*args, f"output_dir={tmp_path / 'out'}"])
    captured = capsys.readouterr()
    assert _snapshot(bad) == before, "a failed run changed files outside its output_dir"
    assert status == 2, f"expected exit 2, got {status}\n{captured.out}\n{captured.err}"
    err = captured.err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment.format(bad=bad) in err, f"{fragment.format(bad=bad)!r} not in:\n{err}"
    for fragment in absent:
        assert fragment not in err, f"{fragment!r} (misleading) in:\n{err}"
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or not any(
        "loss" in json.loads(line) for line in metrics.read_text().splitlines()
    )


@pytest.mark.slow  # launches an SFT run (the shared sft_single fixture)
def test_score_refuses_a_causal_lm_before_loading_weights(sft_single, tmp_path: Path) -> None:
    """output_dir/final of an SFT run is a causal LM: its config.json says so, and score says it
    before any weights load (no load report, no "found 2 outputs")."""
    final = sft_single.check().output_dir / "final"
    source = tmp_path / "rows.jsonl"
    source.write_text('{"prompt": "hi", "response": "yo"}\n')
    result = subprocess.run(
        [sys.executable, "-m", "align_anything", "score", str(final), str(source),
         "--out", str(tmp_path / "scored.jsonl")],
        cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ,
                                                            "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert f"{final} is a causal language model (LlamaForCausalLM), not a reward model" in err
    assert f"python -m align_anything.train task=rm model.name_or_path={final}" in err
    assert "found 2 outputs" not in err and "score.weight" not in result.stdout + err
    assert not (tmp_path / "scored.jsonl").exists()


def test_score_rejects_a_file_that_is_not_json(bad: Path, tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text('{"prompt": "hi", "response": "yo"}\nhello\n')
    result = subprocess.run(
        [sys.executable, "-m", "align_anything", "score", str(bad / "no_template"), str(source),
         "--out", str(tmp_path / "scored.jsonl")],
        cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ,
                                                            "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"{source} line 2: invalid JSON" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_interpolation_in_output_dir_is_one_message(tmp_path: Path, capsys) -> None:
    """Issue 24 (12): `${no_such.key}` names a key that does not exist: one message naming the
    override, not omegaconf's traceback."""
    status = main(["task=sft", TINY, "output_dir=${no_such.key}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: 'output_dir=${no_such.key}': Interpolation key 'no_such.key' "
                          "not found"), err  # fmt: skip
    assert "Traceback" not in err and "escape it as '\\${'" in err


def test_the_quoted_form_the_hint_suggests_parses(tmp_path: Path, capsys) -> None:
    """Issue 24 (20): the form the message suggests is taken as the path, spaces and all."""
    from align_anything.config import load_config

    target = tmp_path / "my run (2)"
    assert main(["task=sft", TINY, f"output_dir={target}"]) == 2
    err = capsys.readouterr().err
    suggested = err.split("must be quoted for Hydra: ")[1].split(" (on a shell")[0]
    assert suggested == f"output_dir='{target}'"
    assert load_config(["task=sft", suggested]).output_dir == str(target)


# ---------------------------------------------------------------------------- the tools
# `python -m align_anything <command>` in-process (its `main`, as the module runs it).


def _tool(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from align_anything.__main__ import main as tool_main

    status = tool_main(args)
    err = capsys.readouterr().err
    assert status == 2, f"expected exit 2, got {status}:\n{err}"
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_presets_export_refuses_to_overwrite_an_edited_copy(tmp_path: Path, capsys) -> None:
    """Issue 24 (7): an edited ds_z3_config.json is not replaced without --overwrite."""
    from align_anything.__main__ import main as tool_main
    from align_anything.config import preset_path

    assert tool_main(["presets", "export", "z3", str(tmp_path)]) == 0
    copy = tmp_path / "ds_z3_config.json"
    edited = copy.read_text().replace('"stage": 3', '"stage": 3, "note": "mine"')
    copy.write_text(edited)
    capsys.readouterr()
    err = _tool(["presets", "export", "z3", str(tmp_path)], capsys)
    assert f"{copy} already exists (not the shipped preset (edited?)); nothing was written" in err
    assert "--overwrite" in err
    assert copy.read_text() == edited
    assert tool_main(["presets", "export", "z3", str(tmp_path), "--overwrite"]) == 0
    assert copy.read_bytes() == preset_path("z3").read_bytes()


@pytest.mark.parametrize("world", ["0", "-2"])
def test_plan_refuses_a_world_size_below_one(world: str, capsys) -> None:
    """Issue 24 (17): 0 was taken as 1, -2 printed negative budgets."""
    err = _tool(["plan", "--world-size", world, "task=sft", TINY], capsys)
    assert f"--world-size {world}: give a positive number of devices" in err


def test_score_refuses_batch_size_zero_before_reading_anything(bad: Path, tmp_path, capsys):
    """Issue 24 (12): --batch-size 0 (range() with step 0 deep in the scoring loop)."""
    source = tmp_path / "rows.jsonl"
    source.write_text('{"prompt": "hi", "response": "yo"}\n')
    err = _tool(["score", str(bad / "nowhere"), str(source), "--batch-size", "0"], capsys)
    assert "--batch-size 0: give a positive number" in err


def test_score_and_plot_refuse_an_out_in_a_missing_folder_before_any_work(
    bad: Path, tmp_path: Path, capsys
) -> None:
    """Issue 24 (12): score used to load the model and score every row before failing to open
    --out; here the model folder does not even exist, and --out is reported first."""
    source = tmp_path / "rows.jsonl"
    source.write_text('{"prompt": "hi", "response": "yo"}\n')
    out = tmp_path / "missing" / "scored.jsonl"
    err = _tool(["score", str(bad / "nowhere"), str(source), "--out", str(out)], capsys)
    assert f"--out {out}: the folder {out.parent} does not exist" in err
    assert "Nothing was computed" in err and not out.parent.exists()

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    png = tmp_path / "missing" / "metrics.png"
    err = _tool(["plot", str(run), "--out", str(png)], capsys)
    assert f"--out {png}: the folder {png.parent} does not exist" in err


# ---------------------------------------------------------------------------- reward output
# Whole runs, in-process (conftest.run_inline; the run's clean-up leaves no process-group state
# behind). One short GRPO step on the tiny model; the functions are in rl_test_rewards.py.
GRPO_STEP = [
    "task=grpo", TINY, "deepspeed=z0", "grpo.max_completion_length=4", "grpo.num_generations=2",
    "train.per_device_batch_size=2", "grpo.eval_samples=0", "train.max_steps=1",
]  # fmt: skip


@pytest.mark.slow  # launches a GRPO run each
@pytest.mark.parametrize(
    ("function", "fragment"),
    [
        # Issue 24 (3): finite in Python, inf in float32: the run logged inf and trained on nothing.
        ("huge_first", "returned 1e+39, beyond float32's range (±3.4e+38)"),
        # Issue 24 (16): the run ended with exit status 0 and no message.
        ("exits", "raised SystemExit(0) (it must return its values, not exit)"),
    ],
)
def test_unusable_reward_output_stops_the_run_naming_function_and_row(
    function: str, fragment: str, tmp_path: Path
) -> None:
    from conftest import run_inline, tail

    out = tmp_path / "run"
    run = run_inline([*GRPO_STEP, f"reward.functions=[rl_test_rewards:{function}]"], out)
    assert run.returncode == 2, tail(run.output)
    assert (
        f"error: reward in step 1 failed, before that step's optimizer update: reward function "
        f"{function!r} on line " in run.output
    ), tail(run.output)
    assert fragment in run.output and "Traceback" not in run.output
    assert run.train_steps() == []
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert not (out / ".lock").exists()
