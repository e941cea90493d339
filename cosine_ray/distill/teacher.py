"""The target's view of its own answers: top-k log-probabilities and features at every position.

One teacher-forcing pass of the target (Hugging Face transformers, fp32) over each answer
record's prompt + output gives, at every position t, the target's ``k`` most likely next tokens
with their log-probabilities (what a drafter is distilled towards) and its *feature* there: the
final-norm hidden state, the input of its LM head (what a feature head drafts from). Records are
processed in shards of up to ``shard_size`` (sorted by key) and each shard is saved as one
safetensors file the moment it is done, so an interrupted pass resumes with the shards it lacks.

Shard tensors (T = the shard's tokens, sequences back to back)::

    token_ids      [T]      int32     prompt + output of each record
    topk_ids       [T, k]   int32     the target's top-k next tokens at each position
    topk_logprobs  [T, k]   float16   their log-probabilities (log-softmax over the whole vocabulary)
    features       [T, H]   float16   final-norm hidden states (only with ``features=True``)
    offsets        [n + 1]  int64     sequence i is rows offsets[i]:offsets[i + 1]
    prompt_lens    [n]      int64     prompt tokens of sequence i
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from cosine_ray.distill.answers import AnswerRecord


@dataclass(frozen=True, slots=True)
class TeacherConfig:
    top_k: int = 16
    """Log-probabilities kept per position (DESIGN: 8-32)."""
    features: bool = True
    """Keep the final-norm hidden states (the feature head's input and target)."""
    batch_tokens: int = 4096
    """Padded tokens per forward (batch rows × longest sequence)."""
    shard_size: int = 64
    """Records per saved shard."""


@dataclass(slots=True)
class Shard:
    keys: list[str]
    domains: list[str]
    token_ids: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    features: torch.Tensor | None
    offsets: torch.Tensor
    prompt_lens: torch.Tensor

    def sequence(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def load_hf_target(path: str | Path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


@torch.inference_mode()
def teacher_forward(model, sequences: Sequence[Sequence[int]], top_k: int, features: bool
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per sequence: (topk_ids [T, k] int32, topk_logprobs [T, k] fp16, features [T, H] fp16 or
    None), from one right-padded batch through ``model`` (an HF causal LM)."""
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, :len(s)] = 1
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H], after the final norm
    out = []
    for i, s in enumerate(sequences):
        h = hidden[i, :len(s)]  # [T, H]
        logprobs = torch.log_softmax(model.lm_head(h).float(), dim=-1)  # [T, vocab]
        top = logprobs.topk(top_k, dim=-1)
        out.append((top.indices.to(torch.int32), top.values.to(torch.float16),
                    h.to(torch.float16) if features else None))
    return out


def _shard_name(keys: Sequence[str]) -> str:
    return "shard-" + hashlib.sha1("\n".join(keys).encode()).hexdigest()[:16] + ".safetensors"


def shard_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("shard-*.safetensors"))


def covered_keys(folder: str | Path) -> set[str]:
    """Record keys the saved shards of ``folder`` hold."""
    from safetensors import safe_open
    keys: set[str] = set()
    for f in shard_files(folder):
        with safe_open(str(f), "pt") as st:
            keys.update(json.loads(st.metadata()["keys"]))
    return keys


def load_shard(path: str | Path) -> Shard:
    from safetensors import safe_open
    with safe_open(str(path), "pt") as st:
        meta = st.metadata()
        t = {k: st.get_tensor(k) for k in st.keys()}
    return Shard(json.loads(meta["keys"]), json.loads(meta["domains"]), t["token_ids"], t["topk_ids"],
                 t["topk_logprobs"], t.get("features"), t["offsets"], t["prompt_lens"])


def run_teacher(model, records: Sequence[AnswerRecord], folder: str | Path, config: TeacherConfig = TeacherConfig(),
                *, progress: bool = True) -> list[Path]:
    """Teacher-force every record ``folder``'s shards lack; returns all shard files."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    done = covered_keys(folder)
    todo = sorted((r for r in records if r.key not in done), key=lambda r: r.key)
    bar = tqdm(total=sum(len(r.token_ids) for r in todo), unit="tok", desc="teacher", file=sys.stderr,
               disable=not progress or not todo, dynamic_ncols=True)
    for start in range(0, len(todo), config.shard_size):
        shard = todo[start:start + config.shard_size]
        results: dict[str, tuple] = {}
        by_length = sorted(shard, key=lambda r: len(r.token_ids))
        i = 0
        while i < len(by_length):  # batches of similar length, at most batch_tokens padded tokens
            j = i + 1
            while j < len(by_length) and (j + 1 - i) * len(by_length[j].token_ids) <= config.batch_tokens:
                j += 1
            batch = by_length[i:j]
            for r, res in zip(batch, teacher_forward(model, [r.token_ids for r in batch], config.top_k,
                                                     config.features)):
                results[r.key] = res
            bar.update(sum(len(r.token_ids) for r in batch))
            i = j
        lengths = [len(r.token_ids) for r in shard]
        tensors = {
            "token_ids": torch.tensor([t for r in shard for t in r.token_ids], dtype=torch.int32),
            "topk_ids": torch.cat([results[r.key][0] for r in shard]),
            "topk_logprobs": torch.cat([results[r.key][1] for r in shard]),
            "offsets": torch.tensor([0] + lengths, dtype=torch.long).cumsum(0),
            "prompt_lens": torch.tensor([len(r.prompt_token_ids) for r in shard], dtype=torch.long),
        }
        if config.features:
            tensors["features"] = torch.cat([results[r.key][2] for r in shard])
        keys = [r.key for r in shard]
        save_file(tensors, str(folder / _shard_name(keys)),
                  metadata={"keys": json.dumps(keys), "domains": json.dumps([r.domain for r in shard]),
                            "top_k": str(config.top_k)})
    bar.close()
    return shard_files(folder)
