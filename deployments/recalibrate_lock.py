"""The recalibration job's lock: one job per Serve application, and the journal of what it changed.

``AppLock`` holds a named detached actor per application (in Serve's namespace) under a lease its
driver renews (``RollingOptions.lock_lease_s``). A second job is refused at once (``LockHeld``, naming
the holder: pid, host, start time, Ray job). The actor keeps the holder's journal, what the job has
changed and not yet put back (``deployments.recalibrate``'s put-back reads it), each entry noted
before the change. Detached, so that the journal outlives a killed job; a lease, so that a killed
job's lock does not stay held: the next job takes it over as soon as Ray reports the holder's driver
gone (kill -9 included), or once the lease lapses. A driver-owned actor would be reclaimed by Ray at
once too, but its journal with it. The actor exits when released with nothing left to put back.
Ours rather than a library's: Ray offers no lease or lock primitive, and Serve none per application.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

logger = logging.getLogger(__name__)
LOCK_NAMESPACE = "serve"   # Serve's own: the applications' namespace


class LockHeld(RuntimeError):
    """Another job holds the application's lock (its holder named in the message)."""


class LockLost(RuntimeError):
    """This job's lease lapsed and another job took the lock over."""


def _lock_actor_class():
    """The lock actor's class, defined here so that Ray ships it by value: the actor process imports
    only ray, not this module (and torch behind it)."""

    class RecalibrationLock:
        """One application's lock: its holder, the holder's last renewal, the holder's journal."""

        def __init__(self):
            self.holder: dict | None = None
            self.renewed = 0.0     # time.monotonic() in this process: the lease needs no common clock
            self.journal: dict = {}

        def acquire(self, holder: dict, take_over: str = "") -> dict:
            """Take the lock if free, if its lease lapsed, or (``take_over``: that holder's token)
            from a holder whose driver is gone; a journal left behind goes to the new holder."""
            now, h = time.monotonic(), self.holder
            if h is None or now - self.renewed > h["lease_s"] or (take_over and h["token"] == take_over):
                self.holder, self.renewed = holder, now
                return {"ok": True, "previous": h, "journal": dict(self.journal)}
            return {"ok": False, "holder": h, "renewed_s_ago": now - self.renewed}

        def renew(self, token: str) -> bool:
            if self.holder is None or self.holder["token"] != token:
                return False
            self.renewed = time.monotonic()
            return True

        def note(self, token: str, key: str, value) -> bool:
            """Journal ``key`` (None: done with it); False if ``token`` no longer holds the lock."""
            if not self.renew(token):
                return False
            if value is None:
                self.journal.pop(key, None)
            else:
                self.journal[key] = value
            return True

        def release(self, token: str) -> None:
            """Give the lock up; with nothing left to put back the actor exits (the caller then sees
            it die): no idle actor stays in the cluster."""
            import ray

            if self.holder is not None and self.holder["token"] == token:
                self.holder = None
            if self.holder is None and not self.journal:
                ray.actor.exit_actor()

    return RecalibrationLock


def _driver_gone(job_id: str) -> bool:
    """Whether GCS marks the holder's Ray job ended (at once when its driver dies, kill -9 included).
    ``ray._private.state`` is not public API: should it change, the lease alone frees the lock."""
    try:
        from ray._private import state

        return any(j["JobID"] == job_id and j["IsDead"] for j in state.jobs())
    except Exception:  # noqa: BLE001 - unsure: not gone
        return False


def _holder_text(h: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started_at"]))
    return f"pid {h['pid']} on host {h['host']}, started {started} (Ray job {h['job_id']})"


class AppLock:
    """This job's hold on the lock of ``app`` (see the module docstring): ``acquire`` / ``release`` (or
    ``with``), ``journal`` (what the job changed and has not put back) and ``note`` to keep it."""

    def __init__(self, app: str, lease_s: float = 30.0):
        self.app, self.lease_s = app, lease_s
        self.name = f"bole-recalibrate:{app}"
        self.token = uuid.uuid4().hex
        self.journal: dict = {}
        self.previous: dict | None = None   # the holder this job took the lock over from
        self.lost = ""
        self._actor = None
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="bole-recalibrate-lock", daemon=True)

    def acquire(self) -> AppLock:
        """Hold the lock, or LockHeld naming its holder; blocking (an actor start at most)."""
        import ray
        from ray.exceptions import RayActorError

        holder = {"token": self.token, "pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                  "job_id": ray.get_runtime_context().get_job_id(), "lease_s": self.lease_s}
        cls = ray.remote(num_cpus=0, max_restarts=0)(_lock_actor_class())
        for attempt in range(5):
            try:  # get_if_exists: two jobs starting together get the same actor, which serialises them
                self._actor = cls.options(name=self.name, namespace=LOCK_NAMESPACE, lifetime="detached",
                                          get_if_exists=True).remote()
                res = ray.get(self._actor.acquire.remote(holder))
                if not res["ok"] and _driver_gone(res["holder"]["job_id"]):
                    res = ray.get(self._actor.acquire.remote(holder, res["holder"]["token"]))
                break
            except RayActorError:  # a lock being released just then exits: take a fresh one
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
        if not res["ok"]:
            h = res["holder"]
            raise LockHeld(
                f"another recalibration job holds application {self.app!r}: {_holder_text(h)}, lease renewed "
                f"{res['renewed_s_ago']:.0f} s ago; wait for it to end, or stop it (Ctrl-C / SIGTERM put back "
                f"what it changed; if it was killed, its lock is taken over within {h['lease_s']:.0f} s)")
        self.journal, self.previous = res["journal"], res["previous"]
        if self.previous:
            logger.warning("took over the lock of %r from a job that is gone: %s%s", self.app,
                           _holder_text(self.previous), f"; it left {sorted(self.journal)}" if self.journal else "")
        self._renewer.start()
        return self

    def _renew(self) -> None:
        import ray

        while not self._stop.wait(self.lease_s / 6):
            try:
                if not ray.get(self._actor.renew.remote(self.token), timeout=self.lease_s / 2):
                    self.lost = f"this job lost the lock of {self.app!r} (stalled past its {self.lease_s:.0f} s lease)"
                    logger.error(self.lost)
                    return
            except Exception as e:  # noqa: BLE001 - retried; the lease outlasts a few misses
                logger.warning("renewing the lock of %r: %s", self.app, e)

    def check(self) -> None:
        """LockLost if another job took the lock over (this one stalled past its lease)."""
        if self.lost:
            raise LockLost(self.lost)

    async def note(self, key: str, value) -> None:
        """Journal ``key`` before the change it describes (``value`` None: put back)."""
        if value is None:
            self.journal.pop(key, None)
        else:
            self.journal[key] = value
        if not await self._actor.note.remote(self.token, key, value):
            self.lost = self.lost or f"this job lost the lock of {self.app!r}"
            raise LockLost(self.lost)

    def release(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        self._stop.set()
        if self._renewer.is_alive():
            self._renewer.join(self.lease_s)
        try:
            ray.get(self._actor.release.remote(self.token), timeout=30)
        except RayActorError:
            pass   # it exited: released with nothing left to put back
        except Exception as e:  # noqa: BLE001 - the lease frees it anyway
            logger.warning("releasing the lock of %r: %s (its lease lapses in %.0f s)", self.app, e, self.lease_s)

    def __enter__(self) -> AppLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
