"""Vocabularies: token <-> id maps for event types and each categorical feature.

Built from the train split only (so nothing seen only in val/test leaks into the model)
and saved as `vocab.json` beside the journeys. Id 0 is padding, id 1 is the unknown token;
known tokens follow by descending train frequency, ties by name, so ids are deterministic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from journeys.errors import InputError
from journeys.storage import write_json

PAD, UNK = "<pad>", "<unk>"
PAD_ID, UNK_ID = 0, 1
VOCAB_FILE = "vocab.json"


@dataclass(frozen=True)
class Vocabulary:
    """Tokens in id order; `tokens[0]` is padding and `tokens[1]` the unknown token."""

    tokens: tuple[str, ...]

    @classmethod
    def from_counts(cls, counts: pl.DataFrame, min_count: int) -> Vocabulary:
        """`counts` has columns `token` and `count` (train split only)."""
        kept = (
            counts.filter(pl.col("token").is_not_null() & (pl.col("count") >= min_count))
            .sort(["count", "token"], descending=[True, False])
            .get_column("token")
            .to_list()
        )
        return cls((PAD, UNK, *kept))

    def __len__(self) -> int:
        return len(self.tokens)

    def ids(self, values: pl.Expr) -> pl.Expr:
        """Polars expression mapping a String column (or list element) to ids; unknown -> 1."""
        mapping = {token: i for i, token in enumerate(self.tokens) if i > UNK_ID}
        return values.replace_strict(mapping, default=UNK_ID, return_dtype=pl.Int64)


@dataclass(frozen=True)
class Vocabularies:
    """One vocabulary per sequence column: `event_type` first, then features in config order."""

    by_column: dict[str, Vocabulary] = field(default_factory=dict)
    min_count: int = 1

    @property
    def event_type(self) -> Vocabulary:
        return self.by_column["event_type"]

    @property
    def features(self) -> list[str]:
        return [name for name in self.by_column if name != "event_type"]

    def to_json(self) -> dict:
        return {
            "min_count": self.min_count,
            "vocabularies": {name: list(v.tokens) for name, v in self.by_column.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> Vocabularies:
        by_column = {
            name: Vocabulary(tuple(tokens)) for name, tokens in data["vocabularies"].items()
        }
        for name, vocab in by_column.items():
            if vocab.tokens[:2] != (PAD, UNK):
                raise InputError(f"vocabulary {name!r} does not start with {PAD}, {UNK}")
        return cls(by_column=by_column, min_count=int(data.get("min_count", 1)))

    @classmethod
    def from_counts(cls, counts: pl.DataFrame, columns: list[str], min_count: int) -> Vocabularies:
        """One vocabulary per sequence column from the train split's token counts
        (`column`, `token`, `count`: `count_tokens`)."""
        by_column = {
            name: Vocabulary.from_counts(
                counts.filter(pl.col("column") == name).select("token", "count"), min_count
            )
            for name in columns
        }
        return cls(by_column=by_column, min_count=min_count)

    def save(self, folder: str | Path) -> None:
        write_json(self.to_json(), Path(folder) / VOCAB_FILE)

    @classmethod
    def load(cls, folder: str | Path) -> Vocabularies:
        path = Path(folder) / VOCAB_FILE
        try:
            return cls.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise InputError(f"no vocabularies at {path}: run `journeys ingest` first") from None
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise InputError(f"vocabularies at {path} are unreadable: {err}") from None


def count_tokens(journeys: pl.LazyFrame, columns: list[str]) -> pl.DataFrame:
    """Token counts per sequence column: `column`, `token`, `count`."""
    counted = [
        journeys.select(pl.col(name).explode().alias("token"))
        .group_by("token")
        .len(name="count")
        .with_columns(pl.lit(name).alias("column"))
        .select("column", "token", pl.col("count").cast(pl.Int64))
        for name in columns
    ]
    return pl.concat(pl.collect_all(counted, engine="streaming"), how="vertical")


def train_token_counts(files: list[Path], columns: list[str]) -> pl.DataFrame:
    """Token counts of the train split of journeys part files (`count_tokens`)."""
    if not files:
        return pl.DataFrame(schema={"column": pl.String, "token": pl.String, "count": pl.Int64})
    return count_tokens(pl.scan_parquet(files).filter(pl.col("split") == "train"), columns)


def build_vocabularies(journeys: pl.LazyFrame, columns: list[str], min_count: int) -> Vocabularies:
    """Token vocabularies from the train split's sequences only (nothing from val/test)."""
    train = journeys.filter(pl.col("split") == "train")
    return Vocabularies.from_counts(count_tokens(train, columns), columns, min_count)
