"""Train a domain drafter: a few of the target's layers over a domain's sub-vocabulary, distilled.

The student is a Hugging Face ``LlamaForCausalLM`` with the target's layer shape and a compact
vocabulary (``engine.drafters.models.distilled``: id 0 = any other token). It starts as the target's
layers ``init_layers`` with the target's final norm and, as its tied embedding and LM head, the
target's embedding rows of the vocabulary (kept frozen: the drafter reads and writes the
target's token space). Training minimises the cross-entropy from the target's top-k
distribution at every position (renormalised over the tokens inside the vocabulary) to the
student's, i.e. KL to the target's top-k. Seeded (``torch.Generator``, ``random.Random``), so
the same data and config give the same weights on the same machine.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from cosine_ray.distill.dataset import TrainSequence, batches
from cosine_ray.engine.drafters.models.distilled import DRAFTER_METADATA


@dataclass(frozen=True, slots=True)
class DomainTrainConfig:
    vocab_size: int = 4096
    """Target tokens the drafter's head covers (its compact vocabulary is one larger: id 0)."""
    init_layers: tuple[int, ...] = (0, -1)
    """Layers the student starts from (negative: from the end); their count is its depth."""
    init: str | None = None
    """A model with the target's tokenizer whose layers the student starts from; None: the target."""
    epochs: int = 8
    lr: float = 2e-3
    weight_decay: float = 0.0
    batch_tokens: int = 256
    """Padded tokens per optimiser step."""
    seed: int = 0
    threads: int = 2
    """torch threads while training."""
    shared_epochs: int = 0
    """Epochs of one drafter over every domain's answers first (its vocabulary: the most
    frequent tokens of them all); each domain drafter then starts from its layers and norm and
    trains ``epochs`` on its own domain. 0: each starts from the target's layers."""
    shared_lr: float = 1e-3


def _student(source_config, source_state: dict[str, torch.Tensor], vocabulary: Sequence[int],
             config: DomainTrainConfig):
    """A compact-vocabulary Llama from ``source``'s layers ``config.init_layers``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = source_config
    layers = [i % c.num_layers for i in config.init_layers]
    hf = LlamaConfig(vocab_size=len(vocabulary) + 1, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=len(layers), num_attention_heads=c.num_heads,
                     num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta)},
                     max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None, attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(hf)
    embed = source_state["model.embed_tokens.weight"].float()
    rows = embed[torch.tensor(list(vocabulary))]
    state = {"model.embed_tokens.weight": torch.cat([embed.mean(0, keepdim=True), rows]),
             "model.norm.weight": source_state["model.norm.weight"].float()}
    for mine, theirs in enumerate(layers):
        for key, value in source_state.items():
            prefix = f"model.layers.{theirs}."
            if key.startswith(prefix):
                state[f"model.layers.{mine}." + key[len(prefix):]] = value.float()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model, layers


def _targets(seq: TrainSequence, to_compact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(compact input ids [T], compact top-k ids [T, k], renormalised probabilities [T, k])."""
    ids = to_compact[seq.topk_ids]
    probs = seq.topk_logprobs.exp() * (ids > 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)
    return to_compact[seq.token_ids], ids, probs


def distill_loss(model, batch: Sequence[TrainSequence], to_compact: torch.Tensor
                 ) -> tuple[torch.Tensor, int, int, int]:
    """(mean soft cross-entropy over the batch's positions, positions, and over the rows that
    predict an output token: how many, and how many have the target's top token as argmax)."""
    longest = max(len(s.token_ids) for s in batch)
    k = batch[0].topk_ids.shape[1]
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    output_rows = torch.zeros(len(batch), longest, dtype=torch.bool)
    top_ids = torch.zeros(len(batch), longest, k, dtype=torch.long)
    top_p = torch.zeros(len(batch), longest, k)
    for i, s in enumerate(batch):
        x, ti, tp = _targets(s, to_compact)
        n = len(x)
        ids[i, :n], mask[i, :n], top_ids[i, :n], top_p[i, :n] = x, 1, ti, tp
        output_rows[i, s.prompt_len - 1:n - 1] = True
    logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [B, L, V]
    logits[..., 0] = float("-inf")
    logprobs = torch.log_softmax(logits, dim=-1)
    valid = (mask.bool() & (top_p.sum(-1) > 0))  # [B, L]
    per_pos = -(top_p * logprobs.gather(-1, top_ids).nan_to_num(neginf=0.0)).sum(-1)
    n = int(valid.sum())
    hits = int(((logits.argmax(-1) == top_ids[..., 0]) & output_rows & (top_ids[..., 0] > 0)).sum())
    return (per_pos * valid).sum() / max(n, 1), n, hits, int(output_rows.sum())


def evaluate(model, sequences: Sequence[TrainSequence], to_compact: torch.Tensor, batch_tokens: int) -> dict:
    """Mean loss over every position, and top-1 agreement with the target where it wrote its
    answer (the rows a drafter drafts at; a top token outside the vocabulary counts as a miss)."""
    model.eval()
    loss = n = hits = outputs = 0
    with torch.no_grad():
        for batch in batches(sequences, batch_tokens, random.Random(0)):
            l, k, h, o = distill_loss(model, batch, to_compact)
            loss, n, hits, outputs = loss + float(l) * k, n + k, hits + h, outputs + o
    return {"loss": loss / max(n, 1), "top1": hits / max(outputs, 1), "output_positions": outputs}


def train_domain(target_config, target_state: dict[str, torch.Tensor], train: Sequence[TrainSequence],
                 val: Sequence[TrainSequence], vocabulary: Sequence[int], config: DomainTrainConfig,
                 log: Callable[[str], None] = print):
    """The trained student (HF model) and its training record."""
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    source_config, source_state = target_config, target_state
    if config.init:
        from cosine_ray.models.loader import resolve_checkpoint
        source = resolve_checkpoint(config.init)
        source_config, source_state = source.config, source.load_state_dict()
    model, layers = _student(source_config, source_state, vocabulary, config)
    to_compact = torch.zeros(int(target_config.vocab_size), dtype=torch.long)
    to_compact[torch.tensor(list(vocabulary))] = torch.arange(1, len(vocabulary) + 1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    rng = random.Random(config.seed)
    plan = [batches(train, config.batch_tokens, rng) for _ in range(config.epochs)]
    total = sum(len(p) for p in plan)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, total // 20))
                                              * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    record = {"before": evaluate(model, val, to_compact, config.batch_tokens) if val else None, "epochs": []}
    start = time.perf_counter()
    for epoch, epoch_batches in enumerate(plan):
        model.train()
        seen = loss_sum = 0
        for batch in epoch_batches:
            loss, n, _, _ = distill_loss(model, batch, to_compact)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            seen, loss_sum = seen + n, loss_sum + float(loss.detach()) * n
        ev = evaluate(model, val, to_compact, config.batch_tokens) if val else None
        record["epochs"].append({"train_loss": loss_sum / max(seen, 1), "val": ev,
                                 "seconds": round(time.perf_counter() - start, 1)})
        log(f"  epoch {epoch + 1}/{config.epochs}: train loss {loss_sum / max(seen, 1):.3f}"
            + (f", held-out loss {ev['loss']:.3f}, top-1 agreement {ev['top1']:.3f}" if ev else ""))
    record["layers_from_target"] = layers
    record["seconds"] = round(time.perf_counter() - start, 1)
    return model, record


def shared_start(target_config, target_state: dict[str, torch.Tensor], trained, config: DomainTrainConfig
                 ) -> dict[str, torch.Tensor]:
    """``target_state`` with the layers ``config.init_layers`` (and the final norm) replaced by
    those ``trained`` (a student of ``config``) learnt, so that ``_student`` starts from them."""
    layers = [i % target_config.num_layers for i in config.init_layers]
    out = dict(target_state)
    for key, value in trained.state_dict().items():
        if key == "model.norm.weight":
            out[key] = value.detach().clone()
        elif key.startswith("model.layers."):
            mine, rest = key[len("model.layers."):].split(".", 1)
            out[f"model.layers.{layers[int(mine)]}.{rest}"] = value.detach().clone()
    return out


def save_domain(model, folder: str | Path, metadata: dict) -> Path:
    """HF directory (fp16 safetensors) + the drafter metadata file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(str(folder), safe_serialization=True)
    model.to(torch.float32)
    (folder / DRAFTER_METADATA).write_text(json.dumps({**metadata, "kind": "domain"}))
    return folder


def config_dict(config: DomainTrainConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
