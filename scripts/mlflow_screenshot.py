"""Screenshot MLflow's run comparison (transformer vs baselines) into docs/mlflow_compare.png.

Usage (after a `journeys pipeline` or `journeys train` run):

    .venv/bin/python scripts/mlflow_screenshot.py [--config conf/default.yaml]
        [--run-id RUN] [--out docs/mlflow_compare.png]

Starts `mlflow ui` on 127.0.0.1 (a free port) against the configured tracking store,
opens the comparison of the latest transformer run and the baselines logged beside it in
headless Chromium and saves the screenshot. Needs Debian's `chromium` and
`chromium-driver` (`apt-get install -y chromium chromium-driver`). With `selenium`
installed (`pip install selenium`) the page is arranged first: the test metrics in the
parallel-coordinates plot, long sections folded; without it, the page as it opens.
Nothing leaves the machine: the browser runs with background networking, component
updates and sync disabled, in a fresh profile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from journeys.config import load_config
from journeys.tracking import MODEL_FAMILY_TAG, tracking_uri

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--window-size=1600,1500",
]
PLOTTED = ("test_roc_auc", "test_pr_auc", "test_log_loss", "test_brier", "test_ece")
FOLDED = ("Parameters", "Artifacts", "Tags")


def comparison_runs(uri: str, experiment: str, run_id: str | None) -> tuple[str, list[str]]:
    """(experiment id, [transformer run, its baseline runs]) from the tracking store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        sys.exit(f"no experiment {experiment!r} in {uri}: run `journeys pipeline` first")
    if run_id is None:
        latest = client.search_runs(
            [found.experiment_id],
            filter_string=f"tags.{MODEL_FAMILY_TAG} = 'transformer' and status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not latest:
            sys.exit(f"no finished transformer run in experiment {experiment!r}")
        run_id = latest[0].info.run_id
    baselines = client.search_runs(
        [found.experiment_id], filter_string=f"tags.comparison_group = '{run_id}'"
    )
    others = [r.info.run_id for r in baselines if r.info.run_id != run_id]
    return found.experiment_id, [run_id, *others]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def mlflow_ui(uri: str) -> Iterator[str]:
    """`mlflow ui` on 127.0.0.1 for the duration of the block; yields its base URL."""
    port = _free_port()
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # its web server is a child: stop the whole group
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    sys.exit("mlflow ui did not start")
                time.sleep(0.5)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def compare_url(base: str, experiment_id: str, run_ids: list[str]) -> str:
    query = urllib.parse.urlencode(
        {"runs": json.dumps(run_ids), "experiments": json.dumps([experiment_id])}
    )
    return f"{base}/#/compare-runs?{query}"


def _browser() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("chromium not found: apt-get install -y chromium chromium-driver")
    return browser


def screenshot_plain(url: str, out: Path, profile: str) -> None:
    """Chromium's own --screenshot: the page as it first renders."""
    command = [_browser(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    # Virtual time lets the single-page app fetch and draw the runs before the shot.
    command += ["--virtual-time-budget=20000", f"--screenshot={out.absolute()}", url]
    subprocess.run(command, check=True, timeout=180, capture_output=True)


def screenshot_arranged(url: str, out: Path, profile: str) -> None:
    """Through chromedriver: plot the test metrics, fold the long sections, then shoot."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = _browser()
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(url)
        wait = WebDriverWait(driver, 60)
        wait.until(
            ready.presence_of_element_located((By.CSS_SELECTOR, "[data-testid=clear-button]"))
        )
        time.sleep(2)  # the plot and tables finish drawing

        def click(xpath: str) -> None:
            for element in driver.find_elements(By.XPATH, xpath):
                with contextlib.suppress(Exception):
                    element.click()
                    return

        click("//button[@aria-label='Close']")  # the assistant side panel, if any
        for section in FOLDED:
            click(f"//*[@role='button' and normalize-space(.)='{section}']")
        click("//button[@aria-label='Metrics - Show diff only']")
        click("//*[@data-testid='clear-button']")
        label = driver.find_element(By.XPATH, "//*[normalize-space(text())='Metrics:']")
        box = label.find_element(By.XPATH, "following::input[1]")
        for metric in PLOTTED:
            box.click()
            box.send_keys(metric)
            time.sleep(0.3)
            box.send_keys(Keys.ENTER)
        box.send_keys(Keys.ESCAPE)
        # Typing scrolled the page: back to the top (window and inner scroll panes).
        driver.execute_script(
            "window.scrollTo(0, 0);"
            "document.querySelectorAll('*').forEach(e => { if (e.scrollTop) e.scrollTop = 0; });"
            "document.activeElement && document.activeElement.blur();"
        )
        time.sleep(2)
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def screenshot(url: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        try:
            import selenium  # noqa: F401
        except ImportError:
            screenshot_plain(url, out, profile)
        else:
            screenshot_arranged(url, out, profile)
    if not out.exists() or out.stat().st_size < 10_000:
        sys.exit(f"chromium wrote no usable screenshot to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=None, help="YAML (conf/default.yaml)")
    parser.add_argument("--run-id", default=None, help="transformer run (default: latest)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "mlflow_compare.png")
    args = parser.parse_args(argv)

    config = load_config(args.config)
    uri = tracking_uri(config)
    experiment_id, run_ids = comparison_runs(uri, config.mlflow.experiment, args.run_id)
    with mlflow_ui(uri) as base:
        url = compare_url(base, experiment_id, run_ids)
        print(f"comparing {len(run_ids)} runs: {url}")
        screenshot(url, args.out)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
