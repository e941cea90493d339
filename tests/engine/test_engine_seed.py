"""``EngineConfig.seed`` (``cosine-ray serve --seed``): the requests that give no seed draw their
sampling keys from one generator seeded with it, in arrival order, so the same requests in the
same order give the same texts, with speculation or without; a request's own seed is untouched.
Without it each such request draws a fresh random key."""

from __future__ import annotations

from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.spec import parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.owners.pool import RequestPool
from cosine_ray.engine.request import SamplingParams

SAMPLED = SamplingParams(max_tokens=12, temperature=1.0)


def keys(seed: int | None, params: list[SamplingParams]) -> list[int]:
    pool = RequestPool(max_num_seqs=4, max_model_len=64, num_lanes=1, vocab_size=10, clock=lambda: 0.0, seed=seed)
    return [pool.add(f"r{i}", [1, 2], p).seed for i, p in enumerate(params)]


def test_unseeded_requests_draw_their_keys_from_the_engines_seed():
    params = [SAMPLED, SamplingParams(max_tokens=4, seed=99), SAMPLED]
    first, again = keys(7, params), keys(7, params)
    assert first == again and first[1] == 99 and first[0] != first[2]
    assert keys(8, params)[0] != first[0]
    assert keys(None, params)[0] != keys(None, params)[0]  # a fresh random key each (a 2**-64 chance to fail)
    assert keys(None, params)[1] == 99


def test_the_same_requests_give_the_same_sampled_texts_under_the_same_seed(tiny_checkpoint):
    def run(seed: int | None, drafters: str) -> list[list[int]]:
        config = EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters(drafters), seed=seed)
        outs = LocalEngine(config).generate([[3, 4, 5], [6, 7]], SAMPLED)
        return [o.new_token_ids for o in outs]

    plain = run(11, "none")
    assert run(11, "none") == plain
    assert run(11, "ngram") == plain  # speculation keeps the sampled text of the same key
    assert run(12, "none") != plain
