"""Criteo's attribution journeys as preprocessed by CausalMTA, turned into event logs.

Source: github.com/yaodi833/CausalMTA at commit 3ec94ac, folder `data/` (Yao et al.,
"CausalMTA", KDD 2022; the journeys come from Criteo's attribution modeling data set).
Licence: CC BY-NC-SA 4.0 (Criteo's data set): research use, **never committed**; the
converted files live under the git-ignored `data/public/criteo_mta/`.

The repository holds pickled Python lists, one entry per journey: `C_*` the campaign of
each touch (10 campaigns), `T_*` each touch's time in seconds from the data's start (30.9
days), `Y_*` the label (converted after its last touch). They are read with an unpickler
that refuses every global, so only lists and numbers can come out: nothing in the files
can run code here.

Written per split of theirs (164,647 train and 31,913 test journeys):

    data/public/criteo_mta/train/events.parquet   user_id, timestamp, event_type
    data/public/criteo_mta/test/events.parquet

One journey is one `user_id` (`train-<i>`, `test-<i>`); each touch is an event named after
its campaign (`campaign_<c>`) at `ORIGIN` + its time; a converted journey gets a `purchase`
one second after its last touch. `conf/public_criteo_mta.yaml` ingests them: the suite
uses the train journeys with the product's own temporal split, and the test journeys only
for the final figure (`--evaluate RUN_MODEL`), never to choose anything.

What decides these journeys is, most likely, how they were cut: no unconverted journey lasts longer than
259,200 s (exactly 3 days) from its first touch to its last, while 74% of the converted
train journeys do (57% of the test ones). A model that places that step in the duration
ranks most conversions first; gradient boosting on the duration alone reaches 0.93 test ROC
AUC on the suite's split.

    python benchmarks/criteo_mta.py --source /path/to/CausalMTA     # a clone or a git dir
    python benchmarks/criteo_mta.py --evaluate models:/journey-conversion-public-criteo-mta@champion
"""

from __future__ import annotations

import argparse
import io
import math
import pickle
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

COMMIT = "3ec94ac"
OUT = ROOT / "data" / "public" / "criteo_mta"
CONFIG = ROOT / "conf" / "public_criteo_mta.yaml"
# The CausalMTA file names per split (their `configs.txt` reads the same ones).
FILES = {
    "train": {"C": "data/train/C_train.pkl", "T": "data/train/T_train.pkl", "Y": "data/train/Y_train.pkl"},
    "test": {"C": "data/test/C_test.pkl", "T": "data/test/T_test.pkl", "Y": "data/test/Y_test.pkl"},
}  # fmt: skip
ORIGIN = datetime(2026, 1, 1)  # the data's times are seconds from an unnamed start
CONVERSION_DELAY_S = 1  # the purchase event follows the journey's last touch by this much
SOURCE_NOTE = """# Criteo attribution journeys (CausalMTA preprocessing)

- From github.com/yaodi833/CausalMTA, commit 3ec94ac, `data/{train,test}/{C,T,Y}_*.pkl`.
- Criteo Attribution Modeling for Bidding data set, as preprocessed for CausalMTA (KDD 2022).
- Licence: CC BY-NC-SA 4.0. Research use only; not redistributed by this project: never
  commit these files.
- Converted by `benchmarks/criteo_mta.py` (lists read without unpickling any object).
"""


class ListsOnly(pickle.Unpickler):
    """An unpickler that refuses every global: lists, numbers and strings only."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"refused {module}.{name}: only plain lists are read")


def read_lists(data: bytes) -> list:
    value = ListsOnly(io.BytesIO(data)).load()
    if not isinstance(value, list):
        raise ValueError(f"expected a list, found {type(value).__name__}")
    return value


def read_file(source: Path, path: str) -> bytes:
    """A file of the source: a checkout (`path` under it) or a git directory (`git show`)."""
    if (source / path).is_file():
        return (source / path).read_bytes()
    return subprocess.run(
        ["git", "--git-dir", str(source), "show", f"{COMMIT}:{path}"],
        check=True,
        capture_output=True,
    ).stdout


def events(split: str, campaigns: list, times: list, labels: list) -> pl.DataFrame:
    """One row per touch (and per conversion), in the product's default column names."""
    if not len(campaigns) == len(times) == len(labels):
        raise ValueError(f"{split}: campaigns, times and labels differ in length")
    journeys = pl.DataFrame(
        {
            "user_id": [f"{split}-{i}" for i in range(len(labels))],
            "campaign": campaigns,
            "seconds": times,
            "label": np.asarray(labels, dtype=np.int8),
        },
        schema_overrides={"campaign": pl.List(pl.Int64), "seconds": pl.List(pl.Int64)},
    )
    origin = pl.lit(ORIGIN).dt.replace_time_zone("UTC")
    touches = journeys.explode("campaign", "seconds").select(
        "user_id",
        timestamp=origin + pl.duration(seconds=pl.col("seconds")),
        event_type=pl.lit("campaign_") + pl.col("campaign").cast(pl.String),
    )
    conversions = journeys.filter(pl.col("label") == 1).select(
        "user_id",
        timestamp=origin + pl.duration(seconds=pl.col("seconds").list.last() + CONVERSION_DELAY_S),
        event_type=pl.lit("purchase"),
    )
    return pl.concat([touches, conversions]).sort("user_id", "timestamp", maintain_order=True)


def convert(source: Path, out: Path = OUT) -> None:
    for split, names in FILES.items():
        lists = {key: read_lists(read_file(source, path)) for key, path in names.items()}
        frame = events(split, lists["C"], lists["T"], lists["Y"])
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        frame.write_parquet(folder / "events.parquet")
        print(f"{split}: {len(lists['Y']):,} journeys, {sum(lists['Y']):,} converted, "
              f"{frame.height:,} events -> {folder / 'events.parquet'}")  # fmt: skip
    (out / "SOURCE.md").write_text(SOURCE_NOTE)


def evaluate(model_uri: str, tracking_uri: str | None = None) -> dict[str, float]:
    """The model's test metrics on CausalMTA's own test journeys (the final figure), for
    the probability served, for the run's transformer alone and, when the model is a stack,
    for its booster alone (`hgb_aggregates` of the same run)."""
    import tempfile

    from journeys import metrics as M
    from journeys.config import load_config
    from journeys.datasets import scan_journeys
    from journeys.ingest import run_ingest
    from journeys.trained_model import load_model

    config = load_config(CONFIG)
    trained = load_model(model_uri, tracking_uri or config.mlflow.tracking_uri)
    with tempfile.TemporaryDirectory(prefix="criteo-test-") as tmp:
        result = run_ingest(
            trained.rules.ingest_config(config),
            raw=str(OUT / "test" / "events.parquet"),
            journeys_folder=Path(tmp) / "journeys",
            quarantine_folder=Path(tmp) / "quarantine",
        )
        journeys = scan_journeys(result.journeys_folder).collect()
    journeys = journeys.filter(~pl.col("censored"))
    labels = journeys.get_column("label").to_numpy()
    logits = trained.predict_logits(journeys)
    served = M.binary_metrics(labels, trained.probabilities(logits, journeys), prefix="")
    alone = M.binary_metrics(labels, M.sigmoid(logits), prefix="")
    booster = {"roc_auc": math.nan, "pr_auc": math.nan}
    if trained.stack is not None:
        booster = M.binary_metrics(labels, trained.stack.baseline.predict_proba(journeys), "")
    return {
        "served_roc_auc": served["roc_auc"],
        "served_pr_auc": served["pr_auc"],
        "transformer_roc_auc": alone["roc_auc"],
        "transformer_pr_auc": alone["pr_auc"],
        "booster_roc_auc": booster["roc_auc"],
        "booster_pr_auc": booster["pr_auc"],
        "journeys": float(len(labels)),
        "conversions": float(labels.sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="a CausalMTA checkout or git directory")
    parser.add_argument("--evaluate", metavar="MODEL_URI", help="score the test journeys")
    parser.add_argument("--tracking-uri", help="where MODEL_URI is (default: the config's)")
    parser.add_argument("--record", action="store_true", help="write the RESULTS.md section")
    args = parser.parse_args()
    if args.source:
        convert(args.source)
    if args.evaluate:
        figures = evaluate(args.evaluate, args.tracking_uri)
        print(figures)
        if args.record:
            record(figures, " ".join(sys.argv[1:]))


def record(figures: dict[str, float], arguments: str) -> None:
    from datetime import date

    from benchmarks.recording import machine, record_section

    record_section(
        f"""## Criteo attribution journeys, CausalMTA's test split ({date.today().isoformat()})

`python benchmarks/criteo_mta.py {arguments}` on {machine()}: the model trained on the train
journeys (the product's own temporal split, the defaults), scored on CausalMTA's
{figures["journeys"]:,.0f} test journeys ({figures["conversions"]:,.0f} converted), never
used to choose anything. Published: DCRMTA 0.801 (CausalMTA's table).

| probability | ROC AUC | PR AUC |
|---|---|---|
| served (the registered candidate) | {figures["served_roc_auc"]:.4f} | {figures["served_pr_auc"]:.4f} |
| the transformer alone | {figures["transformer_roc_auc"]:.4f} | {figures["transformer_pr_auc"]:.4f} |
| the stack's booster alone (`hgb_aggregates`; nan: no stack) | {figures["booster_roc_auc"]:.4f} | {figures["booster_pr_auc"]:.4f} |
"""
    )


if __name__ == "__main__":
    main()
