"""KTO, without a launch: the loss and its reference point against hand-derived numbers, unpaired
rows in every file format, the split of preference pairs, encoding and batches, which
completions the KL estimate pairs, the imbalance note, and the reference passes' shared-prompt
and completion-only paths against the plain ones on the tiny model.

Constants used below, derived by hand (σ(z) = 1 / (1 + e^−z)):
    σ(0) = 0.5,  σ(1) = 0.7310585786300049,  1 − σ(1) = σ(−1) = 0.2689414213699951
    σ(0.5) = 0.6224593312018546,  1 − σ(0.5) = 0.3775406687981454
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from align_anything.data.builtin import ARITH_DATASETS, builtin_path, generate, to_jsonl
from align_anything.data.convert import RowRejected, parse_label
from align_anything.data.formats import check_kind, load_records, unpair
from align_anything.errors import DataError
from align_anything.families.language import collate_unpaired
from align_anything.families.language.batches import SharedPrefix
from align_anything.families.language.encode import encode_unpaired
from align_anything.families.language.forward import completion_forward, sequence_logps
from align_anything.families.language.layouts import supports_shared_prompt
from align_anything.families.language.loading import load_tokenizer
from align_anything.families.zoo import resolve_model_path
from align_anything.losses import kto_kl_reference, kto_loss
from align_anything.tasks.kto import (
    balance_note,
    collate_rows,
    kl_completion,
    reference_logps,
    rotated_partners,
)
from align_anything.train import main

SIGMOID_1 = 0.7310585786300049
SIGMOID_HALF = 0.6224593312018546
TINY = "model.name_or_path=tiny-random-llama"


def approx(value, rel: float = 1e-6, abs: float = 1e-7):  # noqa: A002
    return pytest.approx(value, rel=rel, abs=abs)


# ---------------------------------------------------------------------------- the loss


def _loss(policy, ref, desirable, kl, **kwargs):
    return kto_loss(
        torch.tensor(policy, dtype=torch.float64),
        torch.tensor(ref, dtype=torch.float64),
        torch.tensor(desirable),
        torch.tensor(kl, dtype=torch.float64),
        **{"beta": 0.1, **kwargs},
    )


def test_policy_equal_reference_gives_one_half_per_row() -> None:
    out = _loss([-3.0, -7.0], [-3.0, -7.0], [True, False], 0.0)
    assert out.losses.tolist() == approx([0.5, 0.5])
    assert out.rewards.tolist() == [0.0, 0.0]


def test_values_by_hand_with_weights_and_reference_point() -> None:
    # r = 10 on every row but the first; β·r = 1.
    out = _loss([0.0, 10.0, 10.0, 10.0], [0.0] * 4, [True, True, False, False], 0.0,
                desirable_weight=2.0, undesirable_weight=3.0)  # fmt: skip
    # desirable: 2·(1 − σ(β·(r − 0))); undesirable: 3·(1 − σ(β·(0 − r))) = 3·σ(1).
    assert out.losses.tolist() == approx([1.0, 2 * (1 - SIGMOID_1), 3 * SIGMOID_1, 3 * SIGMOID_1])
    assert out.rewards.tolist() == approx([0.0, 1.0, 1.0, 1.0])
    # z₀ = 5: β·(r − z₀) = 0.5.
    out = _loss([10.0, 10.0], [0.0, 0.0], [True, False], 5.0)
    assert out.losses.tolist() == approx([1 - SIGMOID_HALF, SIGMOID_HALF])


def test_the_undesirable_term_is_added_so_its_gradient_pushes_the_completion_down() -> None:
    """The defect the issue names: subtracting the undesirable term would reward raising an
    undesirable completion's log-prob. Here raising it raises the loss, and raising a desirable
    one lowers it; z₀ passes no gradient."""
    policy = torch.tensor([-5.0, -5.0], dtype=torch.float64, requires_grad=True)
    kl = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    out = kto_loss(policy, torch.full((2,), -6.0, dtype=torch.float64),
                   torch.tensor([True, False]), kl, beta=0.5)  # fmt: skip
    out.losses.sum().backward()
    assert policy.grad[0] < 0 < policy.grad[1]
    assert kl.grad is None
    # Both losses are in [0, λ]: no row's loss is negative.
    assert all(0 < x < 1 for x in out.losses.tolist())


def test_kl_reference_point_is_the_clamped_mean() -> None:
    assert float(kto_kl_reference(torch.tensor(3.0), 2)) == 1.5
    assert float(kto_kl_reference(torch.tensor(-4.0), 2)) == 0.0  # a KL is never negative
    with pytest.raises(ValueError, match="at least one mismatched pair"):
        kto_kl_reference(torch.tensor(1.0), 0)


def test_kto_loss_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="beta must be > 0"):
        _loss([0.0], [0.0], [True], 0.0, beta=0.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        _loss([0.0], [0.0], [True], 0.0, undesirable_weight=-1.0)
    with pytest.raises(ValueError, match="share one"):
        _loss([0.0, 1.0], [0.0], [True], 0.0)
    with pytest.raises(ValueError, match="bool"):
        kto_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), torch.tensor(0.0), beta=0.1)
    with pytest.raises(ValueError, match="scalar"):
        kto_loss(torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=torch.bool),
                 torch.zeros(1), beta=0.1)  # fmt: skip


# ---------------------------------------------------------------------------- data


@pytest.fixture(scope="module", autouse=True)
def offline_isolated_datasets(tmp_path_factory):
    """`datasets`' Arrow cache in a temporary folder; hub lookups fail at once."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (1, True), (0, False), (1.0, True), ("good", True),
     ("Bad", False), ("true", True), ("FALSE", False), ("1", True), (" 0 ", False)],
)  # fmt: skip
def test_labels_in_every_accepted_shape(value, expected: bool) -> None:
    assert parse_label(value) is expected


@pytest.mark.parametrize("value", ["maybe", 2, -1, None, 0.5, ""])
def test_other_labels_are_rejected(value) -> None:
    with pytest.raises(RowRejected, match="true/false, 1/0 or good/bad"):
        parse_label(value)


ROWS = [
    ("What number comes after 41?", "Answer: 42", True),
    ("Which is larger, 3 or 9?", "3 is larger.", False),
    ("What number comes after 7?", "Answer: 9", False),
]


def _write(path: Path, labels: list) -> Path:
    import datasets

    data = {
        "prompt": [p for p, _, _ in ROWS],
        "completion": [c for _, c, _ in ROWS],
        "label": labels,
    }
    dataset = datasets.Dataset.from_dict(data)
    if path.suffix == ".csv":
        dataset.to_csv(path, index=False)
    elif path.suffix == ".parquet":
        dataset.to_parquet(path)
    else:
        dataset.to_json(path, lines=True)
    return path


@pytest.mark.parametrize(
    ("name", "labels"),
    [("rows.jsonl", [True, False, False]), ("rows.csv", [1, 0, 0]),
     ("rows.parquet", ["good", "bad", "bad"])],
)  # fmt: skip
def test_unpaired_rows_load_from_every_file_format(tmp_path: Path, name: str, labels) -> None:
    records, report = load_records(str(_write(tmp_path / name, labels)))
    assert report.format == "unpaired" and report.kept == 3
    assert [r["label"] for r in records] == [True, False, False]
    assert records[0]["prompt"] == [{"role": "user", "content": ROWS[0][0]}]
    assert records[0]["completion"] == [{"role": "assistant", "content": ROWS[0][1]}]
    check_kind(records, "unpaired", source=name, task="kto")


def test_unpaired_columns_are_mapped_and_bad_labels_counted(tmp_path: Path) -> None:
    path = tmp_path / "feedback.jsonl"
    rows = [{"question": p, "answer": c, "thumbs": lab} for p, c, lab in ROWS]
    rows[1]["thumbs"] = "meh"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = {"prompt": "question", "completion": "answer", "label": "thumbs"}
    records, report = load_records(str(path), format="unpaired", columns=columns)
    assert [r["label"] for r in records] == [True, False]
    assert report.dropped == {"label is not true/false, 1/0 or good/bad": 1}
    assert report.first_rows["label is not true/false, 1/0 or good/bad"] == ["line 2"]


def test_unpaired_format_without_a_label_column_names_it(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    with pytest.raises(DataError, match="missing column 'label'.*needed by format 'unpaired'"):
        load_records(str(path), format="unpaired")


def test_kto_takes_unpaired_rows_or_pairs_and_refuses_conversations() -> None:
    pair = {"prompt": [], "chosen": [], "rejected": []}
    check_kind([pair], "unpaired", source="p.jsonl", task="kto")
    with pytest.raises(DataError) as err:
        check_kind([{"messages": []}], "unpaired", source="c.jsonl", task="kto")
    assert str(err.value) == (
        "task=kto needs unpaired data (prompt, completion, label) or preference pairs, but "
        "c.jsonl holds conversations. Choose such a dataset with data.path=..."
    )
    with pytest.raises(DataError, match="task=dpo needs preference data, but u.jsonl holds unp"):
        check_kind([{"completion": [], "label": True}], "preference", source="u.jsonl", task="dpo")


def test_pairs_split_into_a_desirable_and_an_undesirable_row_each() -> None:
    pairs = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}", "answer": i,
              "_source_row": f"line {i + 1}"} for i in range(2)]  # fmt: skip
    rows = unpair(pairs)
    # TRL's order: every desirable row, then every undesirable one.
    assert [(r["prompt"], r["completion"], r["label"]) for r in rows] == [
        ("p0", "c0", True), ("p1", "c1", True), ("p0", "r0", False), ("p1", "r1", False)
    ]  # fmt: skip
    assert [r["answer"] for r in rows] == [0, 1, 0, 1]
    assert rows[2]["_source_row"] == "line 1"
    unpaired = [{"prompt": "p", "completion": "c", "label": False}]
    assert unpair(unpaired) == unpaired


def test_builtin_files_equal_their_generator() -> None:
    """Every shipped file (arith-kto included) is exactly what `generate()` writes, and
    arith-kto holds arith-pref's pairs as unpaired rows."""
    generated = generate()
    for name in ARITH_DATASETS:
        assert builtin_path(name).read_text(encoding="utf-8") == to_jsonl(generated[name]), name
    pairs, rows = generated["arith-pref"], generated["arith-kto"]
    assert len(rows) == 2 * len(pairs) and sum(r["label"] for r in rows) == len(pairs)
    expected = sorted(
        (p["prompt"], p[k], k == "chosen") for p in pairs for k in ("chosen", "rejected")
    )
    assert sorted((r["prompt"], r["completion"], r["label"]) for r in rows) == expected


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("tiny-random-llama"))


def _template(tokenizer, messages, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_encode_unpaired_splits_on_the_ids_the_model_sees(tokenizer) -> None:
    records = unpair([{"prompt": [{"role": "user", "content": "2+2?"}],
                       "chosen": [{"role": "assistant", "content": "4"}],
                       "rejected": [{"role": "assistant", "content": "five, I think"}]}])  # fmt: skip
    rows, report = encode_unpaired(records, tokenizer, max_length=128)
    assert report.kept == 2 and [r["label"] for r in rows] == [True, False]
    for row, record in zip(rows, records, strict=True):
        full = _template(tokenizer, record["prompt"] + record["completion"])
        prompt = _template(tokenizer, record["prompt"], add_generation_prompt=True)
        assert row["prompt_ids"] == prompt and row["prompt_ids"] + row["completion_ids"] == full
    # Too long for max_length: dropped and counted; truncate_completion keeps the prompt whole.
    limit = len(rows[0]["prompt_ids"]) + 2
    dropped, report = encode_unpaired(records, tokenizer, max_length=limit)
    assert dropped == [] and report.dropped == {
        f"prompt + completion longer than max_length={limit}": 2
    }
    cut, _ = encode_unpaired(records, tokenizer, max_length=limit, truncation="truncate_completion")
    assert [len(r["completion_ids"]) for r in cut] == [2, 2]


def test_collate_unpaired_pads_each_sequence_set_on_its_own() -> None:
    rows = [
        {"prompt_ids": [5, 6], "completion_ids": [7], "kl_ids": [8, 9, 10], "label": True},
        {"prompt_ids": [11], "completion_ids": [12, 13], "kl_ids": [14], "label": False},
    ]
    batch = collate_unpaired(rows, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [11, 12, 13]]
    assert batch.labels.tolist() == [[-100, -100, 7], [-100, 12, 13]]
    kl = collate_unpaired(rows, pad_id=0, completion="kl_ids")
    assert kl.input_ids.tolist() == [[5, 6, 8, 9, 10], [11, 14, 0, 0, 0]]
    assert kl.labels.tolist() == [[-100, -100, 8, 9, 10], [-100, 14, -100, -100, -100]]
    assert kl.attention_mask.tolist() == [[1] * 5, [1, 1, 0, 0, 0]]
    kto = collate_rows(rows, pad_id=0, share_prefix=False, additive_mask_dtype=None)
    assert kto.desirable.tolist() == [True, False]
    assert kto.own.input_ids.tolist() == batch.input_ids.tolist()
    assert kto.kl.input_ids.tolist() == kl.input_ids.tolist()


# ---------------------------------------------------------------------------- KL pairs


def test_kl_pairs_rotate_completions_by_one_within_the_batch() -> None:
    partners = rotated_partners([5, 2, 9, 4])
    # The prompt of row k takes the completion of row k - 1; the first takes the last's.
    assert partners == {5: 4, 2: 5, 9: 2, 4: 9}
    # The KL completions are the batch's own completions, each used once, none with its prompt.
    assert sorted(partners.values()) == sorted(partners) and all(
        k != v for k, v in partners.items()
    )


def test_kl_completion_is_cut_to_fit_max_length_after_its_prompt() -> None:
    row, other = {"prompt_ids": [1] * 6}, {"completion_ids": [2, 3, 4, 5]}
    assert kl_completion(row, other, max_length=8) == [2, 3]
    assert kl_completion(row, other, max_length=100) == [2, 3, 4, 5]


def test_balance_note_recommends_the_papers_weights() -> None:
    assert balance_note(5, 5, desirable_weight=1.0, undesirable_weight=1.0) == [
        "  balance         5 desirable, 5 undesirable rows (balanced; weights 1 / 1)"
    ]
    # 30 desirable, 90 undesirable: λ_D·30 / (λ_U·90) in [1, 4/3] needs λ_D in [3, 4] (λ_U = 1)
    # or λ_U in [0.25, 0.33] (λ_D = 1).
    head, advice = balance_note(30, 90, desirable_weight=1.0, undesirable_weight=1.0)
    assert head == (
        "  balance         30 desirable, 90 undesirable rows (ratio 0.33): λ_D·n_D / (λ_U·n_U) "
        "= 0.33, outside the KTO paper's recommended [1, 4/3]"
    )
    assert "kto.desirable_weight in [3.00, 4.00] with kto.undesirable_weight=1" in advice
    assert "kto.undesirable_weight in [0.25, 0.33] with kto.desirable_weight=1" in advice
    head, _ = balance_note(30, 90, desirable_weight=3.5, undesirable_weight=1.0)
    assert "= 1.17, in the KTO paper's recommended" in head


# ---------------------------------------------------------------------------- reference passes


# Rows of different prompt, completion and KL completion lengths (ids from the tiny vocabulary).
# DISTINCT: prompts share nothing; HEADER: every prompt starts with the same 6 ids, as a chat
# template's system prompt and header do, so one-row layouts pay.
DISTINCT = [
    {
        "prompt_ids": [5, 6, 7, 8, 9],
        "completion_ids": [10, 11, 12],
        "kl_ids": [13, 14],
        "label": True,
    },
    {"prompt_ids": [20, 21], "completion_ids": [22], "kl_ids": [23, 24, 25, 26], "label": False},
    {"prompt_ids": [30, 31, 32], "completion_ids": [33, 34], "kl_ids": [10], "label": True},
]
HEADER = [{**row, "prompt_ids": [40, 41, 42, 43, 44, 45, *row["prompt_ids"]]} for row in DISTINCT]


def _tiny(attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny-random-llama"), dtype=torch.float32, attn_implementation=attn
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("completion_only", [True, False])
@pytest.mark.parametrize("rows", [DISTINCT, HEADER], ids=["distinct", "header"])
def test_shared_layouts_equal_the_plain_rows(rows, attn: str, completion_only: bool) -> None:
    """Every pass KTO makes (the policy's trained rows with their gradients, its KL rows, the
    reference's pass over both) gives the plain rows' numbers in the shared-prefix layouts, with
    or without completion-only logits; and the plain path equals a forward with full logits."""
    model = _tiny(attn)
    assert supports_shared_prompt(model.config)
    mask = torch.float32 if attn == "eager" else None
    plain = collate_rows(rows, pad_id=0, share_prefix=False, additive_mask_dtype=mask)
    shared = collate_rows(rows, pad_id=0, share_prefix=True, additive_mask_dtype=mask)
    one_row = rows is HEADER
    # DISTINCT: no common prefix; the trained sequences (8, 3 and 5 tokens) are packed into 2
    # rows as wide as the longest; the KL ones (7, 6, 4) cannot share a row: plain rows.
    assert isinstance(shared.own, SharedPrefix)
    assert isinstance(shared.kl, SharedPrefix) is one_row
    assert shared.reference_pass is not None and plain.reference_pass is None
    assert not isinstance(plain.own, SharedPrefix) and not isinstance(plain.kl, SharedPrefix)
    if one_row:  # the common prefix once: one row per layout
        assert shared.own.input_ids.shape[0] == shared.reference_pass.input_ids.shape[0] == 1
    else:
        assert tuple(shared.own.input_ids.shape) == (2, 8)
        assert tuple(plain.own.input_ids.shape) == (3, 8)

    def trained(batch):
        model.zero_grad()
        logps = sequence_logps(model, batch.own, completion_only=completion_only)[0]
        (logps * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (own_plain, grads_plain), (own_shared, grads_shared) = trained(plain), trained(shared)
    torch.testing.assert_close(own_shared, own_plain, rtol=1e-5, atol=1e-5)
    for name, grad in grads_plain.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads_shared[name], grad, rtol=0, atol=1e-5 * scale, msg=name)
    with torch.no_grad():
        kl_plain = sequence_logps(model, plain.kl, completion_only=completion_only)[0]
        kl_shared = sequence_logps(model, shared.kl, completion_only=completion_only)[0]
        full, counts = completion_forward(model, plain.own, completion_only=False)
    torch.testing.assert_close(kl_shared, kl_plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(own_plain, full, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [3, 1, 2]
    for got, want in zip(reference_logps(model, shared, completion_only=completion_only),
                         (own_plain, kl_plain), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Rows carrying precomputed log-probs need no reference layout.
    with_ref = [{**r, "ref_logps": -1.0, "ref_kl_logps": -2.0} for r in rows]
    batch = collate_rows(with_ref, pad_id=0, share_prefix=True, additive_mask_dtype=mask)
    assert batch.reference_pass is None and batch.ref_kl_logps.tolist() == [-2.0] * 3


# ---------------------------------------------------------------------------- bad input


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["data.path=arith-sft"], "task=kto needs unpaired data (prompt, completion, label) or "
                                  "preference pairs, but arith-sft holds conversations"),
        (["train.per_device_batch_size=1"], "task=kto estimates its KL reference point from "
                                            "mismatched prompt-completion pairs"),
    ],
)  # fmt: skip
def test_bad_kto_input_is_one_error_before_any_compute(
    overrides: list[str], fragment: str, capsys, tmp_path: Path
) -> None:
    status = main(["task=kto", TINY, *overrides, f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert fragment in err and "Traceback" not in err
    assert err.count("error:") == 1
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------- memory planner


def test_planner_counts_the_kto_reference_as_for_dpo() -> None:
    from align_anything.config import load_config, load_preset
    from align_anything.families.language import memory as plan
    from align_anything.families.language.sizes import ModelSizes
    from align_anything.training.memory_plan import Estimate

    sizes = ModelSizes(total=1000, trainable=1000, largest_layer=100, hidden=8, layers=2,
                            vocab=10)  # fmt: skip

    def estimate(preset: str, overrides: list[str]) -> Estimate:
        cfg = load_config(["train.per_device_batch_size=2", "data.max_length=16", *overrides])
        return plan.estimate_preset(
            preset, load_preset(preset)[0], sizes, cfg, world_size=2, gpus_per_node=2,
            precision="fp32",
        )  # fmt: skip

    assert estimate("z0", ["task=kto"]).reference == 4000  # frozen fp32 weights
    assert estimate("z3", ["task=kto"]).reference == 4000 / 2  # partitioned under ZeRO-3
    assert estimate("z0", ["task=kto", "kto.reference_offload=true"]).reference == 0
    assert estimate("z0", ["task=kto", "model.lora.enabled=true"]).reference == 0
    # One sequence per row keeps activations for backward (the KL sequence runs without grad).
    assert estimate("z0", ["task=kto"]).activations == estimate("z0", ["task=sft"]).activations
