"""Checkpoints in and out: titanlite's own (checkpointer: save, load, publish; index: which steps
exist and whether a run may resume one; model: a step folder's model rebuilt outside training)
and Hugging Face folders (hf_load: pretrained weights into the shards; hf_export: a run or a
checkpoint as a Hugging Face folder)."""
