#!/usr/bin/env bash
# Make sure a PostgreSQL server (initdb, pg_ctl) is installed, for the shared-servers tests
# (tests/test_shared_servers.py starts its own throwaway cluster on 127.0.0.1), and
# openssl, for the Dask cluster tests' TLS certificate (tests/test_dask_cluster.py), and
# Chromium, to render the monitor's page headless (tests/test_monitor.py).
# Installs Debian's packages where they are missing; says so and exits 0 where it cannot,
# and those tests then skip with the reason.
set -uo pipefail
if ! command -v openssl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  echo "installing openssl (apt-get install openssl) for the Dask cluster tests"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssl >/dev/null 2>&1 \
    || echo "openssl could not be installed here: tests/test_dask_cluster.py will skip"
fi
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  echo "installing Chromium (apt-get install chromium) for the monitor page's browser test"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
    || (apt-get update -q >/dev/null 2>&1 \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1) \
    || echo "Chromium could not be installed here: the monitor page's browser test will skip"
fi
if command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing PostgreSQL (apt-get install postgresql) for the shared-servers tests"
  export DEBIAN_FRONTEND=noninteractive
  if (apt-get install -y -q postgresql >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q postgresql >/dev/null 2>&1)); then
    exit 0
  fi
fi
echo "PostgreSQL could not be installed here: tests/test_shared_servers.py will skip"
exit 0
