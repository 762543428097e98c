"""Turn SIGTERM / SIGINT into a stop request that the step loop honours at a step boundary.

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM some seconds before they kill a job;
under the deepspeed launcher and torchrun the signal reaches every rank (the launcher forwards it
to its children, and a process-group kill reaches them directly). The handler only records the
signal; the trainer finishes the current optimizer step, agrees with the other ranks that someone
was signalled, writes a checkpoint and exits. A second Ctrl-C (SIGINT) stops at once.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager: while active, SIGTERM/SIGINT set `signum` instead of ending the process.

    Installed only in the main thread (Python's rule for signal handlers); elsewhere it is inert.
    The previous handlers are restored on exit.
    """

    def __init__(self, *, announce: bool = True) -> None:
        self.signum: int | None = None
        self._announce = announce
        self._previous: dict[int, Any] = {}

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
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            # Second Ctrl-C: the user does not want to wait for the checkpoint.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
            if self._announce:
                # os.write, not print: a handler may run in the middle of another print.
                name = signal.Signals(signum).name
                hint = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
                os.write(
                    2,
                    f"\n{name} received: finishing this step, then writing a checkpoint{hint}\n".encode(),
                )


def agreed_signal(request: StopRequest | None) -> int:
    """The stop signal any rank received (0: none). Collective, so that every rank stops after
    the same step even when the signal reached them at different moments."""
    import torch

    from align_anything.backend import distributed as comm

    flag = torch.tensor([float(request.signum or 0) if request is not None else 0.0])
    comm.all_reduce_max(flag)
    return int(flag.item())
