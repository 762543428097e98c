"""Generation for online RL: the backend interface, and the built-in backend (HF: the policy
itself, through `decode.sample_completions` for text and `generate` for image prompts).

`GenerationBackend.generate(prompts, n, sampling, seeds)` returns n completions per prompt
(prompt i's completions are rows i·n … i·n+n−1). A completion is its token ids up to and
including the first stop token (EOS), and a flag saying it hit `max_new_tokens` without one.

Sampling is reproducible per completion, not per batch: completion j of a prompt whose seed is
s draws its noise from its own generator, seeded by (s, j), and picks the token with the
Gumbel-max trick (argmax of the temperature- and top-p-processed logits plus Gumbel noise, an
exact sample of softmax(logits / T) restricted to the nucleus). So a completion does not depend
on which other prompts share its generate call, its rank, the world size or the chunking — a
resumed run, or the same step on 2 ranks instead of 1, generates the same completions from the
same weights (up to the float noise of other padding). torch's `multinomial` on one global
generator would tie every row's sample to the batch it was drawn in. The cost is one small draw
per row per token from its generator (a vocabulary of uniforms), beside a forward pass of the
whole batch.

The vLLM backends (`generation/vllm.py`, `rollout.backend=vllm`) implement the same
`generate` with the same `Sampling` (temperature, top-k, top-p, max tokens, the same stop tokens,
`stop_token_ids`) and one seed per completion (`completion_seed`, passed to vLLM's per-request
`SamplingParams(seed=...)`); they also return the engine's log-prob of each sampled token
(`Completions.logprobs`), which the online task compares with the trainer's own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from align_anything.families.language.batches import Rows
from align_anything.families.language.encode import IGNORE_INDEX
from align_anything.families.language.layouts import media_in_place
from align_anything.families.language.multimodal import has_media, media_inputs
from align_anything.generation.decode import row_sampler, sample_completions

# Seeds of completion generators: (prompt seed, completion index) -> one 63-bit integer.
_SEED_MIX = 1_000_003


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn. `greedy`: the most likely token (evaluation)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    greedy: bool = False


@dataclass
class Completions:
    """n completions per prompt, in prompt order: token ids (stop token included), whether
    each hit max_new_tokens without a stop token, the generation's timing, and, from an
    inference engine, its log-prob of each kept token (None from the HF backend, whose
    sampling runs on the trained weights themselves)."""

    ids: list[list[int]]
    truncated: list[bool]
    seconds: float
    generated_tokens: int
    logprobs: list[list[float]] | None = None


class GenerationBackend(Protocol):
    def generate(
        self, prompts: Sequence[dict], n: int, sampling: Sampling, seeds: Sequence[int]
    ) -> Completions:
        """n completions of each prompt row (`prompt_ids`, media references for image
        prompts); `seeds`: one per prompt (ignored when greedy). Collective under ZeRO-3:
        every rank calls it once per round, also with no prompts."""
        ...

    def describe(self) -> str:
        """One line for the start-up summary: what generates, and how it gets the weights."""
        ...


def completion_seed(prompt_seed: int, index: int) -> int:
    return (prompt_seed * _SEED_MIX + index) % (2**63 - 1)


class GumbelSampler:
    """A logits processor that turns greedy decoding into sampling, one generator per row:
    temperature, then the top-p nucleus, then Gumbel noise from the row's own generator. With
    `do_sample=False`, `generate` takes the argmax of what this returns: an exact sample."""

    def __init__(
        self, seeds: Sequence[int], *, temperature: float, top_p: float, top_k: int = 0
    ) -> None:
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.temperature
        # top-k before top-p, the order of vLLM's sampler (and of transformers' warpers).
        if self.top_k > 0:
            from transformers.generation.logits_process import TopKLogitsWarper

            scores = TopKLogitsWarper(self.top_k)(input_ids, scores)
        if self.top_p < 1.0:
            from transformers.generation.logits_process import TopPLogitsWarper

            scores = TopPLogitsWarper(self.top_p)(input_ids, scores)
        vocab = scores.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=g) for g in self.generators])
        uniform = uniform.clamp_(torch.finfo(torch.float32).tiny, 1.0 - 1e-7).to(scores.device)
        return scores - torch.log(-torch.log(uniform))


def stop_token_ids(module: Any, tokenizer: Any) -> list[int]:
    """The tokens a completion ends at: the model's generation config's EOS ids and the
    tokenizer's EOS (what both backends stop at)."""
    ids = module.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def cut_at_stop(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    """The completion up to and including its first stop token, and whether it had none
    (truncated at max_new_tokens)."""
    for index, token in enumerate(tokens):
        if token in stop:
            return tokens[: index + 1], False
    return tokens, True


class HFGenerate:
    """`generate` on the policy itself (`Engine.gathered_for_generation`: under ZeRO-3 the
    parameters are gathered once per round), in chunks of `chunk` sequences, prompts
    left-padded."""

    def __init__(self, engine: Any, tokenizer: Any, *, media: Any, chunk: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.media = media
        self.chunk = chunk

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[dict], n: int, sampling: Sampling, seeds: Sequence[int]
    ) -> Completions:
        start = time.perf_counter()
        ids: list[list[int]] = []
        truncated: list[bool] = []
        with self.engine.gathered_for_generation() as module:
            was_training = module.training
            module.eval()
            stop = stop_token_ids(module, self.tokenizer)
            try:
                if self.media is None or not has_media(prompts):
                    generated = self._decode(module, prompts, n, sampling, seeds, stop)
                elif media_in_place(module.config) and self.media.has_all_media(prompts):
                    generated = self._decode(module, prompts, n, sampling, seeds, stop,
                                             with_media=True)  # fmt: skip
                else:
                    generated = self._generate_with_media(module, prompts, n, sampling, seeds, stop)
            finally:
                module.train(was_training)
        for tokens in generated:
            kept, cut = cut_at_stop(tokens, set(stop))
            ids.append(kept)
            truncated.append(cut)
        return Completions(ids, truncated, time.perf_counter() - start, sum(map(len, ids)))

    def describe(self) -> str:
        return "HF generate on the policy" + (
            ", ZeRO-3 parameters gathered once per round" if self.engine.zero_stage == 3 else ""
        )

    def _decode(
        self, module: Any, prompts: Sequence[dict], n: int, sampling: Sampling,
        seeds: Sequence[int], stop: list[int], *, with_media: bool = False,
    ) -> list[list[int]]:  # fmt: skip
        """Text prompts through `decode.sample_completions` (each prompt prefilled once, its
        cache copied n times, finished sequences retired), `chunk` sequences at a time; with
        `with_media`, image prompts of a model whose images enter in place
        (`layouts.media_in_place`), each chunk's media given to its prefill."""
        per_call = max(1, self.chunk // n)
        out: list[list[int]] = []
        for begin in range(0, len(prompts), per_call):
            part = prompts[begin : begin + per_call]
            sample = None
            if not sampling.greedy:
                generators = [
                    torch.Generator().manual_seed(completion_seed(seeds[begin + i], j))
                    for i in range(len(part)) for j in range(n)
                ]  # fmt: skip
                sample = row_sampler(
                    generators, temperature=sampling.temperature, top_p=sampling.top_p,
                    top_k=sampling.top_k,
                )  # fmt: skip
            media = self.media.features(part) if with_media else None
            out += sample_completions(
                module, [p["prompt_ids"] for p in part], n, sample=sample,
                max_new_tokens=sampling.max_new_tokens, stop=stop,
                pad_id=self.tokenizer.pad_token_id, device=self.engine.device, media=media,
            )  # fmt: skip
        return out

    def _generate_with_media(
        self, module: Any, prompts: Sequence[dict], n: int, sampling: Sampling,
        seeds: Sequence[int], stop: list[int],
    ) -> list[list[int]]:  # fmt: skip
        """Image prompts through `generate` (the media enter at prefill), in chunks."""
        rows = [(p, completion_seed(seeds[i], j)) for i, p in enumerate(prompts) for j in range(n)]
        out: list[list[int]] = []
        for begin in range(0, len(rows), self.chunk):
            part = rows[begin : begin + self.chunk]
            out += self._generate(module, [r for r, _ in part], [s for _, s in part], sampling,
                                  stop)  # fmt: skip
        return out

    def _generate(
        self, module: Any, rows: list[dict], seeds: list[int], sampling: Sampling,
        stop: list[int],
    ) -> list[list[int]]:  # fmt: skip
        from transformers import GenerationConfig, LogitsProcessorList

        pad = self.tokenizer.pad_token_id
        width = max(len(r["prompt_ids"]) for r in rows)
        device = self.engine.device
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            prompt = row["prompt_ids"]
            input_ids[b, width - len(prompt) :] = torch.tensor(prompt)
            attention[b, width - len(prompt) :] = 1
        batch = Rows(input_ids, attention, torch.full_like(input_ids, IGNORE_INDEX))
        if self.media is not None and has_media(rows):
            batch = self.media.attach(batch, rows, copies=1)  # a dummy row is cut off below
        width = batch.input_ids.shape[1]
        media = {k: v.to(device) for k, v in media_inputs(batch).items()}
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens, do_sample=False, pad_token_id=pad,
            eos_token_id=stop, bos_token_id=self.tokenizer.bos_token_id,
        )  # fmt: skip
        processors = LogitsProcessorList()
        if not sampling.greedy:
            processors.append(
                GumbelSampler(
                    seeds,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                )  # fmt: skip
            )
        # synced_gpus=False: transformers turns it on by itself under ZeRO-3 with several ranks
        # (an all-reduce per token); the parameters are whole and local here (see above).
        output = module.generate(
            input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
            **media, generation_config=config, logits_processor=processors, synced_gpus=False,
        )  # fmt: skip
        new = output[: len(rows), width:].tolist()
        return new
