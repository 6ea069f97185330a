"""Trainer components: loss, optimizer, LR schedule, tokenizer, metrics."""
