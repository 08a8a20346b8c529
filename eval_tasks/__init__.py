"""lmms-eval tasks of vismemo-hf: pass this folder to lmms-eval as --include_path (``vismemo tasks-path``)."""
