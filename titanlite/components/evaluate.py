"""Held-out evaluation: the exact token-mean loss of the whole eval set and its perplexity, with
training's maths (sequence_losses, without a model's added terms) summed in float64 and all-reduced
with the token count, so it depends on neither dp nor the batch. Every rank runs the same number of
forwards (the last round padded with label-less copies) and nothing draws from torch's RNG, so
training after an eval is bitwise what it would have been."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.components.generate import sample_text
from titanlite.components.loss import sequence_losses
from titanlite.config import JobConfig
from titanlite.config.fields import due
from titanlite.datasets.batch import Microbatch, collate
from titanlite.datasets.build import build_eval_dataset
from titanlite.datasets.records import prompt_format
from titanlite.distributed.liveness import phase
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.models.step import LossPath
from titanlite.ops.cross_entropy import IGNORE_INDEX
from titanlite.tools.instrument import readback
from titanlite.tools.process import heartbeat
from titanlite.tools.seeds import sample_seed

logger = logging.getLogger("titanlite")


def build_evaluator(
    cfg: JobConfig, dims: ParallelDims, tokenizer, path: LossPath
) -> Evaluator | None:
    """The run's evaluator ([eval]), None without an eval set; rank 0 says what it evaluates.
    `path`: the model's loss path at eval's batch (MetaModel.loss_path(evaluating=True))."""
    data = build_eval_dataset(cfg, tokenizer)
    if data is None:
        return None
    e = cfg.eval
    batch = e.local_batch_size or cfg.training.local_batch_size
    evaluator = Evaluator(data, dims, batch, path, cfg, tokenizer)
    if dims.dp_rank == 0:
        where = f"'{e.path}'" if e.path else f"{e.fraction:g} of the data, held out"
        when = ["before the first step"] * e.at_start + [f"every {e.every} steps"] * bool(e.every)
        when = ", ".join(when + ["after the last step"] * e.at_end)
        when = when or "never (eval.every, eval.at_start and eval.at_end are off)"
        logger.info(f"eval: {len(data):,} sequences ({where}), {when}")
    return evaluator


class Evaluator:
    """Evaluates a model on a dataset (an indexable of (inputs, labels[, positions]) items) and,
    given a config and a tokenizer, decodes eval.prompts at each eval."""

    def __init__(
        self,
        dataset,
        dims: ParallelDims,
        batch_size: int,
        path: LossPath,
        cfg: JobConfig | None = None,
        tokenizer=None,
    ) -> None:
        self.dataset = dataset
        self.dims = dims
        self.batch_size = batch_size
        self.path = path  # see sequence_losses
        self.cfg = cfg
        self.tokenizer = tokenizer

    def due(self, step: int) -> bool:
        """Every eval.every steps, and after the last with eval.at_end."""
        e = self.cfg.eval
        return due(step, e.every) or (e.at_end and step == self.cfg.training.steps)

    @phase("eval")
    def run(self, model: nn.Module, step: int) -> tuple[dict, list[dict[str, str]]]:
        """The eval's record ({"step", "loss", "perplexity", "tokens", "sequences", "seconds"})
        and the decoded eval.prompts ({"prompt", "text"}); every rank calls it in lockstep."""
        began = time.perf_counter()
        with heartbeat(
            lambda t: logger.info(f"eval step {step}: still scoring the eval set ({t:.0f}s)")
        ):
            rec = {"step": step, **self.loss(model), "seconds": time.perf_counter() - began}
        e = self.cfg.eval
        if not e.prompts:
            return rec, []
        seed = sample_seed(self.cfg.training.seed, step)
        generator = torch.Generator(device=self.dims.device).manual_seed(seed)
        say = f"eval step {step}: still decoding {len(e.prompts)} prompt(s) of {e.sample_tokens} tokens"
        with self.dims.autocast(), heartbeat(lambda t: logger.info(f"{say} ({t:.0f}s)")):
            texts = sample_text(
                model,
                self.tokenizer,
                e.prompts,
                e.sample_tokens,
                fmt=prompt_format(e.prompt_format, self.cfg.data.mode, self.tokenizer),
                temperature=e.temperature,
                top_p=e.top_p,
                generator=generator,
                group=self.dims.dp_group,
            )
        return rec, [{"prompt": p, "text": x} for p, x in zip(e.prompts, texts, strict=True)]

    def _batch(self, round_: int) -> Microbatch:
        """This rank's microbatch of one round; past the end, copies of item 0 without labels."""
        per_round = self.batch_size * self.dims.dp_size
        first = round_ * per_round + self.dims.dp_rank * self.batch_size
        inputs, labels, *rest = self.dataset[0]
        pad = (inputs, np.full_like(labels, IGNORE_INDEX), *rest)
        n = len(self.dataset)
        items = [self.dataset[i] if i < n else pad for i in range(first, first + self.batch_size)]
        return self.dims.piece(collate(items).to(self.dims.device))

    @torch.no_grad()
    def loss(self, model: nn.Module) -> dict[str, float]:
        """{"loss", "perplexity", "tokens", "sequences"}; every rank calls it."""
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.dims.device)  # loss sum, tokens
        rounds = math.ceil(len(self.dataset) / (self.batch_size * self.dims.dp_size))
        try:
            for r in range(rounds):
                batch = self._batch(r)
                with self.dims.autocast():
                    per_sequence = sequence_losses(model, batch, self.path).ce
                totals[0] += per_sequence.double().sum()
                totals[1] += (batch.labels != IGNORE_INDEX).sum()
        finally:
            model.train(was_training)
        # every rank that holds distinct tokens counts: pieces of split sequences too
        if self.dims.token_ranks > 1:
            dist.all_reduce(totals, group=self.dims.dp_group)
        ((loss_sum, tokens),) = readback([totals])  # the eval's one read on the host
        loss = loss_sum / tokens if tokens else float("nan")
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)) if tokens else float("nan"),
            "tokens": int(tokens),
            "sequences": len(self.dataset),
        }
