"""Offline-friendly defaults for variables the user left unset; import before Prefect."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# A flow run with no PREFECT_API_URL starts a temporary server. Its very first start on a
# machine creates and migrates ~/.prefect/prefect.db, which took longer than Prefect's 20 s
# default on 2 cores: `make run` on a fresh machine died with "Timed out while attempting
# to connect to ephemeral Prefect API server" (the second start took 5 s).
SERVER_START_TIMEOUT_S = 120  # also the bound on the servers `flows.prefect_server` starts
os.environ.setdefault(
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(SERVER_START_TIMEOUT_S)
)
