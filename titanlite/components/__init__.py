"""Trainer components: loss, optimizer + LR schedule, tokenizer, metrics, the log step's window,
the run folder, checkpoints, pretrained Hugging Face weights, fault injection."""
