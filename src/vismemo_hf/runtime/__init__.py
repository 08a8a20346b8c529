"""The data path of one request: lookup (``lookup``, ``features``, ``thresholds``) -> plan (``plan``, with ``policies/``) ->
execution (``runner``, ``context``, ``cache``, ``attention``, ``rope``, ``compress``), wired into a model by
``hooks``."""
