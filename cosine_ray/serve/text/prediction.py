"""Predicted Outputs (OpenAI's ``prediction``): the predicted text as token ids for the engine,
and the usage it reports.

The prediction is tokenized as the answer would be (no special tokens) off the event loop,
after the same cheap character bound as a prompt (``serve.text.prompts.check_length``); it may hold
at most the model's context in tokens (``max_model_len``), a 400 naming ``prediction`` past it.
The engine's prediction drafter drafts from it; the text stays the model's.

Usage (``completion_tokens_details``, sent when the request had a prediction): a choice's
*accepted* prediction tokens are those that appear in its completion in order, the length of
the longest common subsequence of the prediction and the completion's tokens
(``algo.subsequence``); the *rejected* ones are the rest of the prediction. Both are summed
over the choices. The count depends only on the two token sequences, so a greedy request
reports the same figures whatever the batch, the drafters or the machine did.
"""

from __future__ import annotations

from typing import Sequence

from cosine_ray.algo.subsequence import common_subsequence_length
from cosine_ray.serve.errors import InvalidRequest
from cosine_ray.serve.text.prompts import check_length, off_loop
from cosine_ray.serve.schemas import ChatCompletionRequest, CompletionRequest, CompletionTokensDetails
from cosine_ray.serve.state import ServerState


async def prediction_ids(state: ServerState, req: ChatCompletionRequest | CompletionRequest) -> tuple[int, ...]:
    """The request's prediction as token ids (() without one, or for empty text)."""
    if req.prediction is None or not req.prediction.content:
        return ()
    text = req.prediction.content
    check_length(state, len(text), "prediction")
    encoded = await off_loop(state.tokenizer, text, add_special_tokens=False)
    ids = tuple(int(t) for t in encoded["input_ids"])
    context = state.engine.max_model_len
    if len(ids) > context:
        raise InvalidRequest(f"prediction is {len(ids)} tokens; at most the model's context of {context}",
                             param="prediction")
    return ids


def prediction_details(prediction: Sequence[int], completions: Sequence[Sequence[int]]) -> CompletionTokensDetails:
    """Accepted and rejected prediction tokens over ``completions`` (one per choice)."""
    accepted = [common_subsequence_length(prediction, c) for c in completions]
    return CompletionTokensDetails(accepted_prediction_tokens=sum(accepted),
                                   rejected_prediction_tokens=sum(len(prediction) - a for a in accepted))
