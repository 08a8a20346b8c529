"""Plain data types and math at the bottom of the package: plans and events, image features and sketches, RoPE
re-rotation, lookup thresholds and reference images. Nothing here imports another vismemo_hf subpackage."""
