"""docker-compose.yml is a valid Compose file (``docker-compose config -q``).

No Docker engine runs here: this only validates the file, as ``make test``
installs the docker-compose binary for. The cluster it describes (workers
that register in Redis, a gateway given no worker addresses) is what
test_gateway_cluster and test_gateway_failover run as processes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("the docker-compose binary is not installed (make test installs it)")
    return binary


@pytest.mark.parametrize("overlays", [[], ["docker-compose.gpu.yml"], ["docker-compose.tls.yml"]],
                         ids=["cpu", "gpu", "tls"])
def test_compose_file_is_valid(compose, overlays):
    files = ["docker-compose.yml", *overlays]
    for name in overlays:
        if not (ROOT / name).is_file():
            pytest.skip(f"{name} does not exist")
    assert (ROOT / "docker-compose.yml").is_file(), "docker-compose.yml is missing"
    args = [compose]
    for name in files:
        args += ["-f", name]
    result = subprocess.run([*args, "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr or result.stdout
