"""Exports of phasekv models and prompts for other tools: an lm-evaluation-harness task (`lmeval.py`, with the
`utils.py` it ships, `lmeval_task.py`) and a DeepSeek-V4 checkpoint as a GGUF file for llama.cpp (`gguf.py`)."""
