"""Real public event logs from GitHub repositories, for trying the product on real data.

Each entry names a journeys configuration (`conf/public_<name>.yaml`), where its raw file
lives once brought in (under the git-ignored `data/public/`), and how to bring it in. The
data are never committed: their licences do not clearly allow redistribution (see each
`data/public/<name>/SOURCE.md`).

    python benchmarks/public_logs.py            # list the logs and whether each is here
    journeys ingest --config conf/public_taobao.yaml
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PublicLog:
    """One public event log: its configuration, raw file and provenance."""

    name: str
    config: str  # relative to the repository root
    raw: str  # relative to the repository root
    note: str
    repo_url: str
    commit: str
    path: str  # of the file in that repository
    bring_in: str  # shell commands, run at the repository root, that put `raw` in place
    licence: str

    def raw_path(self, root: Path = ROOT) -> Path:
        """The raw file's absolute path under `root`."""
        return root / self.raw

    def config_path(self, root: Path = ROOT) -> Path:
        """The configuration's absolute path under `root`."""
        return root / self.config


PUBLIC_LOGS: tuple[PublicLog, ...] = (
    PublicLog(
        name="taobao",
        config="conf/public_taobao.yaml",
        raw="data/public/taobao/UserBehavior_head.csv",
        note=(
            "Taobao UserBehavior (Alibaba Tianchi), first 84,476 rows = 815 complete users, "
            "pv/cart/fav/buy, 2017-11-25..12-03; conversion: buy"
        ),
        repo_url="https://github.com/Haohanblue/mydeep",
        commit="ef812addc2c164f1d3ef48564a5c393ec293bc61",
        path="mydeep/UserBehavior.csv",
        bring_in=(
            "git clone --filter=blob:none https://github.com/Haohanblue/mydeep /tmp/mydeep && "
            "git -C /tmp/mydeep checkout ef812addc2c164f1d3ef48564a5c393ec293bc61 && "
            "mkdir -p data/public/taobao && "
            "cp /tmp/mydeep/mydeep/UserBehavior.csv data/public/taobao/UserBehavior_head.csv"
            "  # sha256 9cbce278d485d50954029082dd1b22f0dc78dc38776f58d953f0cbe18d6608b4"
        ),
        licence=(
            "repository: none stated; dataset: Alibaba Tianchi terms (dataset 649), "
            "research use; redistribution not established - do not commit"
        ),
    ),
    PublicLog(
        name="talkingdata",
        config="conf/public_talkingdata.yaml",
        raw="data/public/talkingdata/train_sample.csv",
        note=(
            "TalkingData AdTracking (Kaggle 2018) train_sample: 100,000 app-ad clicks over "
            "four days, 227 attributed (a flag column); a journey is an ip's clicks"
        ),
        repo_url="https://github.com/markqle/TalkingData-AdFraud-ML",
        commit="19e50f1408a3c4622ea53f3e507f4e0de1bbffcb",
        path="train_sample.csv",
        bring_in=(
            "git clone --filter=blob:none https://github.com/markqle/TalkingData-AdFraud-ML "
            "/tmp/talkingdata && git -C /tmp/talkingdata checkout "
            "19e50f1408a3c4622ea53f3e507f4e0de1bbffcb && mkdir -p data/public/talkingdata && "
            "cp /tmp/talkingdata/train_sample.csv data/public/talkingdata/"
            "  # sha256 c39a0af0a7da004c09da70091e222a01d4ee80409af2c5d15b36aa36a49fa552"
        ),
        licence=(
            "Kaggle competition data (TalkingData AdTracking Fraud Detection), research "
            "use; redistribution not established - do not commit"
        ),
    ),
    PublicLog(
        name="criteo_mta",
        config="conf/public_criteo_mta.yaml",
        raw="data/public/criteo_mta/train/events.parquet",
        note=(
            "Criteo attribution journeys as preprocessed by CausalMTA (KDD 2022): 164,647 "
            "train journeys of campaign touches, 16,400 converted; their 31,913 test "
            "journeys only for the final figure (benchmarks/criteo_mta.py --evaluate)"
        ),
        repo_url="https://github.com/yaodi833/CausalMTA",
        commit="3ec94ac",
        path="data/{train,test}/{C,T,Y}_*.pkl",
        bring_in=(
            "git clone https://github.com/yaodi833/CausalMTA /tmp/CausalMTA && "
            "git -C /tmp/CausalMTA checkout 3ec94ac && "
            "python benchmarks/criteo_mta.py --source /tmp/CausalMTA"
        ),
        licence="CC BY-NC-SA 4.0 (Criteo's data set): research use - do not commit",
    ),
)


def available(root: Path = ROOT) -> list[PublicLog]:
    """The public logs whose raw file is present under `root`."""
    return [log for log in PUBLIC_LOGS if log.raw_path(root).is_file()]


def main() -> None:
    """Print each log, whether its raw file is here, and how to bring it in if not."""
    here = {log.name for log in available()}
    for log in PUBLIC_LOGS:
        status = "present" if log.name in here else "absent"
        print(f"{log.name}: {status} - {log.note}")
        print(f"  config {log.config}, raw {log.raw}")
        print(f"  source {log.repo_url} @ {log.commit}:{log.path} ({log.licence})")
        if log.name not in here:
            print(f"  bring in: {log.bring_in}")


if __name__ == "__main__":
    main()
