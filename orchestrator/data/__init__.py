"""Training data: text and token files, `prepare`'s tokenizer and writer, and the step-keyed
sample stream every rank reads."""
