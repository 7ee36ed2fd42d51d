"""The model: presets and the GPT-2 config, the chunked loss, and the held-out measures (loss, perplexity,
HellaSwag). Imports neither deepspeed nor pymongo."""
