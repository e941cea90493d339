"""What the engine and its actors no longer hold, checked for being the same: the EOS id read
from the tokenizer's files, without loading it, equals the loaded tokenizer's
(``models.loader.eos_token_ids``, what the Serve engine reads), and our actors leave no task
events in the GCS (runtime/placement.py), with a control actor that does."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from cosine_ray.models.loader import eos_token_ids, tokenizer_eos_id
from support.tiny_checkpoint import write_tiny_checkpoint


@pytest.mark.real_model
def test_the_eos_id_from_the_files_is_the_tokenizers(real_checkpoint, tmp_path, monkeypatch):
    tiny = write_tiny_checkpoint(tmp_path / "tiny", tokenizer_from=real_checkpoint, seed=3)
    for ckpt in (real_checkpoint, tiny):
        tokenizer = ckpt.load_tokenizer()
        assert tokenizer_eos_id(ckpt.path) == tokenizer.eos_token_id
        with monkeypatch.context() as m:
            m.setattr(type(ckpt), "load_tokenizer", lambda self: pytest.fail("loaded the tokenizer for its EOS id"))
            from_files = eos_token_ids(ckpt)
        assert from_files == eos_token_ids(ckpt, tokenizer)
    # eos_token as {"content": ...}, found in the vocabulary rather than the added tokens
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (tmp_path / "odd" / "tokenizer.json").write_text(json.dumps({"added_tokens": [], "model": {"vocab": {"</s>": 7}}}))
    assert tokenizer_eos_id(tmp_path / "odd") == 7
    (tmp_path / "odd" / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    assert tokenizer_eos_id(tmp_path / "odd") is None  # then the engine loads the tokenizer


@pytest.mark.ray
def test_our_actors_leave_no_task_events_in_the_gcs(ray_cluster):
    """The stage and drafter options (``actor_options``) on a small actor, and the same actor
    without ``enable_task_events``: only the second one's calls are in the GCS's task list."""
    import ray

    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.runtime.placement import actor_options

    class Echo:
        def ping(self, i: int) -> int:
            return i

    options = {k: v for k, v in actor_options("stage", 0, config_from_dict({})).items()
               if k not in ("name", "namespace", "num_cpus")}
    assert options["enable_task_events"] is False
    ours = ray.remote(Echo).options(num_cpus=0, **options).remote()
    control = ray.remote(Echo).options(num_cpus=0, max_restarts=0).remote()
    n = 20
    assert ray.get([a.ping.remote(i) for a in (ours, control) for i in range(n)]) == list(range(n)) * 2
    ours_id, control_id = ours._actor_id.binary(), control._actor_id.binary()
    deadline = time.monotonic() + 60  # task events reach the GCS in batches, about once a second
    while True:
        calls = Counter(e.task_info.actor_id for e in ray._private.state.state._get_all_task_events()
                        if e.task_info.func_or_class_name == "Echo.ping")
        if calls[control_id] >= n or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert calls[control_id] >= n, calls  # premise: the GCS does keep them
    assert calls[ours_id] == 0, calls
    for a in (ours, control):
        ray.kill(a)
