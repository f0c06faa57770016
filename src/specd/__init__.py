"""specd: a speculative-decoding LLM inference engine that tells the truth about speculation."""
