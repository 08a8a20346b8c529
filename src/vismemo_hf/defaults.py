"""Names the command line needs before anything heavy is imported (``vismemo --help`` imports no torch): the
supported families and the default routing. ``families.FAMILIES`` and ``runtime/cache.py`` use these."""

#: the model families ``enable`` supports: model_type -> the file of ``vismemo_hf/families/`` whose adapter serves it
#: (``families.FAMILIES`` has one adapter class for each, in this order)
FAMILY_MODULES = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "glm4v": "glm4v",
    "glm46v": "glm4v",
    "glm4v_moe": "glm4v",
    "llava_onevision": "llava_onevision",
}
FAMILY_NAMES = tuple(FAMILY_MODULES)

#: the routing of ``VisMemoCache()`` (docs/policies.md: why)
DEFAULT_POLICY = "attend-deviate"
