"""Writes the small logs in this folder, one per export shape the product reads (CC0).

Each is simulated here (no real user is in them) in the shape teams really export:

- `ad_clicks/clicks.csv`: an ad-click log whose conversion is a flag column of the
  converting click (`is_attributed`) with the conversion's own time (`attributed_time`),
  as in the TalkingData and Criteo attribution data; `conf/ad_clicks.yaml` reads it.
- `renamed_daily/day-*.csv`: daily files of one export whose header changed: the user
  column is `client_id`, then `clientId`; the last day has no `device` column.
- `text_times.csv`: timestamps as text in a day-first layout (`07/11/2017 9:30`), for
  `data.timestamp_format`; `iso_minutes.csv`: ISO 8601 without seconds, with `Z`, an
  offset or none, `T` or a space.
- `same_second.csv`: a session log whose events often share a second; its `step` column
  says their order, and its rows are shuffled within each second.
- `short_export.csv`: three days of the product's simulator (`journey.max_gap` is 7 days).

    python data/samples/shapes/make.py      # rewrites them all, byte for byte
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl

HERE = Path(__file__).resolve().parent
SEED = 7
START = datetime(2017, 11, 6, tzinfo=UTC)

# ad_clicks: ips, the apps advertised and how strongly each converts (log-odds).
AD_IPS = 600
AD_DAYS = 12
AD_APPS = {"app_3": 0.0, "app_9": -0.5, "app_12": 1.6, "app_15": -1.2, "app_18": 0.8}
AD_CHANNELS = ("ch_101", "ch_205", "ch_280", "ch_377")
AD_OS = ("os_13", "os_19", "os_22")
AD_INTERCEPT = -3.0
AD_PER_CLICK = 0.45  # each earlier click of the journey raises the odds


def ad_clicks(rng: np.random.Generator) -> pl.DataFrame:
    """Journeys of 1-6 clicks per ip, a day or more apart; the last click of a converting
    journey carries `is_attributed = 1` and the download's time minutes to hours later."""
    rows = []
    apps = list(AD_APPS)
    for ip in range(AD_IPS):
        moment = START + timedelta(hours=float(rng.uniform(0, 24 * AD_DAYS)))
        end = START + timedelta(days=AD_DAYS)
        while moment < end:
            n_clicks = int(rng.integers(1, 7))
            app = apps[int(rng.integers(len(apps)))]
            clicks = []
            for _ in range(n_clicks):
                clicks.append((moment, app if rng.random() < 0.7 else apps[rng.integers(5)]))
                moment += timedelta(minutes=float(rng.exponential(40)))
            log_odds = AD_INTERCEPT + AD_APPS[clicks[-1][1]] + AD_PER_CLICK * (n_clicks - 1)
            converted = rng.random() < 1 / (1 + np.exp(-log_odds))
            for k, (at, clicked) in enumerate(clicks):
                last = k == n_clicks - 1
                attributed = at + timedelta(minutes=float(rng.exponential(90)))
                rows.append(
                    {
                        "ip": f"{100000 + ip * 37}",
                        "app": clicked,
                        "device": "1",
                        "os": AD_OS[int(rng.integers(len(AD_OS)))],
                        "channel": AD_CHANNELS[int(rng.integers(len(AD_CHANNELS)))],
                        "click_time": at.strftime("%Y-%m-%d %H:%M:%S"),
                        "attributed_time": (
                            attributed.strftime("%Y-%m-%d %H:%M:%S") if converted and last else ""
                        ),
                        "is_attributed": int(converted and last),
                    }
                )
            moment += timedelta(days=float(1.2 + rng.exponential(2.0)))
    return pl.DataFrame(rows).sort("click_time", "ip")


def renamed_daily(rng: np.random.Generator) -> dict[str, pl.DataFrame]:
    """Three daily files of 40 users: the user column renamed on day 2, `device` gone on 3."""
    days = {}
    for day in range(3):
        rows = []
        for user in range(40):
            base = START + timedelta(days=day, hours=float(rng.uniform(8, 20)))
            for step, event in enumerate(("page_view", "product_view", "purchase")[: 2 + user % 2]):
                rows.append(
                    {
                        "user": f"c{user:03d}",
                        "timestamp": (base + timedelta(minutes=3 * step)).isoformat(),
                        "event": event,
                        "channel": ("email", "display", "social")[user % 3],
                        "device": ("mobile", "desktop")[user % 2],
                    }
                )
        frame = pl.DataFrame(rows)
        frame = frame.rename({"user": "client_id" if day == 0 else "clientId"})
        days[f"day-2017-11-{6 + day:02d}.csv"] = frame.drop("device") if day == 2 else frame
    return days


def text_times() -> tuple[pl.DataFrame, pl.DataFrame]:
    """The same 4 events with day-first text times, and 4 with ISO 8601 minute times."""
    day_first = pl.DataFrame(
        {
            "user_id": ["u1", "u1", "u2", "u2"],
            "timestamp": ["07/11/2017 9:30", "07/11/2017 9:41", "08/11/2017 18:05", "08/11/2017 18:20"],
            "event_type": ["page_view", "purchase", "page_view", "add_to_cart"],
        }
    )  # fmt: skip
    iso_minutes = pl.DataFrame(
        {
            "user_id": ["u1", "u1", "u1", "u1"],
            "timestamp": ["2017-11-07T09:31Z", "2017-11-07T09:33+01:00", "2017-11-07 09:35", "2017-11-07T09:40:30.250Z"],
            "event_type": ["page_view", "product_view", "add_to_cart", "purchase"],
        }
    )  # fmt: skip
    return day_first, iso_minutes


def same_second(rng: np.random.Generator) -> pl.DataFrame:
    """Sessions of searches and item views that end in a paid click-out, several events to
    a second; the `step` column holds their order, the rows are shuffled in each second."""
    rows = []
    for user in range(30):
        moment = START + timedelta(hours=user)
        steps = ["search", "view", "view", "filter", "view", "clickout"][: 3 + user % 4]
        if steps[-1] != "clickout":
            steps.append("clickout")
        for step, event in enumerate(steps, start=1):
            rows.append(
                {
                    "session": f"s{user:02d}",
                    "timestamp": moment.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "action": event,
                    "step": step,
                    "item": f"i{int(rng.integers(1000))}",
                }
            )
            moment += timedelta(seconds=int(rng.integers(0, 2)))  # half share a second
    frame = pl.DataFrame(rows).with_columns(shuffle=pl.Series(rng.random(len(rows))))
    return frame.sort("session", "timestamp", "shuffle").drop("shuffle")


# short_export: the days an export covers, cut from a month of this many users.
SHORT_USERS, SHORT_DAYS = 600, 3


def short_export(out: Path) -> None:
    sys.path.insert(0, str(HERE.parents[2]))
    from journeys.simulate import simulate

    scratch = out.parent / "_short"
    simulate(scratch, users=SHORT_USERS, seed=SEED, days=30, start=START.replace(tzinfo=None))
    begin = (START + timedelta(days=10)).strftime("%Y-%m-%d")
    end = (START + timedelta(days=10 + SHORT_DAYS)).strftime("%Y-%m-%d")
    log = pl.read_csv(scratch / "events.csv")  # ISO 8601 text: compares as time
    window = pl.col("timestamp").is_between(pl.lit(begin), pl.lit(end), closed="left")
    log.filter(window).write_csv(out)
    for path in sorted(scratch.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    scratch.rmdir()


def main() -> None:
    rng = np.random.default_rng(SEED)
    (HERE / "ad_clicks").mkdir(exist_ok=True)
    ad_clicks(rng).write_csv(HERE / "ad_clicks" / "clicks.csv")
    (HERE / "renamed_daily").mkdir(exist_ok=True)
    for name, frame in renamed_daily(rng).items():
        frame.write_csv(HERE / "renamed_daily" / name)
    day_first, iso_minutes = text_times()
    day_first.write_csv(HERE / "text_times.csv")
    iso_minutes.write_csv(HERE / "iso_minutes.csv")
    same_second(rng).write_csv(HERE / "same_second.csv")
    short_export(HERE / "short_export.csv")


if __name__ == "__main__":
    main()
