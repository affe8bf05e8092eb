"""A vLLM rank's lending (``reshard.integrations.vllm.peers.Peers``) without vLLM: the
mixin on a stand-in of a rank's refit state, lending over real gloo groups (threads of
this process) to a ``BootstrapReceiver``. A rank with nothing committed whole says why
and the bootstrap fails before a byte moves; a whole one lends from a thread; a refit
of the lender waits for a lending in flight before it writes what is lent."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import reshard as R
from reshard.comm import free_port
from reshard.errors import PlanError
from reshard.integrations.vllm.peers import Peers
from reshard.refit.bootstrap import BootstrapReceiver
from reshard.tools.synthetic import fill_local, matches

pytestmark = pytest.mark.multiproc
LAYOUTS = {"w": R.Layout((16, 8), R.Mesh([0]), [R.Replicate()], "bfloat16")}


class Lender(Peers):
    """What ``Peers`` reads of a vLLM rank's refit state, and nothing else."""

    def __init__(self, version: int, whole: bool) -> None:
        self.receiver = SimpleNamespace(targets={"w": fill_local(LAYOUTS["w"], 0, salt=7)})
        self.mapping = SimpleNamespace(layouts=LAYOUTS)
        self.rank, self.inference_size, self.version, self.whole = 0, 1, version, whole
        self.forwards, self.budget_bytes, self.timeout_s, self.token = 0, 1 << 20, 30.0, None
        self._init_peers()


def _new_replica(port: int) -> tuple[BootstrapReceiver | None, torch.Tensor, Exception | None]:
    target = torch.zeros(16, 8, dtype=torch.bfloat16)
    try:
        receiver = BootstrapReceiver({"w": target}, LAYOUTS, host="127.0.0.1", port=port,
                                     rank=0, tp_size=1, num_peers=1,
                                     timeout=timedelta(seconds=30))
        receiver.refit()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return None, target, e
    return receiver, target, None


def test_a_rank_with_nothing_committed_says_why():
    lender, port = Lender(version=3, whole=False), free_port()
    assert "last refit did not commit" in lender.lend("127.0.0.1", port, 0)["problem"]
    _, target, error = _new_replica(port)
    assert isinstance(error, PlanError) and "peer 0 cannot lend: rank 0's last refit did "\
        "not commit (version 3 live" in str(error), error
    assert not target.any()  # nothing moved
    assert not lender.wait_lent()["ok"]


def test_a_whole_rank_lends_and_a_refit_waits_for_it():
    lender, port = Lender(version=3, whole=True), free_port()
    assert lender.lend("127.0.0.1", port, 0)["problem"] is None
    stopped = []
    refit = threading.Thread(target=lambda: (lender._stop_lending(), stopped.append(
        (time.monotonic(), lender.lent))))
    refit.start()  # a refit of the lender: it must wait for the lending to end
    time.sleep(0.5)
    assert not stopped and lender.lending.is_alive()  # the new replica has not come yet
    receiver, target, error = _new_replica(port)
    refit.join(30)
    assert error is None and receiver.version == 3
    assert matches(LAYOUTS["w"], 0, target, salt=7)
    assert stopped and stopped[0][1]["ok"] and stopped[0][1]["bytes_sent"] == 16 * 8 * 2
    assert lender.whole is False  # the refit may now write what was lent
