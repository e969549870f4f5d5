"""Prefect orchestration of the `journeys` library: flows, caching, schedules.

The library (`journeys/`) never imports Prefect; everything Prefect-specific lives here.
"""

from flows import _env  # noqa: F401  (environment defaults before Prefect is imported)
