"""A fused step's packages compiled in a child process (flowvm/fused/outofprocess.py) or taken from the
persistent cache (flowvm/fused/cache.py), a part of ``Runtime`` (flowvm/fused/runtime.py): the stages are
the job (``jobs.describe``: refused with a reason, or its pickle and key), the cache's entry or the child's
compile, and the package installed behind the direct form's checks, verified against eager on its first
call."""

from __future__ import annotations

import os
import time

from . import cache, torch_internals, jobs, outofprocess, resources
from .compiler import compile_seconds as compiler_seconds


class Packaged:
    def _may_go_out_of_process(self) -> bool:
        import torch

        s = self.settings
        return not (s.compile_in != "process" or s.backend != "inductor" or s.mode not in (None, "default")
                    or s.dynamic or s.form == "eager" or self._direct is not None or self.refused is not None
                    or torch.is_inference_mode_enabled() or torch_internals.autocast_enabled())

    def _out_of_process(self, args) -> bool:
        """Start compiling the head for these inputs in a child process (flowvm/fused/outofprocess.py), when
        the settings and the step allow it, or take its package from the cache; whether it did.  A refusal
        or failure there leaves the compile to the background thread: the next execution starts it."""
        if not self._may_go_out_of_process():
            return False
        try:
            return self._start_out_of_process(args)
        except Exception as err:  # an input torch cannot describe, say: the thread compiles
            self.refused = f"{type(err).__name__}: {err}"
            return False

    def _orphaned(self) -> None:
        """This process was forked from the one whose child process compiles the step: the result will
        never arrive here, so the thread compiles it."""
        self._job_pid = None
        if self._job_running:
            self._job_running = False
            self.refused = "the process forked while its compile ran"
            self.compiles -= 1
            self._waiting = True

    def _start_out_of_process(self, args) -> bool:
        job = jobs.describe(self.el, self.generated, self.settings.options, args)
        if isinstance(job, str):
            self.refused = job  # the reason it compiles on the thread
            return False
        if job.key is not None and self._cached(job):
            self._job_done = True  # the next execution runs it
            return True
        hint = jobs.hint(self.generated, self.settings.options, args) if job.key is not None else None
        self._hint = hint
        start = time.perf_counter()

        def done(run, error):
            try:
                if run is not None:
                    self._direct = (job.layouts, run, run, job.reads)
                    self._verify = True  # the first call is checked against eager (_after_first_direct_call)
                    self._cache_key = job.key
                    if job.key is not None:
                        cache.add_hint(hint, job.key)  # only when the entry was stored whole
                    self.compile_seconds.append(time.perf_counter() - start)
                    compiler_seconds.append(self.compile_seconds[-1])
            finally:
                self._job_running, self._job_pid = False, None
                if run is not None:
                    self._job_done = True
                else:
                    self.refused = error or "no package"
                    self.compiles -= 1
                    self._waiting = True  # the next execution starts the thread's compile

        self.compiles += 1
        self._waiting, self._job_running, self._job_pid = False, True, os.getpid()
        try:
            outofprocess.Compile(job.payload, job.load, done, **({"key": job.key} if job.key else {}))
        except outofprocess.Busy:  # no thread for it now: the machine is short of resources, try later
            self.compiles -= 1
            self._job_running, self._job_pid = False, None
            self._later()
        return True

    def _cached(self, job: jobs.Job) -> bool:
        """Take the step's package from the persistent cache (flowvm/fused/cache.py), if it is there and loads;
        whether it did.  The entry is checked against its manifest before anything of it is loaded (one that
        fails is evicted: a miss, compiled anew).  It is checked as a package just compiled is: before each
        call, and against eager on its first unless its kept decision says an earlier run did."""
        path = cache.lookup(job.key)
        if path is None:
            return False
        known = cache.decision(path)
        if known is not None and not known["compiled"]:
            # an earlier run measured eager faster: the package is loaded only when it is timed again
            self._deferred = (job, path)
        else:
            try:
                self._load(job, path, checked=True)
            except Exception:  # damaged, or from a torch that writes what this one cannot read
                cache.evict(job.key)
                return False
        self.compiles += 1
        self._cache_key, self.cached, self._known = job.key, True, known
        # a decision is kept only for a package that was checked against eager on its first call and timed:
        # a later run does not check its first call again (the checks before each call still hold)
        self._verify = known is None
        return True

    def _load(self, job: jobs.Job, path: str, checked: bool = False) -> None:
        """Load the cached entry at path: checked against its manifest first (again, unless ``checked`` just
        now: a load put off may come much later), and marked as being loaded while its libraries open."""
        if not checked:
            cache.verify(job.key, path)
        with cache.loading(path):
            run = job.load(path)
        self._direct = (job.layouts, run, run, job.reads)

    def _load_deferred(self) -> bool:
        """Load the cached package whose loading was put off (``_cached``), now that it is to run; whether it
        loaded.  One that fails to load leaves the cache, with what an earlier run measured of it, and the
        step compiles anew (``_compile_anew``)."""
        (job, path), self._deferred = self._deferred, None
        try:
            self._load(job, path)
            return True
        except Exception:
            pass
        self.cached, self._known, self.trials_done, self._job_done = False, None, 0, False
        self._compile_anew()
        return False

    def _from_cache(self, args) -> bool:
        """At the step's first execution: whether its package came from the persistent cache (then it runs
        compiled from now on, whatever ``compile_after`` and ``payback`` say: it costs no compile)."""
        if cache.root() is None or not self._may_go_out_of_process():
            return False
        try:
            hint = jobs.hint(self.generated, self.settings.options, args)
            if not cache.may_hold(hint):
                return False  # never stored: no need to pickle the step for its key
            self._hint = hint
            if self._refused_now() or self._eager_by_hint(hint):
                return False
            job = jobs.describe(self.el, self.generated, self.settings.options, args)
        except Exception:  # it does not pickle: the compile says why, in its time
            return False
        return not isinstance(job, str) and job.key is not None and self._cached(job)

    def _later(self) -> None:
        """The machine is short of resources (threads, memory): start this compile again after a while."""
        self._tries += 1
        self._retry_at = time.monotonic() + resources.backoff(self._tries)
        self._waiting = True
