"""Helpers for development, the demo and the benchmarks, never imported by the data path: CPU fallbacks for
the trainer (`cpu`), a local vLLM server (`vllm_server`) and the tiny locally-built model (`tiny_model`)."""
