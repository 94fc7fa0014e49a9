"""On-policy distillation: ``DistillationTrainer`` / ``DistillationConfig`` (names and meaning of TRL 1.16's).

Agarwal et al. 2024 (GKD, https://arxiv.org/abs/2306.13649); Thinking Machines' "on-policy distillation". The
student samples its own completions; at every completion position the teacher's next-token distribution is the
target, and the loss is the generalised JSD between the two (``losses.distill``: ``beta`` 0 forward KL, 0.5 JSD,
1 reverse KL, the default), both at ``temperature``, summed over completion tokens and divided by the completion
tokens of the whole accumulation window on all ranks (exact under accumulation and data parallelism).

It is an ``OnPolicyTrainer`` (trainers/onpolicy/trainer.py), sibling of GRPO: the dataloader, the generation
windows and buffer (exact resume), the rollout engine (``build_engine``), multi-turn rollouts (``tools=``), the
sampling settings and evaluation by rewards are the on-policy base's. It implements these documented hooks and
nothing else::

    generate_and_score(rows, gen)    sample (``sample_generation``), no rewards: the slices carry the loss mask only
    count_items(sample)              the slice's completion tokens (the loss's normaliser over the window)
    compute_loss(...)                student and teacher forwards, ``losses.chunked_generalized_jsd``
    evaluate(...)                    the on-policy evaluation (rewards) with ``reward_funcs``, else ``eval_loss``

Memory: neither model's ``[B, T, V]`` logits are built. Each model's last hidden states are taken through
``logprobs.hidden_states_and_head`` (the LM head runs on one position), only the completion positions are kept,
and ``chunked_generalized_jsd`` projects ``logprob_chunk_size`` of them at a time through both heads inside an
activation checkpoint.

How this departs from TRL 1.16's DistillationTrainer:

1. The config is an ``OnPolicyConfig`` (batch semantics, sampling, rollout engine and evaluation fields mean what
   they mean for GRPO); ``num_generations`` defaults to 1 (TRL samples one completion per prompt) and may be
   raised. GRPO's objective settings (``loss_type``, ``epsilon*``, the objective table, ``scale_rewards``, dynamic
   sampling) are not fields of it: setting one is an unknown argument. One generation per optimizer step, as TRL:
   ``steps_per_generation`` must equal ``gradient_accumulation_steps`` and ``num_iterations`` is 1.
2. Sampling goes through the rollout engine (the own KV-cached sampler, or vLLM with ``use_vllm``), seeded per
   (seed, generation, rank). ``min_p`` and ``generation_kwargs`` are the on-policy base's (``suppress_tokens``: the
   own sampler only): the ``GenerationConfig`` names it takes (``generation.sampling.GENERATION_KWARGS``) override
   the config's fields as in TRL; ``temperature`` (also the divergence's), ``max_new_tokens`` and names it has no
   counterpart for are refused in one line.
3. Training forwards get position ids counted from the first prompt token (GRPO's departure 5), for both models.
4. Models outside the hidden-state fast path (final-logit softcapping, logit scaling, custom heads) fall back to
   both models' full logits for the micro-batch (exact, more memory); TRL applies scale and softcap in its kernel.
5. The shared tokenizer is checked before training: equal vocabularies when the teacher's tokenizer is known (a
   folder or Hub id), else equal vocabulary sizes (TRL checks the sizes only). A mismatch is one line; so is a
   teacher that is the student (the same object or equal weights: it would train on nothing), which TRL accepts.
6. ``evaluate()``: with ``reward_funcs`` (a treadle addition), the on-policy metrics (rewards, pass@k, greedy
   accuracy, GRPO's); without, ``eval_loss``, the divergence on completions sampled with the ``eval_*`` settings.
7. No ``entropy`` metric (the chunked divergence does not return the student's entropy). The rest of TRL's training
   metrics are logged with its meaning: ``completions/*`` (mean, min and max length, of the completions that ended
   with EOS too, and ``clipped_ratio``) and ``num_tokens`` per generation, as GRPO's
   (``onpolicy.metrics.completion_metrics``), and ``step_time`` (``OnPolicyTrainer``'s step clock).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from treadle import distributed as dist
from treadle.arguments import LogprobChunkOption, check_model_dtype
from treadle.errors import PreflightError
from treadle.logprobs.tokens import hidden_states_and_head
from treadle.losses import check_distill_options, chunked_generalized_jsd, generalized_jsd
from treadle.metrics import means_of
from treadle.models import eval_mode, from_name, frozen_reference
from treadle.packing import position_ids
from treadle.trainers.onpolicy.config import OnPolicyConfig
from treadle.trainers.onpolicy.data import Rollout, Sample, slice_sample
from treadle.trainers.onpolicy.inputs import seeded_generator
from treadle.trainers.onpolicy.metrics import completion_metrics
from treadle.trainers.onpolicy.trainer import OnPolicyTrainer

__all__ = ["DistillationConfig", "DistillationTrainer", "check_distinct_teacher", "check_shared_tokenizer"]


@dataclass
class DistillationConfig(LogprobChunkOption, OnPolicyConfig):
    """``OnPolicyConfig`` (sampling, batches, rollout engine, evaluation) plus TRL 1.16's distillation fields."""

    min_num_generations: ClassVar[int] = 1

    num_generations: int = 1  # completions sampled per prompt (TRL: 1)
    max_completion_length: int = 512  # most tokens the student samples per completion (TRL's default)
    beta: float = 1.0  # generalised JSD mixture: 0 forward KL, 0.5 JSD, 1 reverse KL (on-policy distillation's)
    teacher_model_init_kwargs: dict | None = None  # from_pretrained keywords when the teacher is a folder or Hub id

    def __post_init__(self) -> None:
        super().__post_init__()
        check_model_dtype(self.teacher_model_init_kwargs, "teacher_model_init_kwargs")
        check_distill_options(self.beta, self.temperature)
        if self.steps_per_generation != self.gradient_accumulation_steps or self.num_iterations != 1:
            raise ValueError(
                f"distillation samples once per optimizer step (as TRL): leave steps_per_generation "
                f"unset (= gradient_accumulation_steps={self.gradient_accumulation_steps}) and "
                f"num_iterations=1, got {self.steps_per_generation} and {self.num_iterations}"
            )


def check_shared_tokenizer(student, teacher, tokenizer, teacher_tokenizer=None) -> None:
    """PreflightError (one line) unless student and teacher share a tokenizer: the same vocabulary when the
    teacher's tokenizer is known, and LM heads over the same number of tokens."""
    if teacher_tokenizer is not None and teacher_tokenizer is not tokenizer:
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise PreflightError(
                f"the teacher's tokenizer ({len(teacher_tokenizer)} tokens) is not the student's "
                f"({len(tokenizer)} tokens); distillation compares next-token distributions token "
                f"by token, so use a teacher and student that share one tokenizer"
            )
    sizes = [_vocabulary_rows(m) for m in (dist.unwrap_model(student), teacher)]
    if None not in sizes and sizes[0] != sizes[1]:
        raise PreflightError(
            f"the student's LM head covers {sizes[0]} tokens but the teacher's {sizes[1]}; "
            f"distillation compares next-token distributions token by token, so use a teacher "
            f"and student that share one tokenizer and vocabulary"
        )


def check_distinct_teacher(student, teacher) -> None:
    """PreflightError (one line) when the teacher is the student: the same object, or equal weights (a second
    load of the same folder). The divergence between equal distributions is 0 with a zero gradient, so the run
    would train on nothing (and the frozen teacher would freeze the very student)."""
    student = dist.unwrap_model(student)
    if teacher is student:
        same = "teacher_model is the student model itself"
    elif _same_weights(student, teacher):
        same = "teacher_model has the student's very weights"
    else:
        return
    raise PreflightError(
        f"{same}: the divergence between a model and itself is 0 with a zero gradient, so distillation would "
        f"train on nothing; give a teacher that differs from the student (a larger or a fine-tuned model)"
    )


def _same_weights(a, b) -> bool:
    """Whether two models hold the same parameters, name by name, equal in value (stops at the first that differs)."""
    ours, theirs = dict(a.named_parameters()), dict(b.named_parameters())
    if ours.keys() != theirs.keys():
        return False
    for name, p in ours.items():
        q = theirs[name]
        if p.shape != q.shape or p.dtype != q.dtype or not torch.equal(p.detach(), q.detach().to(p.device)):
            return False
    return True


def _vocabulary_rows(model) -> int | None:
    """Rows of ``model``'s LM head (the tokens it predicts), or None for a model without a known head."""
    get_head = getattr(model, "get_output_embeddings", None)
    weight = getattr(get_head() if callable(get_head) else None, "weight", None)
    return None if weight is None else weight.shape[0]


class DistillationTrainer(OnPolicyTrainer):
    """Trains ``model`` (the student) on its own samples towards ``teacher_model``'s next-token distributions.

    ``teacher_model``: a causal LM, or a folder / Hub id (loaded with ``args.teacher_model_init_kwargs``); it must
    share the student's tokenizer. ``train_dataset`` needs a ``prompt`` column (text or chat messages).
    ``reward_funcs`` (optional) are used by ``evaluate()`` only. ``tools`` as in OnPolicyTrainer (multi-turn rollouts:
    both models see the tool results in the context, the divergence covers the student's sampled tokens only)."""

    config_class = DistillationConfig

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args: DistillationConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        reward_funcs=None,
        compute_metrics=None,
        tools=None,
    ):
        args = self.check_args(args)
        if teacher_model is None:
            raise ValueError("DistillationTrainer needs teacher_model= (a causal LM, a model folder or a Hub id)")
        model, processing_class = from_name(model, processing_class, args)
        teacher_args = types.SimpleNamespace(
            model_init_kwargs=args.teacher_model_init_kwargs, trust_remote_code=args.trust_remote_code
        )
        teacher, teacher_tokenizer = from_name(teacher_model, None, teacher_args)
        check_shared_tokenizer(
            model, teacher, processing_class, teacher_tokenizer if isinstance(teacher_model, str) else None
        )
        check_distinct_teacher(model, teacher)
        super().__init__(
            model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            compute_metrics=compute_metrics,
            reward_funcs=reward_funcs,
            tools=tools,
        )
        self.teacher_model = frozen_reference(self.model, teacher, device=args.device)  # eval mode, no grad

    # ---- sampling: the student's completions, no rewards ------------------------------------------------
    def generate_and_score(self, rows: list[dict], generation: int) -> list[Sample]:
        """Sample one completion per row with the current student and return the generation's slices; their
        ``completion_mask`` is the loss mask (sampled tokens; truncated completions dropped with
        ``mask_truncated_completions``) and ``advantages`` are zeros (unused)."""
        args = self.args
        rollout = self.sample_generation(rows, generation)
        out = rollout.generation
        # completions/* and num_tokens as GRPO's; tools=: rollouts/*, tools/* (treadle.rollouts)
        self.metrics.add_many({**completion_metrics(rollout), **rollout.rollout_metrics})
        loss_mask = rollout.loss_mask  # tools=: 1 on sampled tokens only, never on tool results
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~out.is_truncated).unsqueeze(1).to(loss_mask.dtype)
        size, zeros = args.per_device_train_batch_size, torch.zeros(len(rows))
        return [
            slice_sample(out, loss_mask, zeros, slice(s * size, (s + 1) * size)).to(args.device)
            for s in range(args.steps_per_generation)
        ]

    def count_items(self, inputs: Sample) -> int:
        """A slice's completion tokens; the window's sum over all ranks divides the summed divergence."""
        return int(Sample.of(inputs).completion_mask.sum())

    # ---- the loss -----------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The generalised JSD summed over the slice's completion tokens, divided by ``num_items_in_batch`` (the
        window's completion tokens, all ranks; this slice's own when None)."""
        inputs = Sample.of(inputs)
        divergence = self.completion_divergence(model, inputs)  # (M,) one per loss token
        normalizer = num_items_in_batch if num_items_in_batch is not None else max(divergence.numel(), 1)
        loss = divergence.sum() / normalizer
        return (loss, {"divergence": divergence}) if return_outputs else loss

    def completion_divergence(self, model, batch: Sample) -> Tensor:
        """``losses.generalized_jsd`` between ``model`` and the teacher at each completion position that carries
        loss, ``(M,)`` float32, in the order of ``batch.completion_mask.nonzero()``; gradients reach ``model``."""
        args, ids, mask = self.args, batch.input_ids, batch.attention_mask
        keep = batch.completion_mask.bool()  # (B, C)
        start = ids.shape[1] - keep.shape[1] - 1  # the position that predicts the first completion token
        positions = position_ids(mask)
        student, student_head = hidden_states_and_head(model, ids, mask, position_ids=positions)
        with torch.no_grad(), eval_mode(self.teacher_model):
            teacher, teacher_head = hidden_states_and_head(self.teacher_model, ids, mask, position_ids=positions)
        student, teacher = student[:, start:-1][keep], teacher[:, start:-1][keep]  # (M, H) or (M, V)
        options = dict(beta=args.beta, temperature=args.temperature)
        if student_head is None or teacher_head is None:  # a model outside the fast path: full logits
            if student_head is not None:
                student = student @ student_head.weight.T + (0 if student_head.bias is None else student_head.bias)
            if teacher_head is not None:
                teacher = teacher @ teacher_head.weight.T + (0 if teacher_head.bias is None else teacher_head.bias)
            return generalized_jsd(student, teacher, **options)
        return chunked_generalized_jsd(
            student,
            student_head.weight,
            teacher,
            teacher_head.weight,
            student_bias=student_head.bias,
            teacher_bias=teacher_head.bias,
            chunk_size=args.logprob_chunk_size,
            **options,
        )

    # ---- evaluation ---------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """With ``reward_funcs``: the on-policy evaluation (rewards, pass@k, greedy accuracy). Without:
        ``<prefix>_loss``, the divergence per completion token of completions sampled from the ``eval_*`` settings
        (seeded per batch), and ``<prefix>_completions/mean_length``. Logs the metrics and fires ``on_evaluate``."""
        if self.reward_funcs:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset with a 'prompt' column")
        loader = self.build_dataloader(
            dataset,
            batch_size=self.args.per_device_eval_batch_size,
            sampler=self.build_sampler(dataset, shuffle=False),
            collate_fn=list,
        )
        self.metrics.clear("eval")
        self.engine.load_weights(self.model_wrapped, version=self.state.global_step)
        with torch.no_grad(), eval_mode(self.model):
            for index, rows in enumerate(loader):
                rollout = self.sample_rows(
                    rows, seeded_generator(self.args.seed, self.args.device, "eval", index), mode="eval"
                )
                self._record_eval_batch(rollout)
        recorded = means_of(self.metrics.reduce("eval"))  # one all-reduce for every metric
        return self.log_evaluation({f"{metric_key_prefix}_{name}": value for name, value in recorded.items()})

    def _record_eval_batch(self, rollout: Rollout) -> None:
        out = rollout.generation
        sample = slice_sample(out, rollout.loss_mask, torch.zeros(len(rollout.prompts)), slice(None))
        divergence = self.completion_divergence(self.model, sample.to(self.args.device))
        self.metrics.add_many(
            {
                "loss": (divergence.sum().item(), divergence.numel()),
                "completions/mean_length": (out.completion_mask.sum().item(), len(rollout.prompts)),
            },
            mode="eval",
        )
