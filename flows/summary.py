"""What a run produced, as Markdown (Prefect artifacts) and as the console summary."""

from __future__ import annotations

from typing import Any

from journeys.metrics import format_metric
from journeys.promotion import baseline_kind

METRICS = ("roc_auc", "pr_auc", "log_loss", "brier", "ece")
LOCAL_MLFLOW_UI = "journeys ui  (MLflow UI for {store} on http://127.0.0.1:5000)"
LOCAL_PREFECT_UI = (
    "prefect server start  (Prefect UI on http://127.0.0.1:4200: runs, deployments, artifacts)"
)


def mlflow_ui(servers: dict[str, str | None]) -> str:
    """Where to see the runs: the tracking server used, else how to open a UI on the store."""
    uri = servers.get("mlflow") or ""
    if uri.startswith(("http://", "https://")):
        return f"{uri}  (runs, models, champion)"
    return LOCAL_MLFLOW_UI.format(store=uri or "the configured store")


def prefect_ui(servers: dict[str, str | None]) -> str:
    """Where to see the flow runs: the Prefect server used, else how to start one."""
    api = servers.get("prefect")
    if api:
        return f"{api.rstrip('/').removesuffix('/api')}  (runs, deployments, artifacts)"
    return LOCAL_PREFECT_UI


def _cached(stage: dict[str, Any]) -> str:
    return " (cached: inputs unchanged)" if stage.get("cached") else ""


def metric_rows(train: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """(model, test metrics) for the transformer, the stack when there was one, then each
    baseline; the one the registered version serves is marked."""
    metrics = train.get("metrics", {})
    served = train.get("model_kind", "transformer")
    rows = [("transformer", metrics)]
    if "stacked_test_roc_auc" in metrics:
        stack = {
            f"test_{key.removeprefix('stacked_test_')}": value
            for key, value in metrics.items()
            if key.startswith("stacked_test_")
        }
        rows.append(("stack", stack))
    for name, baseline in sorted(train.get("baselines", {}).items()):
        rows.append((baseline_kind(name), baseline.get("metrics", {})))
    return [(f"{model} (served)" if model == served else model, m) for model, m in rows]


def metrics_markdown(train: dict[str, Any]) -> str:
    lines = [
        "| model | " + " | ".join(METRICS) + " |",
        "|---|" + "---:|" * len(METRICS),
    ]
    for model, metrics in metric_rows(train):
        lines.append(
            f"| {model} | " + " | ".join(format_metric(metrics, m) for m in METRICS) + " |"
        )
    return "\n".join(lines)


def ingest_markdown(report: dict[str, Any], journeys: str, quarantine: str) -> str:
    splits = ", ".join(f"{k} {v:,}" for k, v in report.get("journeys_by_split", {}).items())
    reasons = ", ".join(f"{k} {v:,}" for k, v in report.get("quarantined", {}).items() if v)
    return "\n".join(
        [
            "| what | count |",
            "|---|---:|",
            f"| rows read | {report['rows_read']:,} |",
            f"| rows valid | {report['rows_valid']:,} |",
            f"| quarantined | {report['quarantined_total']:,} |",
            f"| duplicates dropped | {report['duplicates_dropped']:,} |",
            f"| dropped by config | {report['dropped_by_config']:,} |",
            f"| journeys | {report['journeys']:,} |",
            f"| converted | {report['journeys_converted']:,} |",
            f"| censored | {report['journeys_censored']:,} |",
            "",
            f"Splits: {splits}. Quarantine reasons: {reasons or 'none'}.",
            "",
            f"Journeys: `{journeys}`; quarantined rows: `{quarantine}`.",
        ]
    )


def baselines_ahead(train: dict[str, Any]) -> str | None:
    """A note when baselines beat the transformer alone beyond its interval on test (None
    if none): the model served was chosen among all of them on val."""
    ahead = train.get("baselines_ahead") or []
    if not ahead:
        return None
    names = ", ".join(baseline_kind(name) for name in ahead)
    return (
        f"{names} beat the transformer alone beyond its 95% interval on test (the version "
        f"serves {train.get('model_kind', 'transformer')}, chosen on val)"
    )


def train_markdown(train: dict[str, Any]) -> str:
    decision = "promoted to champion" if train.get("promoted") else "champion unchanged"
    warning = baselines_ahead(train)
    return "\n".join(
        [
            "Test metrics on the same time-based test split:",
            "",
            metrics_markdown(train),
            "",
            *([f"**Note**: {warning}.", ""] if warning else []),
            f"Model version **{train.get('model_version')}** of "
            f"`{train.get('registered_model')}`, serving "
            f"`{train.get('model_kind', 'transformer')}` ({decision}); champion version: "
            f"**{train.get('champion_version')}**.",
            "",
            *(
                [f"Chosen on the validation split: {reason}.", ""]
                if (reason := train.get("champion_reason"))
                else []
            ),
            f"MLflow run `{train.get('run_id')}` in `{train.get('tracking_uri')}`.",
        ]
    )


def score_markdown(score: dict[str, Any]) -> str:
    opened = (
        f" As of {score['as_of']}, **{score['open']:,}** of them are open: their probability "
        "is the chance they convert from here on."
        if score.get("as_of")
        else ""
    )
    return (
        f"Scored **{score['rows']:,}** journeys with `{score['model_uri']}` "
        f"(version {score.get('model_version')}) into `{score['out']}`.{opened}"
    )


def credit_markdown(credit: list[dict[str, Any]]) -> str:
    """Credit per touchpoint and method (shares of conversions, in %)."""
    if not credit:
        return "No converting journeys: no credit to share."
    methods = [k for k in credit[0] if k not in ("dimension", "touchpoint")]
    lines = [
        f"| {credit[0].get('dimension', 'touchpoint')} | " + " | ".join(methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for row in credit:
        shares = " | ".join("n/a" if row[m] is None else f"{100 * row[m]:.1f}%" for m in methods)
        lines.append(f"| {row['touchpoint']} | {shares} |")
    return "\n".join(lines)


def attribution_markdown(attribution: dict[str, Any]) -> str:
    files = "\n".join(f"- `{name}`" for name in attribution.get("files", []))
    return (
        f"{credit_markdown(attribution.get('credit', []))}\n\n"
        f"Attribution report in `{attribution['out']}`:\n\n{files}"
    )


def pipeline_markdown(summary: dict[str, Any]) -> str:
    """The pipeline run's artifact: counts, metrics, champion, where everything is."""
    parts = ["# journeys pipeline", ""]
    if summary.get("simulated"):
        sim = summary["simulated"]
        parts += [f"Simulated {sim['users']:,} users into `{sim['out']}` (raw was empty).", ""]
    parts += [
        f"## Ingest{_cached(summary['ingest'])}",
        "",
        ingest_markdown(
            summary["ingest"], summary["paths"]["journeys"], summary["paths"]["quarantine"]
        ),
        "",
        f"## Train{_cached(summary['train'])}",
        "",
        train_markdown(summary["train"]),
        "",
        f"## Score{_cached(summary['score'])}",
        "",
        score_markdown(summary["score"]),
        "",
        f"## Attribution{_cached(summary['attribution'])}",
        "",
        attribution_markdown(summary["attribution"]),
        "",
        f"MLflow: `{mlflow_ui(summary.get('servers', {}))}`.",
    ]
    return "\n".join(parts)


def monitor_lines(monitor: dict[str, Any] | None) -> list[str]:
    """The monitor's night in one line, and one line per alert."""
    if not monitor:
        return []
    status = f"{len(monitor['alerts'])} alert(s)" if monitor["alerts"] else "no alert"
    head = f"  monitor: night {monitor['night']}, {monitor['checks']} checks, {status}: {monitor['page']}"  # fmt: skip
    return [head, *(f"    {line}" for line in monitor["alerts"])]


def console_summary(summary: dict[str, Any]) -> str:
    """The short text `journeys pipeline` prints at the end."""
    ingest, train = summary["ingest"], summary["train"]
    score, attribution = summary["score"], summary["attribution"]
    rows = [
        (model, [format_metric(metrics, m) for m in METRICS])
        for model, metrics in metric_rows(train)
    ]
    width = max(len(model) for model, _ in rows)
    widths = [
        max(len(name), *(len(cells[i]) for _, cells in rows)) for i, name in enumerate(METRICS)
    ]
    header = f"    {'model':<{width}}  " + "  ".join(
        f"{m:>{w}}" for m, w in zip(METRICS, widths, strict=True)
    )
    table = [header] + [
        f"    {model:<{width}}  "
        + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
        for model, cells in rows
    ]
    decision = "promoted" if train.get("promoted") else "not promoted"
    lines = [f"journeys pipeline: done in {summary['seconds']:.0f} s"]
    if summary.get("simulated"):
        sim = summary["simulated"]
        lines.append(f"  simulated {sim['users']:,} users into {sim['out']} (raw was empty)")
    lines += [
        f"  ingest{_cached(ingest)}: {ingest['rows_read']:,} rows read, "
        f"{ingest['rows_valid']:,} valid, {ingest['quarantined_total']:,} quarantined, "
        f"{ingest['duplicates_dropped']:,} duplicates -> {ingest['journeys']:,} journeys "
        f"({ingest['journeys_converted']:,} converted, {ingest['journeys_censored']:,} censored)",
        f"  train{_cached(train)}: test metrics of every candidate:",
        *table,
        *([f"  note: {warning}"] if (warning := baselines_ahead(train)) else []),
        f"  champion: {train.get('registered_model')} version {train.get('champion_version')} "
        f"(this run's model: version {train.get('model_version')}, serving "
        f"{train.get('model_kind', 'transformer')}, {decision})",
        *([f"    on val: {reason}"] if (reason := train.get("champion_reason")) else []),
        f"  scores{_cached(score)}: {score['rows']:,} journeys in {score['out']}",
        f"  attribution report{_cached(attribution)}: {attribution['out']}",
        *monitor_lines(summary.get("monitor")),
        f"  MLflow:  {mlflow_ui(summary.get('servers', {}))}",
        f"  Prefect: {prefect_ui(summary.get('servers', {}))}",
    ]
    return "\n".join(lines)
