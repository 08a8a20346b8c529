"""Evaluation: synthetic pages and streams (``synthdoc``, ``synthetic``), the packaged reader (``docqa``),
quality of reuse (``quality``), the lmms-eval backend and task helpers (``lmms``, ``lmms_tasks``) and VL-Cache's
calibration profile (``vlcache_profile``)."""
