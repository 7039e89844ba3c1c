"""Training data: deterministic batches of the synthetic language or a token file (`batches`), and text
tokenised with a Hugging Face tokenizer (`text`)."""
