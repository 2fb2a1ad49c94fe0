"""The model: GGUF / Hugging Face loading, tokenizer, chat template, detokenizer and pipeline stages."""
