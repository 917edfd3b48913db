"""Benchmarks: the offline engine benchmark (`offline`), the serving benchmark against any
OpenAI-compatible server (`serving`), and the Hugging Face peers they are measured against
(`hf_peers`)."""
