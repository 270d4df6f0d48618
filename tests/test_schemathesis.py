"""schemathesis against the gateway's own OpenAPI schema: a short,
deterministic run that generates valid and invalid requests for every operation, with an
API key set. No response may be a 5xx: whatever the parser, the limits or the
workers stumble on is the client's 4xx or a served request."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_fixtures import cluster_fixture, start_gateway, start_workers, wait_blocks_free

KEY = "soak-key"
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")

pytestmark = pytest.mark.skipif(not SCHEMATHESIS.exists() and not shutil.which("schemathesis"),
                                reason="schemathesis is a test dependency (make install)")

cluster = cluster_fixture()


def test_no_request_gets_a_server_error(cluster, tmp_path):
    workers = start_workers(cluster, ["prefill", "decode"], 128)
    gateway = start_gateway(cluster, workers, "--api-key", KEY, "--max-model-len", "256")
    run = subprocess.run(
        [str(SCHEMATHESIS), "run", f"{gateway.url}/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "30", "--generation-deterministic", "--request-timeout", "60", "--workers", "1",
         "--header", f"Authorization: Bearer {KEY}", "--no-color"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = run.stdout[-6000:] + run.stderr[-2000:]
    print(report)
    assert run.returncode == 0, report
    # Something was really sent, and every case passed.
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", run.stdout).groups())
    assert generated == passed >= 100, report
    wait_blocks_free(workers)
