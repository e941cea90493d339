"""``cosine-ray distill`` end to end: answers → teacher pass → domain drafters and a feature head.

Work files (resumable, outside the output): ``WORK/answers.jsonl`` (``distill.answers``) and
``WORK/teacher/shard-*.safetensors`` (``distill.teacher``). Output: ``OUT/DOMAIN/`` per domain
drafter (HF directory + ``cosine_ray_drafter.json``), ``OUT/head/`` (the feature head) and
``OUT/distill.json`` (what was run, on which data, how long each part took). A share of each
domain's prompts (``val_share``) is held out of training to report top-1 agreement.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from cosine_ray.distill.domain import DomainTrainConfig
from cosine_ray.engine.drafters.models.distilled import tokenizer_fingerprint
from cosine_ray.distill.head import HeadTrainConfig
from cosine_ray.distill.teacher import TeacherConfig


@dataclass(frozen=True)
class DistillConfig:
    model: str
    """The target: embedded name, HF directory or .gguf."""
    out: str
    """Where the drafters go."""
    work: str
    """Where answers and teacher shards go (resumable)."""
    prompts: Mapping[str, list[dict[str, Any]]]
    """domain → prompt rows (each with ``prompt``, optionally ``id``)."""
    prompt_sources: Mapping[str, str] = field(default_factory=dict)
    """domain → where its prompts came from (for the metadata)."""
    max_tokens: int = 256
    samples: int = 0
    """Seeded sampled answers per prompt besides the greedy one."""
    temperature: float = 0.8
    batch_size: int = 32
    """Requests the engine runs at once while generating answers."""
    from_datastores: bool = False
    """Take the greedy answers the packaged retrieval datastores already hold."""
    domain_drafters: bool = True
    head: bool = True
    stop_after: str | None = None
    """``answers`` or ``teacher``: stop after that phase."""
    val_share: float = 0.1
    teacher: TeacherConfig = TeacherConfig()
    domain: DomainTrainConfig = DomainTrainConfig()
    head_train: HeadTrainConfig = HeadTrainConfig()
    threads: int = 2
    progress: bool = True


def _answers(config: DistillConfig, checkpoint, tokenizer, log: Callable[[str], None]):
    from cosine_ray.distill.answers import generate_answers, prompt_jobs, read_answers, records_from_datastore
    from cosine_ray.engine.local import encode_prompt

    work = Path(config.work)
    path = work / "answers.jsonl"
    encode = (lambda text: encode_prompt(tokenizer, text))
    jobs = [j for domain, rows in config.prompts.items() for j in
            prompt_jobs(domain, rows, encode, max_tokens=config.max_tokens, samples=config.samples,
                        temperature=config.temperature, seed=config.domain.seed)]
    have = {r.key for r in read_answers(path)}
    if config.from_datastores:
        from cosine_ray.engine.build import datastore_path
        from cosine_ray.engine.drafters.lookup.datastore import Datastore
        eos = tuple(checkpoint.config.eos_token_ids) + ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
        fresh = []
        for domain, rows in config.prompts.items():
            ds = datastore_path(checkpoint.name, domain)
            if ds.is_file():
                fresh += [r for r in records_from_datastore(Datastore.load(ds), domain, rows, encode, eos) if r.key not in have]
        if fresh:
            work.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.writelines(r.to_json() + "\n" for r in fresh)
            log(f"answers: {len(fresh)} greedy answers taken from the packaged datastores")
    if any(j.key not in have for j in jobs):
        from cosine_ray.engine.config import EngineConfig
        from cosine_ray.engine.local import LocalEngine
        engine = LocalEngine(EngineConfig(model=config.model, drafters=(), num_threads=config.threads).replace(
            max_num_seqs=config.batch_size), checkpoint=checkpoint)
        return generate_answers(engine, jobs, path, progress=config.progress)
    done = {r.key: r for r in read_answers(path)}
    return [done[j.key] for j in jobs]


def run_distill(config: DistillConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every phase (each resumes from the work folder); returns the report also written to
    ``OUT/distill.json``."""
    import torch

    from cosine_ray.distill.answers import domain_counts
    from cosine_ray.distill.dataset import coverage, frequent_vocabulary, load_sequences, split_validation
    from cosine_ray.distill.teacher import covered_keys, load_hf_target, run_teacher
    from cosine_ray.models.loader import resolve_checkpoint

    torch.set_num_threads(config.threads)
    checkpoint = resolve_checkpoint(config.model)
    if not checkpoint.has_tokenizer:
        raise ValueError(f"model {checkpoint.name} has no tokenizer: distill encodes text prompts")
    tokenizer = checkpoint.load_tokenizer()
    report: dict[str, Any] = {"target": checkpoint.name, "tokenizer": tokenizer_fingerprint(tokenizer),
                              "prompts": dict(config.prompt_sources), "seconds": {}}
    start = time.perf_counter()
    records = _answers(config, checkpoint, tokenizer, log)
    report["seconds"]["answers"] = round(time.perf_counter() - start, 1)
    report["answers"] = {d: {"answers": a, "output_tokens": t} for d, (a, t) in domain_counts(records).items()}
    log(f"answers: {', '.join(f'{d} {a} ({t} tokens)' for d, (a, t) in domain_counts(records).items())}")
    if config.stop_after == "answers":
        return report
    start = time.perf_counter()
    teacher_dir = Path(config.work) / "teacher"
    if {r.key for r in records} - covered_keys(teacher_dir):
        run_teacher(load_hf_target(checkpoint.path), records, teacher_dir, config.teacher, progress=config.progress)
    report["seconds"]["teacher"] = round(time.perf_counter() - start, 1)
    if config.stop_after == "teacher":
        return report
    sequences = load_sequences(teacher_dir, keys={r.key for r in records})
    state = checkpoint.load_state_dict()
    out = Path(config.out)
    eos = list(dict.fromkeys(list(checkpoint.config.eos_token_ids)))
    common = {"target": checkpoint.name, "target_vocab_size": int(checkpoint.config.vocab_size),
              "tokenizer": report["tokenizer"], "max_tokens": config.max_tokens, "samples": config.samples}
    if config.domain_drafters:
        from dataclasses import replace

        from cosine_ray.distill.domain import config_dict, save_domain, shared_start, train_domain
        splits = {d: split_validation([s for s in sequences if s.domain == d], config.val_share, config.domain.seed)
                  for d in config.prompts}
        start_state = state
        if config.domain.shared_epochs:
            if config.domain.init:
                raise ValueError("a shared start trains the target's own layers; it cannot start from --init")
            train = [s for d in splits for s in splits[d][0]]
            val = [s for d in splits for s in splits[d][1]]
            vocab = frequent_vocabulary(train, config.domain.vocab_size, always=eos)
            log(f"shared start: {len(train)} training answers of every domain, {len(val)} held out")
            started = time.perf_counter()
            shared, record = train_domain(checkpoint.config, state, train, val, vocab, replace(
                config.domain, epochs=config.domain.shared_epochs, lr=config.domain.shared_lr), log)
            start_state = shared_start(checkpoint.config, state, shared, config.domain)
            report["shared_start"] = record
            report["seconds"]["train:shared"] = round(time.perf_counter() - started, 1)
        for domain, (train, val) in splits.items():
            vocab = frequent_vocabulary(train, config.domain.vocab_size, always=eos)
            log(f"domain drafter {domain}: {len(train)} training answers, {len(val)} held out, vocabulary "
                f"{len(vocab)} tokens (covers {coverage(val or train, vocab):.1%} of held-out output tokens)")
            started = time.perf_counter()
            model, record = train_domain(checkpoint.config, start_state, train, val, vocab, config.domain, log)
            seconds = round(time.perf_counter() - started, 1)
            save_domain(model, out / domain, {**common, "domain": domain, "vocabulary": vocab,
                                              "data": {"answers": len(train), "tokens": sum(len(s.token_ids) for s in train),
                                                       "prompts": config.prompt_sources.get(domain, "")},
                                              "train": {**config_dict(config.domain), **record}})
            report.setdefault("domains", {})[domain] = {"seconds": seconds, "vocabulary": len(vocab), **record}
            report["seconds"][f"train:{domain}"] = seconds
    if config.head:
        from cosine_ray.distill.head import config_dict as head_dict, train_head
        from cosine_ray.engine.drafters.models.feature_head import save_feature_head
        if any(s.features is None for s in sequences):
            raise ValueError("the teacher shards hold no features; rerun with features kept")
        train, val = split_validation(sequences, config.val_share, config.head_train.seed)
        vocab = frequent_vocabulary(train, config.head_train.vocab_size, always=eos)
        log(f"feature head: {len(train)} training answers, {len(val)} held out, vocabulary {len(vocab)} tokens")
        started = time.perf_counter()
        head, record = train_head(checkpoint.config, state, train, val, vocab, config.head_train, log)
        seconds = round(time.perf_counter() - started, 1)
        save_feature_head(head, vocab, out / "head", {**common, "domain": "all", "data": {
            "answers": len(train), "tokens": sum(len(s.token_ids) for s in train),
            "prompts": dict(config.prompt_sources)}, "train": {**head_dict(config.head_train), **record}})
        report["head"] = {"seconds": seconds, "vocabulary": len(vocab), **record}
        report["seconds"]["train:head"] = seconds
    out.mkdir(parents=True, exist_ok=True)
    (out / "distill.json").write_text(json.dumps(report, indent=1))
    return report
