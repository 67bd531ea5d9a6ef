"""The draft engine's one worker thread (``DraftEngine`` runs every drafter call on it), as a
``concurrent.futures.Executor`` that can also watch sockets.

Submitted calls run in order, as on a one-thread ``ThreadPoolExecutor``. Between them the
thread waits in a selector, where ``watch`` registers sockets: when one is readable its
callback runs on this thread. The local stream (``draft_service.local``) uses that to read a
target's step, run it and answer without leaving the thread, instead of a hop from the
server's event loop to the worker and back (two thread wake-ups a step, on the critical path
of every cycle at bs 1).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

logger = logging.getLogger(__name__)

_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class Worker(Executor):
    """One thread: submitted calls in order, and callbacks of watched sockets."""

    def __init__(
        self, name: str, initializer: Callable[..., None], initargs: tuple[Any, ...] = ()
    ) -> None:
        self._calls: deque[_Call] = deque()
        self._lock = threading.Lock()
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(
            target=self._main, args=(initializer, initargs), name=name, daemon=True
        )
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._calls.append((future, fn, args, kwargs))
        self._wake()
        return future

    def watch(self, sock: socket.socket, on_readable: Callable[[], None]) -> None:
        """Runs ``on_readable`` on the worker whenever ``sock`` is readable (from the worker
        thread only: a submitted call or a callback)."""
        self._selector.register(sock, selectors.EVENT_READ, on_readable)

    def unwatch(self, sock: socket.socket) -> None:
        """Stops watching ``sock`` (worker thread only); a no-op for one not watched."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closing = True
            if cancel_futures:
                while self._calls:
                    self._calls.popleft()[0].cancel()
        self._wake()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # closed: the thread has ended
            self._wake_w.send(b"\0")

    def _main(self, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
        initializer(*initargs)
        try:
            while True:
                while True:
                    with self._lock:
                        call = self._calls.popleft() if self._calls else None
                        done = call is None and self._closing
                    if call is None:
                        break
                    self._run(call)
                if done:
                    return
                for key, _ in self._selector.select():
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            while self._wake_r.recv(4096):
                                pass
                    else:
                        try:
                            key.data()
                        except Exception:
                            logger.exception("a watched socket's callback failed")
        finally:
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    @staticmethod
    def _run(call: _Call) -> None:
        future, fn, args, kwargs = call
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
