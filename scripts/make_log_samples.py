"""Write the committed log-shape samples: a simulated log in the GA4 BigQuery export schema
and as Segment track calls, under `data/samples/ga4/` and `data/samples/segment/`.

They exist so a user can see, and the tests can prove, that `conf/ga4.yaml` and
`conf/segment.yaml` read these shapes by configuration alone (nested records, epoch
microseconds, event names of their own). The events come from `journeys simulate`, so they
carry its conversion structure; only the shape is GA4's or Segment's.

    .venv/bin/python scripts/make_log_samples.py [--users 150] [--seed 7]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import polars as pl

from journeys.simulate import simulate
from journeys.storage import atomic_path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "data" / "samples"

GA4_EVENTS = {
    "search": "view_search_results",
    "page_view": "page_view",
    "product_view": "view_item",
    "click": "session_start",  # an ad click opens a session
    "add_to_cart": "add_to_cart",
    "checkout": "begin_checkout",
    "purchase": "purchase",
}
SEGMENT_EVENTS = {
    "search": "Products Searched",
    "page_view": "Page Viewed",
    "product_view": "Product Viewed",
    "click": "Promotion Clicked",
    "add_to_cart": "Product Added",
    "checkout": "Checkout Started",
    "purchase": "Order Completed",
}
MEDIUM = {
    "paid_search": "cpc",
    "display": "display",
    "social": "social",
    "email": "email",
    "affiliate": "affiliate",
    "direct": "(none)",
}
SOURCE = {
    "paid_search": "google",
    "display": "dv360",
    "social": "facebook",
    "email": "newsletter",
    "affiliate": "partner",
    "direct": "(direct)",
}


def simulated(users: int, seed: int) -> pl.DataFrame:
    with tempfile.TemporaryDirectory() as tmp:
        result = simulate(Path(tmp), users=users, seed=seed, days=30)
        return pl.read_csv(result.events_path).with_columns(
            pl.col("timestamp").str.to_datetime(time_zone="UTC", time_unit="us")
        )


def ga4_rows(log: pl.DataFrame) -> pl.DataFrame:
    """One row per event, as the GA4 BigQuery export (`events_YYYYMMDD`) holds it."""
    channel = pl.col("channel")
    return log.select(
        event_date=pl.col("timestamp").dt.strftime("%Y%m%d"),
        event_timestamp=pl.col("timestamp").dt.epoch("us"),
        event_name=pl.col("event_type").replace_strict(GA4_EVENTS),
        event_params=pl.concat_list(
            pl.struct(
                key=pl.lit("page_location"),
                value=pl.struct(
                    string_value=pl.format("https://shop.example/{}", pl.col("event_type")),
                    int_value=pl.lit(None, pl.Int64),
                ),
            ),
            pl.struct(
                key=pl.lit("ga_session_number"),
                value=pl.struct(
                    string_value=pl.lit(None, pl.String),
                    int_value=pl.int_range(pl.len()).over("user_id") + 1,
                ),
            ),
        ),
        user_id=pl.lit(None, pl.String),
        user_pseudo_id=pl.format("{}.1767225600", pl.col("user_id").str.extract(r"(\d+)")),
        device=pl.struct(
            category=pl.col("device"),
            operating_system=pl.col("device").replace_strict(
                {"mobile": "Android", "desktop": "Windows", "tablet": "iOS"}
            ),
            web_info=pl.struct(browser=pl.lit("Chrome")),
        ),
        geo=pl.struct(country=pl.lit("Netherlands"), city=pl.lit("Amsterdam")),
        traffic_source=pl.struct(
            name=pl.col("campaign").fill_null("(direct)"),
            medium=channel.replace_strict(MEDIUM),
            source=channel.replace_strict(SOURCE),
        ),
        stream_id=pl.lit("4178592113"),
        platform=pl.lit("WEB"),
    )


def segment_rows(log: pl.DataFrame) -> pl.DataFrame:
    """One Segment `track` call per event (what a warehouse or S3 export holds)."""
    channel = pl.col("channel")
    direct = channel == "direct"
    campaign = pl.when(~direct).then(
        pl.struct(
            name=pl.col("campaign"),
            source=channel.replace_strict(SOURCE),
            medium=channel.replace_strict(MEDIUM),
        )
    )
    return log.select(
        type=pl.lit("track"),
        event=pl.col("event_type").replace_strict(SEGMENT_EVENTS),
        messageId=pl.format("msg-{}", pl.int_range(pl.len())),
        anonymousId=pl.format("anon-{}", pl.col("user_id")),
        userId=pl.lit(None, pl.String),
        timestamp=pl.col("timestamp").dt.strftime("%Y-%m-%dT%H:%M:%S%.3fZ"),
        context=pl.struct(
            campaign=campaign,
            device=pl.struct(type=pl.col("device")),
            library=pl.struct(name=pl.lit("analytics.js"), version=pl.lit("4.1.0")),
        ),
        properties=pl.struct(
            path=pl.format("/{}", pl.col("event_type")),
            step=pl.int_range(pl.len()).over("user_id") + 1,
        ),
    )


def write(frame: pl.DataFrame, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        frame.write_ndjson(tmp)
    print(f"wrote {frame.height:,} rows to {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=150)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    log = simulated(args.users, args.seed)
    write(ga4_rows(log), SAMPLES / "ga4" / "events.jsonl")
    write(segment_rows(log), SAMPLES / "segment" / "events.jsonl")


if __name__ == "__main__":
    main()
