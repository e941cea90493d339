"""The parts of a request that are objects of their own: response formats, vLLM's structured
outputs, function tools and calls, and the ``logit_bias`` map (``serve.schemas`` uses them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

StrictBool = Annotated[bool, Field(strict=True)]


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (one of its constraints)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(..., description="The arguments as a JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def token_id_map(value: Any) -> list[tuple[int, float]]:
    """``logit_bias``: {"token id": bias in [-100, 100]} → [(id, bias)]."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"logit_bias keys are token ids (strings of digits), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias[{key}] must be a number in [-100, 100]")
        out.append((int(key), float(bias)))
    return out
