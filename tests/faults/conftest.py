"""One fresh leader of ``configs/cpu_omni_demo.yaml`` per fault module.

Its finaliser stops the leader (SIGINT, as Ctrl-C) and asserts what the
shutdown left: no process of the system, no shared-memory segment; a
leftover shows as an error at the module's teardown.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_actors.system.faultlab import assert_clean_exit
from omni_actors.system.local import LocalLeader

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cpu_omni_demo.yaml"
#: Clients of the steady load, and the per-request timeout (a hang shows as a timeout, not a stuck test).
CLIENTS = 8
REQUEST_TIMEOUT_S = 20.0
#: configs/cpu_omni_demo.yaml's heartbeat interval.
HEARTBEAT_S = 1.0


@pytest.fixture(scope="module")
def leader(request) -> LocalLeader:
    leader = LocalLeader(CONFIG)
    request.addfinalizer(lambda: assert_clean_exit(leader))
    leader.start()
    return leader
