"""A model's files: checkpoint writing and loading checks, tokenizer, chat template, the
tiny test model and tokenizer, and the weights' identity."""
