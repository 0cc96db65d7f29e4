"""A many-node job's store keys live under the job's secret: a program without it that reaches
node 0's port can neither read the launchers' keys nor forge a failure that stops the job.

Two real launcher coordinators (node 0 hosting torch's TCPStore, node 1 connecting) meet on
loopback, and a third client, the intruder, writes the failure key by the name it would have
without a secret. With the secret the job ignores it; without one (the control) the same forged
key is taken for a real failure, so the test can tell the difference.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict
from datetime import timedelta

import pytest
import torch.distributed as dist

from tandem.launch.failures import Failure
from tandem.launch.rendezvous import StoreCoordinator
from tests.harness import free_port

pytestmark = pytest.mark.timeout(60)
FORGED = Failure(rank=3, local_rank=1, host="intruder", returncode=1, tail=("forged",))


def _two_nodes(port: int) -> tuple[StoreCoordinator, StoreCoordinator]:
    node0 = StoreCoordinator(2, 0, "127.0.0.1", port, timeout=20)
    node1 = StoreCoordinator(2, 1, "127.0.0.1", port, timeout=20)
    other = threading.Thread(target=node1.begin, args=(0,))
    other.start()
    node0.begin(0)
    other.join()
    return node0, node1


def _intruder(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))


@pytest.mark.parametrize("secret", ["a shared secret", None])
def test_a_forged_failure_key_stops_the_job_only_without_a_secret(monkeypatch, secret):
    if secret is None:
        monkeypatch.delenv("TANDEM_JOB_SECRET", raising=False)
    else:
        monkeypatch.setenv("TANDEM_JOB_SECRET", secret)
    port = free_port()
    node0, node1 = _two_nodes(port)
    intruder = _intruder(port)
    # What an intruder knows: the key names of a job without a secret (this source is public).
    assert intruder.check(["tandem/attempt_0/node_0"]) is (secret is None)
    intruder.set("tandem/attempt_0/failed", json.dumps(asdict(FORGED)))
    seen = node0.remote_failure(0), node1.remote_failure(0)
    if secret is None:
        assert seen == (FORGED, FORGED)
        return
    assert seen == (None, None)
    # The nodes themselves still hear each other's real failures.
    real = Failure(rank=2, local_rank=0, host="node1", returncode=-9, tail=())
    node1.report_failure(0, real)
    assert node0.remote_failure(0) == real
