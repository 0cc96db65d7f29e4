"""The far end of ``tandem run --hostfile``: one per host, started by ssh, running that host's
``tandem run`` and stopping it when the launching machine says so, or is gone.

Its stdin is the ssh connection's: the first line is the request (JSON: ``argv``, the host's
``tandem run`` command; ``env``, variables to add, the job's secret among them;
``kill_after``, seconds), each later line ``signal N``, which the agent sends to the host's
launcher. The end of stdin means that the launching machine or its ssh client is gone (ssh
without a terminal sends no SIGHUP, so this is how a host learns it): the agent sends SIGTERM,
and SIGKILL after ``kill_after`` seconds. The launcher dies with the agent (PR_SET_PDEATHSIG)
and its workers with it, so killing the agent leaves nothing behind either. The agent exits
with the launcher's status (128 + N for signal N), which ssh passes back.

Example (what ``tandem run --hostfile`` runs on each host)::

    ssh -T node1 'cd /work && exec python -u -m tandem.launch.ssh_agent'
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import IO

from tandem.launch.supervisor import in_own_group_dying_with_parent


def listen(stdin: IO[str], launcher: subprocess.Popen[bytes], kill_after: float) -> None:
    """Pass each ``signal N`` line to ``launcher``; at the end of ``stdin``, stop it."""
    for line in stdin:
        word, _, number = line.strip().partition(" ")
        if word == "signal" and number.isdigit() and launcher.poll() is None:
            launcher.send_signal(int(number))
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            launcher.kill()


def main() -> int:
    """Run the request read from stdin; the launcher's exit status."""
    request = json.loads(sys.stdin.readline() or "null")
    if not isinstance(request, dict) or not request.get("argv"):
        print("tandem.launch.ssh_agent: no request on stdin (run by tandem run --hostfile)")
        return 2
    launcher = subprocess.Popen(
        request["argv"],
        env={**os.environ, **request.get("env", {})},
        stdin=subprocess.DEVNULL,
        # Its own session (a signal to the agent's group is not one to the job), and SIGKILL
        # when the agent dies: the launcher's workers then die with it.
        preexec_fn=in_own_group_dying_with_parent,
    )
    threading.Thread(
        target=listen, args=(sys.stdin, launcher, float(request["kill_after"])), daemon=True
    ).start()
    code = launcher.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
