"""llm_core: load Hugging Face causal LMs in 4-bit, stream chat replies and measure what each reply costs.

Importing this package loads no model and imports no UI code; see generation.ChatEngine.load.
"""
