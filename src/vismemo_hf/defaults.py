"""Names the command line needs before anything heavy is imported (``vismemo --help`` imports no torch): the
supported families and the default routing. ``families.FAMILIES`` and ``runtime/cache.py`` use these."""

#: the model families ``enable`` supports (``families.FAMILIES`` has one spec for each, in this order)
FAMILY_NAMES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")

#: the routing of ``VisMemoCache()`` (README: why)
DEFAULT_POLICY = "attend-deviate"
