"""Qwen3-Omni (thinker, talker, code predictor, Code2Wav). Import the submodules you need; nothing heavy here."""
