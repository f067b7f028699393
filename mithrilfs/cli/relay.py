"""A command run on the user's behalf (``run``'s): the signals that would stop us go to the command.

``run`` must outlive its command to take down what it set up for it (a
mount, torch's headers link, a temporary directory), and SIGTERM and SIGHUP
kill a Python process outright: that is what ``timeout``, Slurm, ``docker
stop`` and Kubernetes send.  So ``Relay``, from before anything is set up
until it is all taken down, keeps SIGINT, SIGTERM and SIGHUP blocked and
takes them with ``sigwaitinfo`` (as tini does), never with handlers:

- while the command runs, each goes on to it (``os.kill``), unless it
  reached the command already: a terminal's Ctrl-C (and the hangup the
  kernel sends the foreground group, when we are not the session leader
  it hangs up) goes to the whole foreground process group, and a second
  copy would interrupt the command's own clean-up.  We then wait for the
  command however long it takes; whoever asked escalates (``timeout -k``,
  the runtime's SIGKILL);
- before it runs (while we mount), one is held, and the command is not
  started (``received``).

A signal we were started ignoring (``nohup`` ignores SIGHUP; a shell's
background job, SIGINT) stays ignored, by us as by the command, which
inherits that: the caller asked that it stop nothing.

The command starts with the signal mask we were given and the default
SIGPIPE and SIGXFSZ, as ``subprocess`` starts one.
"""

from __future__ import annotations

import os
import signal
from types import TracebackType

#: What stops ``run`` as it stops the command.
RELAYED = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
#: ``si_code`` of a signal the kernel sent (a terminal's keys and hangup).
SI_KERNEL = 0x80


class Relay:
    """A context: while in it, ``RELAYED`` signals are taken by ``run`` and ``received``, not delivered."""

    def __init__(self) -> None:
        #: The first of ``taken`` received (None: none yet).
        self.signum: int | None = None
        #: The ``RELAYED`` signals we were not started ignoring: those we take and relay.
        self.taken: frozenset[signal.Signals] = RELAYED
        self._mask: set[int | signal.Signals] = set()

    def __enter__(self) -> Relay:
        self.taken = frozenset(s for s in RELAYED if signal.getsignal(s) != signal.SIG_IGN)
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, {*self.taken, signal.SIGCHLD})
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.received()  # what came during the clean-up is taken too: unblocked, it would kill us now
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)

    def received(self) -> int | None:
        """The first signal received so far (taking those waiting), or None."""
        while self.taken and (info := signal.sigtimedwait(self.taken, 0)) is not None:
            self._note(info.si_signo)
        return self.signum

    def run(self, cmd: list[str], env: dict[str, str]) -> int:
        """Run *cmd* to its end, relaying; its exit status, or -N when signal N killed it.

        OSError (FileNotFoundError for a command not found) when it cannot start.
        """
        pid = os.posix_spawnp(cmd[0], cmd, env, setsigmask=self._mask, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        waited = {*self.taken, signal.SIGCHLD}
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            info = signal.sigwaitinfo(waited)  # a SIGCHLD that came since the waitpid is waiting: no race
            if info.si_signo == signal.SIGCHLD:
                continue
            self._note(info.si_signo)
            if not _reached_the_command(info):
                try:
                    os.kill(pid, info.si_signo)
                except ProcessLookupError:
                    pass

    def _note(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum


def _reached_the_command(info: signal.struct_siginfo) -> bool:
    """The kernel sent it to the terminal's foreground group, the command included: Ctrl-C, and a hangup
    unless it went to us alone as the leader of the session it ends."""
    if info.si_code != SI_KERNEL:
        return False
    return info.si_signo == signal.SIGINT or (info.si_signo == signal.SIGHUP and os.getsid(0) != os.getpid())
