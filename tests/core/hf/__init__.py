"""Hugging Face safetensors folders."""
