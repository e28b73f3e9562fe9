"""A model's files: random tiny checkpoints and their tokenizer, the tokenizer and chat
template of a checkpoint, and the identity of its weights."""
