"""Turn SIGTERM / SIGINT into a stop request that the step loop honours at a step boundary.

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM some seconds before they kill a job;
under the deepspeed launcher and torchrun the signal reaches every rank (the launcher forwards it
to its children, and a process-group kill reaches them directly). The first signal is only
recorded: the trainer finishes the current optimizer step, agrees with the other ranks that
someone was signalled, writes a checkpoint and exits.

Two things could keep that from happening, and each has its way out:
- A second signal (SIGTERM or SIGINT, e.g. Ctrl-C twice) stops at once: the handler raises
  `Preempted`, the run records "stopped" in run.json, releases its lock and exits with
  128 + the signal; the step in progress is lost, the last complete checkpoint stands. Under a
  launcher (the deepspeed launcher, torchrun) one signal to the process
  group reaches a rank twice, directly and forwarded by the launcher (which sends SIGTERM to
  each rank in turn, waiting for the previous one to end), so there the first two signals are
  one request and the third stops at once.
- A step that cannot end: a reward function that does not return. The step loop would never
  reach its boundary, and a scheduler sends SIGTERM once, then SIGKILL after its grace period
  (Slurm's KillWait and Kubernetes' terminationGracePeriodSeconds are 30 s by default). So a
  reward call in progress when the first signal comes gets `REWARD_GRACE_S` more seconds; if
  it has not returned by then it is abandoned and the run stops as above (`rewards.RewardCall`).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any, Protocol

from align_anything.errors import Preempted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What a reward call in progress may still take after the first stop signal: well inside the
# 30 s a scheduler leaves by default, with time left to write the checkpoint if it returns.
REWARD_GRACE_S = 10.0


class StopRequest:
    """Context manager: while active, SIGTERM/SIGINT set `signum` instead of ending the process;
    a second one raises `Preempted` at once.

    Installed only in the main thread (Python's rule for signal handlers); elsewhere it is inert.
    The previous handlers are restored on exit.
    """

    def __init__(self, *, announce: bool = True, launched: bool | None = None) -> None:
        self.signum: int | None = None
        self._announce = announce
        self._previous: dict[int, Any] = {}
        self._received = 0
        # Signals that still belong to the first request: the launcher's forward of a
        # process-group signal (`launched`: None reads the environment, `launched_by_launcher`).
        if launched is None:
            launched = launched_by_launcher()
        self._one_request = 2 if launched else 1

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self._received += 1
        if self.signum is not None and self._received <= self._one_request:
            return  # the launcher forwarding the signal this rank already received
        if self.signum is not None:
            first = signal.Signals(self.signum).name
            raise Preempted(
                f"stopped at once by a second stop signal ({name} after {first}): the step in "
                "progress was not finished and no checkpoint of it was written; resume=auto "
                "continues from the newest complete checkpoint",
                signum,
            )
        self.signum = signum
        if self._announce:
            # os.write, not print: a handler may run in the middle of another print.
            os.write(
                2,
                f"\n{name} received: finishing this step, then writing a checkpoint (send it "
                "again, or press Ctrl-C, to stop at once)\n".encode(),
            )
        call = _waiting_on
        if call is not None:
            call.cut_short(REWARD_GRACE_S, signum)


class CutShort(Protocol):
    """A call the main thread waits on that a stop signal may cut short (a reward function's:
    `rewards.functions.RewardCall`)."""

    def cut_short(self, seconds: float, signum: int) -> None: ...


_waiting_on: CutShort | None = None


def waiting_on(call: CutShort | None) -> None:
    """Register the call the main thread is in right now (None: it left it), so that a stop
    signal gives it at most `REWARD_GRACE_S` more instead of waiting for the step to end."""
    global _waiting_on
    _waiting_on = call


def launched_by_launcher() -> bool:
    """Whether a launcher that forwards stop signals started this process: the deepspeed
    launcher sets LOCAL_SIZE, torchrun TORCHELASTIC_RUN_ID (LOCAL_RANK will not do: set-up
    sets it for a plain `python -m` run too)."""
    return "LOCAL_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def agreed_signal(request: StopRequest | None) -> int:
    """The stop signal any rank received (0: none). Collective, so that every rank stops after
    the same step even when the signal reached them at different moments."""
    import torch

    from align_anything.backend import distributed as comm

    flag = torch.tensor([float(request.signum or 0) if request is not None else 0.0])
    comm.all_reduce_max(flag)
    return int(flag.item())
