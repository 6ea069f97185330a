"""Trainer components: loss, optimizer + LR schedule, tokenizer, metrics, the log step's window,
the run folder, checkpoints, fault injection."""
