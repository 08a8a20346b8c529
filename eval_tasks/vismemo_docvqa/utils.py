from vismemo_hf.eval.lmms_tasks import count_of, doc_to_text, doc_to_visual, mean_of, process_results  # noqa: F401
