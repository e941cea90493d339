"""A domain datastore: token sequences the retrieval drafter continues from.

Typically the target model's own prompt + greedy output on a domain's prompts, so the
datastore holds text the target would write. On disk it is one Parquet file::

    column      type            one row per sequence
    token_ids   list<int32>     prompt + output token ids
    source_id   string          where the row came from (prompt id, file, ...)

    schema metadata  b"cosine_ray.datastore" → JSON {format_version, domain, model_name,
                     vocab_size, params}

In memory, ``continuation_index(max_n)`` maps every n-gram (n = 1..max_n, never crossing a
sequence boundary) to its continuation counts, sorted most frequent first: a dict probe is
well under a microsecond, which a drafter probing ~max_n times a token needs, at the price
of memory (~max_n keys a token); past ~10^7 tokens a suffix array would be the better trade.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from cosine_ray.engine.drafters.base import by_count

METADATA_KEY = b"cosine_ray.datastore"
FORMAT_VERSION = 1
_INT32_MAX = 2**31 - 1
_SCHEMA = pa.schema([("token_ids", pa.list_(pa.int32())), ("source_id", pa.string())])


@dataclass(frozen=True, slots=True)
class DatastoreMetadata:
    domain: str
    """Domain the sequences come from (``code``, ``math``, ``chat``...); names the drafter."""
    model_name: str
    """Target model whose tokenizer (and usually outputs) produced the token ids."""
    vocab_size: int | None = None
    """Tokenizer vocabulary size; every token id is below it. None when unknown."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """How the datastore was made (JSON-serialisable): max_new_tokens, prompt set, date..."""
    format_version: int = FORMAT_VERSION
    """On-disk format version."""

    def __post_init__(self) -> None:
        if not isinstance(self.domain, str) or not self.domain:
            raise ValueError("domain must be a non-empty string, e.g. 'code'")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("model_name must be a non-empty string naming the target model")
        if self.vocab_size is not None and not (isinstance(self.vocab_size, int) and 0 < self.vocab_size <= _INT32_MAX + 1):
            raise ValueError(f"vocab_size must be a positive int or None, got {self.vocab_size!r}")
        try:
            json.dumps(dict(self.params))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"params must be JSON-serialisable: {exc}") from exc

    def to_json(self) -> str:
        return json.dumps({"format_version": self.format_version, "domain": self.domain,
                           "model_name": self.model_name, "vocab_size": self.vocab_size,
                           "params": dict(self.params)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "DatastoreMetadata":
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("datastore metadata is not a JSON object")
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"datastore format_version {version!r} is not supported (this build reads "
                             f"{FORMAT_VERSION}); rebuild the datastore with this version")
        return cls(domain=raw.get("domain"), model_name=raw.get("model_name"),
                   vocab_size=raw.get("vocab_size"), params=raw.get("params") or {},
                   format_version=version)


class ContinuationIndex:
    """n-gram tuple → (total count, ((next token, count), ...) most frequent first).

    Equal counts keep first-occurrence order, so results are deterministic.
    """

    __slots__ = ("max_n", "_table")

    def __init__(self, sequences: Sequence[Sequence[int]], max_n: int) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        counts: dict[tuple[int, ...], dict[int, int]] = {}  # plain dicts: built at every engine start
        for seq in sequences:
            seq = tuple(seq)
            for end in range(1, len(seq)):
                next_token = seq[end]
                for n in range(1, min(max_n, end) + 1):
                    key = seq[end - n:end]
                    counter = counts.get(key)
                    if counter is None:
                        counts[key] = {next_token: 1}
                    else:
                        counter[next_token] = counter.get(next_token, 0) + 1
        self.max_n = max_n
        self._table: dict[tuple[int, ...], tuple[int, tuple[tuple[int, int], ...]]] = {
            key: (sum(counter.values()), tuple(counter.items()) if len(counter) == 1 else
                  tuple(sorted(counter.items(), key=by_count, reverse=True)))  # stable: ties keep first occurrence
            for key, counter in counts.items()
        }

    def __len__(self) -> int:
        return len(self._table)

    def continuations(self, ngram: Sequence[int]) -> tuple[int, tuple[tuple[int, int], ...]] | None:
        """``(total, ((token, count), ...))`` for an n-gram, or None if it never occurred."""
        return self._table.get(tuple(ngram))

    def lookup(self, tail_token_ids: Sequence[int], k: int, *, min_n: int, max_n: int,
               smoothing: float = 0.0) -> list[tuple[int, float]]:
        """Top-k ``(token, count / (total + smoothing))`` for the longest suffix of
        ``tail_token_ids`` with length in ``[min_n, max_n]`` that occurs; ``[]`` if none."""
        table = self._table
        for n in range(min(max_n, self.max_n, len(tail_token_ids)), min_n - 1, -1):
            entry = table.get(tuple(tail_token_ids[-n:]))
            if entry is not None:
                total, ranked = entry
                denominator = total + smoothing
                return [(tok, count / denominator) for tok, count in ranked[:k]]
        return []


class Datastore:
    """Token sequences of one domain plus their metadata; see the module docstring."""

    DEFAULT_INDEX_MAX_N = 4

    def __init__(self, sequences: Sequence[Sequence[int]], metadata: DatastoreMetadata,
                 source_ids: Sequence[str] | None = None, *, index_max_n: int = DEFAULT_INDEX_MAX_N) -> None:
        self._sequences = tuple(_checked_sequence(i, seq, metadata.vocab_size) for i, seq in enumerate(sequences))
        if source_ids is None:
            source_ids = [f"seq-{i:06d}" for i in range(len(self._sequences))]
        self._source_ids = tuple(str(s) for s in source_ids)
        if len(self._source_ids) != len(self._sequences):
            raise ValueError(f"{len(self._source_ids)} source_ids for {len(self._sequences)} sequences; "
                             "give one per sequence or none")
        self._metadata = metadata
        if index_max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {index_max_n}")
        self._index_max_n = index_max_n
        self._index: ContinuationIndex | None = None  # built at a drafter's first ask: a classifier reads only sequences

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]], *, domain: str, model_name: str,
                       source_ids: Sequence[str] | None = None, vocab_size: int | None = None,
                       params: Mapping[str, Any] | None = None,
                       index_max_n: int = DEFAULT_INDEX_MAX_N) -> "Datastore":
        metadata = DatastoreMetadata(domain=domain, model_name=model_name, vocab_size=vocab_size,
                                     params=dict(params or {}))
        return cls(seqs, metadata, source_ids, index_max_n=index_max_n)

    # ---- data -----------------------------------------------------------------------------
    @property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        return self._sequences

    @property
    def source_ids(self) -> tuple[str, ...]:
        return self._source_ids

    @property
    def metadata(self) -> DatastoreMetadata:
        return self._metadata

    @property
    def domain(self) -> str:
        return self._metadata.domain

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self._sequences)

    def __len__(self) -> int:
        return len(self._sequences)

    def continuation_index(self, max_n: int | None = None) -> ContinuationIndex:
        """The n-gram index up to ``max_n`` (default: the ``index_max_n`` it was made with), built
        at the first call; rebuilt (once) if a longer ``max_n`` than built is asked for."""
        if self._index is None or (max_n is not None and max_n > self._index.max_n):
            self._index = ContinuationIndex(self._sequences, max(max_n or 0, self._index_max_n))
        return self._index

    # ---- disk -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the Parquet file (atomically: temp file then rename). Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.table({"token_ids": pa.array(self._sequences, type=pa.list_(pa.int32())),
                          "source_id": pa.array(self._source_ids, type=pa.string())}, schema=_SCHEMA)
        table = table.replace_schema_metadata({METADATA_KEY: self._metadata.to_json().encode()})
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, index_max_n: int = DEFAULT_INDEX_MAX_N) -> "Datastore":
        """Read a file written by ``save``; ValueError if missing, corrupt or not a datastore."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"datastore file {path} does not exist; create one with "
                             "Datastore.from_sequences(...).save(path)")
        try:
            table = read_parquet(path)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{path} is not a readable Parquet file ({exc}); rebuild the datastore") from exc
        raw_metadata = (table.schema.metadata or {}).get(METADATA_KEY)
        if raw_metadata is None:
            raise ValueError(f"{path} is a Parquet file but not a cosine_ray datastore "
                             f"(no {METADATA_KEY.decode()} metadata)")
        try:
            metadata = DatastoreMetadata.from_json(raw_metadata)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise ValueError(f"{path}: datastore metadata is corrupt ({exc}); rebuild the datastore") from exc
        for name in ("token_ids", "source_id"):
            if name not in table.column_names:
                raise ValueError(f"{path}: datastore has no {name!r} column; rebuild the datastore")
        token_type = table.schema.field("token_ids").type
        if not (pa.types.is_list(token_type) or pa.types.is_large_list(token_type)) \
                or not pa.types.is_integer(token_type.value_type):
            raise ValueError(f"{path}: column token_ids has type {token_type}, expected list<int32>")
        if table.column("token_ids").null_count or table.column("source_id").null_count:
            raise ValueError(f"{path}: datastore has null rows; rebuild the datastore")
        sequences = table.column("token_ids").to_pylist()
        source_ids = table.column("source_id").to_pylist()
        return cls(sequences, metadata, source_ids, index_max_n=index_max_n)


def read_parquet(path: Path) -> pa.Table:
    """One Parquet file as a table, read through ``ParquetFile``: ``pq.read_table`` would also
    import pyarrow's dataset and compute modules, CPU an engine's start pays for nothing."""
    with pq.ParquetFile(path) as f:
        return f.read()


def _checked_sequence(i: int, seq: Sequence[int], vocab_size: int | None) -> tuple[int, ...]:
    if seq is None or isinstance(seq, (str, bytes)):
        raise ValueError(f"sequence {i} must be a sequence of token ids, got {type(seq).__name__}")
    try:
        out = tuple(int(t) for t in seq)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sequence {i} has a token id that is not an int ({exc})") from exc
    limit = _INT32_MAX + 1 if vocab_size is None else vocab_size
    for t in out:
        if not 0 <= t < limit:
            raise ValueError(f"sequence {i} has token id {t} outside [0, {limit}); "
                             "token ids must come from the target model's tokenizer")
    return out
