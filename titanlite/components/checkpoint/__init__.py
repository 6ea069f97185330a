"""Checkpoints in and out: titanlite's own (checkpointer: save, load; index: the layout on disk,
which steps exist and are intact; resume: whether a run may resume one; model: a step folder's
model rebuilt outside training) and Hugging Face folders (hf_load: pretrained weights into the
shards; hf_export: a run's exports at its end, a checkpoint as a Hugging Face folder)."""
