"""The demo target: a tiny DeepSeek-V3 model with a Kimi-format tokenizer, pre-trained on ShareGPT."""
