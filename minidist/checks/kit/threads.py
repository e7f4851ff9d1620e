"""Every thread started after this module's import traced for the refusals active at the time
(:class:`Threads`): the refusal (:class:`minidist.checks.kit.refusal.refusing`) holds on a thread that
was already waiting for work when the graded code ran (a ``ThreadPoolExecutor``'s worker), not only on
the threads the graded code starts itself. Threads started before the import (the kernel's own) are
out of its reach (Python 3.11 cannot trace a running thread from another).
"""
from __future__ import annotations

import sys
import threading


class Threads:
    """Every thread started after this module's import traces its calls for the refusals active
    at the time (:meth:`ambient`; none active: one cheap call per function call): ``_thread``'s
    ``start_new_thread`` (and ``threading``'s reference to it) are wrapped for good, so a thread
    started before the graded code ran (a ``ThreadPoolExecutor``'s worker waiting for work, a
    ``_thread`` taken early) is refused library answers too once graded code runs. ``threading``
    threads started while graded code runs get the refusal's own tracer (``threading.settrace``)."""

    def __init__(self):
        self.active: list = []
        self.original = None
        self.ambient = self._ambient       # one bound method, so that `is` recognises it

    def install(self):
        import _thread
        if self.original is None:
            self.original = _thread.start_new_thread
            _thread.start_new_thread = self._start
            if getattr(threading, "_start_new_thread", None) is self.original:
                threading._start_new_thread = self._start

    def enter(self, refusing_):
        self.active.append(refusing_)

    def exit(self, refusing_):
        if refusing_ in self.active:
            self.active.remove(refusing_)

    def _ambient(self, frame, event, arg):
        active = self.active
        return active[-1]._trace(frame, event, arg) if active else None

    def _start(self, function, args, kwargs=None):
        ambient = self.ambient

        def traced(*a, **k):
            sys.settrace(ambient)
            return function(*a, **k)
        return self.original(traced, args, kwargs or {})


THREADS = Threads()
THREADS.install()
